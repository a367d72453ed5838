//! Runs a booted VM for the CLI: follows the guest's console lines, keeps
//! its progress figures, and reports guest failures.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use serde::Serialize;
use tsubame_vmm::guest_elf::{parse_progress, ProgressLine};
use tsubame_vmm::ConsoleLine;

/// The guest's progress as its `tsb ops=N pass=M` lines tell it.
#[derive(Debug, Default, Clone, Serialize)]
pub struct GuestProgress {
    /// Progress lines seen.
    pub lines: u64,
    /// Latest ops counter.
    pub ops: u64,
    /// Latest pass counter.
    pub pass: u64,
    /// Ops per second over the last ~second of lines.
    pub ops_per_sec: f64,
    /// Ops per second from the first progress line to the last.
    pub mean_ops_per_sec: f64,
    /// The guest's error or exception line, if it printed one.
    pub error: Option<String>,
    /// The latest line's further `key=value` counters (`gap_us`, the
    /// guest's largest stall since its previous line; disk workloads:
    /// `rd`, `wr` bytes; `ack`, the last write acknowledged).
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub fields: std::collections::BTreeMap<String, u64>,
    #[serde(skip)]
    first: Option<(Instant, u64)>,
    #[serde(skip)]
    window: std::collections::VecDeque<(Instant, u64)>,
}

impl GuestProgress {
    fn record(&mut self, at: Instant, text: &str) {
        if let Some(ProgressLine { ops, pass }) = parse_progress(text) {
            self.lines += 1;
            self.ops = ops;
            self.pass = pass;
            for token in text.split_ascii_whitespace().skip(3) {
                if let Some((key, value)) = token.split_once('=') {
                    if let Ok(value) = value.parse() {
                        self.fields.insert(key.to_string(), value);
                    }
                }
            }
            let (t0, ops0) = *self.first.get_or_insert((at, ops));
            let span = at.duration_since(t0).as_secs_f64();
            if span > 0.0 {
                self.mean_ops_per_sec = ops.saturating_sub(ops0) as f64 / span;
            }
            self.window.push_back((at, ops));
            while self.window.len() > 2 && at.duration_since(self.window[0].0) > Duration::from_secs(1) {
                self.window.pop_front();
            }
            let (tw, opsw) = self.window[0];
            let span = at.duration_since(tw).as_secs_f64();
            if span > 0.0 {
                self.ops_per_sec = ops.saturating_sub(opsw) as f64 / span;
            }
        } else if text.starts_with("tsubame-guest: error") || text.starts_with("tsubame-guest: exception") {
            self.error.get_or_insert_with(|| text.to_string());
        }
    }
}

/// How console lines are shown.
#[derive(Debug, Clone, Copy)]
pub enum Echo {
    /// Not at all.
    Quiet,
    /// As the guest printed them.
    Plain,
    /// Prefixed with milliseconds since `since`.
    Timestamped(Instant),
}

impl Echo {
    /// From the `--quiet` and `--verbose` flags.
    pub fn from_flags(quiet: bool, verbose: bool) -> Echo {
        if quiet {
            Echo::Quiet
        } else if verbose {
            Echo::Timestamped(std::time::Instant::now())
        } else {
            Echo::Plain
        }
    }
}

/// Follows a VM's console on a thread of its own.
pub struct ConsoleFollower {
    /// Shared progress, updated as lines arrive.
    pub progress: Arc<Mutex<GuestProgress>>,
    thread: Option<JoinHandle<()>>,
}

impl ConsoleFollower {
    /// Starts following; the thread ends when the VM's console closes.
    pub fn start(console: Receiver<ConsoleLine>, echo: Echo) -> ConsoleFollower {
        let progress = Arc::new(Mutex::new(GuestProgress::default()));
        let shared = progress.clone();
        let thread = std::thread::Builder::new()
            .name("console".into())
            .spawn(move || {
                let stdout = std::io::stdout();
                for line in console {
                    match echo {
                        Echo::Quiet => {}
                        Echo::Plain => {
                            let _ = writeln!(stdout.lock(), "{}", line.text);
                        }
                        Echo::Timestamped(since) => {
                            let ms = line.at.saturating_duration_since(since).as_secs_f64() * 1e3;
                            let _ = writeln!(stdout.lock(), "[{ms:10.3} ms] {}", line.text);
                        }
                    }
                    shared.lock().unwrap().record(line.at, &line.text);
                }
            })
            .expect("spawn console thread");
        ConsoleFollower { progress, thread: Some(thread) }
    }

    /// A copy of the current progress.
    pub fn snapshot(&self) -> GuestProgress {
        self.progress.lock().unwrap().clone()
    }
}

impl Drop for ConsoleFollower {
    fn drop(&mut self) {
        // The thread ends when the VM (the console's sender) is gone; don't
        // wait for it if the VM outlives us.
        drop(self.thread.take());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_from_lines() {
        let mut p = GuestProgress::default();
        let t0 = Instant::now();
        p.record(t0, "tsb ops=0 pass=0");
        p.record(t0 + Duration::from_millis(500), "tsb ops=500 pass=0");
        p.record(t0 + Duration::from_millis(1000), "tsb ops=1000 pass=1");
        assert!(p.fields.is_empty());
        p.record(t0 + Duration::from_millis(1100), "tsb ops=1100 pass=1 gap_us=812 rd=8192 ack=7");
        assert_eq!(p.fields.get("gap_us"), Some(&812));
        assert_eq!(p.fields.get("rd"), Some(&8192));
        assert_eq!(p.fields.get("ack"), Some(&7));
        assert!((p.mean_ops_per_sec - 1000.0).abs() < 1.0);
        assert_eq!(p.pass, 1);
        p.record(t0, "tsubame-guest: exception vector=14 rip=0x1");
        assert!(p.error.unwrap().contains("vector=14"));
    }
}
