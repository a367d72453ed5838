//! Post-copy trials: the VM switches to the destination at once and its
//! pages follow; the proxy cuts the link (which then comes back: the
//! source reconnects by itself) or kills either end with -9, at the
//! switch, at POSTCOPY_RUNNING, at a pushed or asked-for page frame, at a
//! PAGE_REQUEST or at POSTCOPY_DONE.
//!
//! A cut must end with the VM running at the destination, every page
//! there (the destination's page-by-page digest comparison, "post-copy
//! done") and the guest going on. A process killed after the switch
//! takes the VM with it (the design's rule: the VM is lost, never
//! duplicated): the survivor must run nothing and say "the VM is lost".

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::common::{scratch, spawn_run, try_control as control, wait_for_socket};
use crate::proxy::{Action, Point, Proxy};
use crate::{guest_progresses, migration_end, read, Outcome, Rng};

const VM: &[&str] = &["--memory", "64M", "--workload", "kv", "--workload-arg", "wss=16M"];

pub fn trial(index: usize, rng: &mut Rng, action: Action, point: Point) -> Outcome {
    let dir = scratch(&format!("faults-pc-{index}"));
    let (source_sock, dest_sock) = (dir.join("source.sock"), dir.join("dest.sock"));
    let (incoming, dest_log, source_log) = (dir.join("incoming.sock"), dir.join("dest.log"), dir.join("source.log"));
    let mut source = spawn_run(&source_sock, VM, std::fs::File::create(&source_log).unwrap().into());
    let mut dest = crate::spawn_receive_with(&incoming, &dest_sock, &dest_log, &[]);
    wait_for_socket(&source_sock);
    wait_for_socket(&dest_sock);
    std::thread::sleep(Duration::from_millis(200 + rng.below(200)));

    let proxy = Proxy::new(action, point, source.0.id(), dest.0.id(), action == Action::Cut);
    let proxy_path = dir.join("proxy.sock");
    let relay = proxy.start(&proxy_path, incoming.clone());
    let request = json!({
        "cmd": "migrate",
        "to": format!("unix:{}", proxy_path.display()),
        "postcopy": "after=0",
        // A cut link comes back within it; a killed end is given up on
        // after it.
        "postcopy_timeout_s": if action == Action::Cut { 10 } else { 3 },
        // Slow enough that the phase lasts a second or two.
        "max_bandwidth": 12_000_000 + rng.below(8_000_000),
    });
    let reply = control(&source_sock, &request);
    if reply.as_ref().map(|r| r["ok"] != true).unwrap_or(true) {
        return Outcome::Broken(format!("migrate request failed: {reply:?}"));
    }
    // The source's migration ends (completed or failed), or the source is
    // gone: it exits once the VM is all at the destination.
    let source_query = migration_end(&mut source, &source_sock);
    // The destination settles: done, failed, gone, or never switched.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let log = read(&dest_log);
        let switched = log.contains("post-copy: the VM runs here");
        if !dest.alive()
            || log.contains("post-copy done")
            || log.contains("incoming migration failed")
            || (!switched && source_query["status"] == "failed")
        {
            break;
        }
        if Instant::now() > deadline {
            return Outcome::Broken(format!("destination never settled: {log}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    proxy.stop.store(true, std::sync::atomic::Ordering::Release);
    let _ = relay.join();
    let seen = std::mem::take(&mut *proxy.seen.lock().unwrap());

    let source_status = control(&source_sock, &json!({"cmd": "stats"}));
    let dest_status = control(&dest_sock, &json!({"cmd": "stats"}));
    let status = |s: &Option<Value>| s.as_ref().map(|s| s["status"].as_str().unwrap_or("").to_string());
    let source_running = status(&source_status).as_deref() == Some("running");
    let dest_running = status(&dest_status).as_deref() == Some("running");
    let (dlog, slog) = (read(&dest_log), read(&source_log));
    // The destination ran the VM: it says so, or the source heard it.
    let switched = dlog.contains("post-copy: the VM runs here") || seen.running;
    let describe = || {
        format!(
            "{action:?} at {point:?}, proxy {seen:?}: source {source_status:?}, query {source_query}, destination \
             {dest_status:?}; destination log: {} ; source log: {}",
            dlog.trim().replace('\n', " | "),
            slog.trim().replace('\n', " | ")
        )
    };
    if source_running && dest_running {
        return Outcome::Duplicated(describe());
    }
    if dest_running {
        if let Err(e) = guest_progresses(&dest_sock) {
            return Outcome::Broken(format!("{e}: {}", describe()));
        }
        // Every page arrived and matched the source's digest.
        if !dlog.contains("post-copy done") && !dlog.contains("memory verified") {
            return Outcome::Broken(format!("destination runs without all its pages verified: {}", describe()));
        }
        return Outcome::OneRunning("destination");
    }
    if source_running {
        if let Err(e) = guest_progresses(&source_sock) {
            return Outcome::Broken(format!("{e}: {}", describe()));
        }
        if switched {
            return Outcome::Broken(format!("the source resumed after the switch: {}", describe()));
        }
        return Outcome::OneRunning("source");
    }
    let error = source_query["stats"]["error"].as_str().unwrap_or("");
    if status(&source_status).as_deref() == Some("paused") && error.contains("stays paused here") {
        return Outcome::SourcePausedSaysSo;
    }
    if switched && action != Action::Cut {
        // The survivor runs nothing and says why in one line.
        let survivor_says = match action {
            Action::KillSource => dlog.contains("the VM is lost"),
            _ => slog.contains("the VM is lost") || error.contains("the VM is lost"),
        };
        if survivor_says {
            return Outcome::GoneWithHost("a killed end, after the switch");
        }
    }
    if !switched && action == Action::KillSource && !source.alive() {
        return Outcome::GoneWithHost("the killed source, before the switch");
    }
    Outcome::Lost(describe())
}

/// The points of the post-copy phase, in turn.
pub fn point(k: usize, rng: &mut Rng) -> Point {
    match k % 5 {
        0 => Point::Switch,
        1 => Point::Running,
        2 => Point::PostcopyPages { nth: 1 + rng.below(40) as u32 },
        3 => Point::Request { nth: 1 + rng.below(10) as u32 },
        _ => Point::Done,
    }
}
