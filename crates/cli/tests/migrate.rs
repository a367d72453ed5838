//! Live migration between `tsubame` processes, and failures at chosen
//! points. After every failure the source VM must keep running and no
//! second copy may run at the destination.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use common::{control, kvm_or_skip, read_raw_frame, scratch, tsubame, wait_for_socket, Proc};
use serde_json::{json, Value};
use tsubame_migrate::protocol::{FrameKind, PREAMBLE_LEN};

/// A source VM (`run --control`) and a destination (`receive --control`).
struct Pair {
    source: Proc,
    dest: Proc,
    /// Last: removed after both processes stopped.
    dir: common::Scratch,
}

impl Pair {
    fn start(name: &str, source_args: &[&str], dest_args: &[&str]) -> Pair {
        let dir = scratch(name);
        let source = tsubame()
            .args(["run", "--quiet", "--control"])
            .arg(dir.join("source.sock"))
            .args(source_args)
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let dest = tsubame()
            .args(["receive", "--quiet", "--listen"])
            .arg(format!("unix:{}", dir.join("incoming.sock").display()))
            .arg("--control")
            .arg(dir.join("dest.sock"))
            .args(dest_args)
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let pair = Pair { dir, source: Proc(source), dest: Proc(dest) };
        wait_for_socket(&pair.source_control());
        wait_for_socket(&pair.dest_control());
        pair
    }

    fn source_control(&self) -> PathBuf {
        self.dir.join("source.sock")
    }
    fn dest_control(&self) -> PathBuf {
        self.dir.join("dest.sock")
    }
    fn incoming(&self) -> String {
        format!("unix:{}", self.dir.join("incoming.sock").display())
    }

    /// Runs `tsubame migrate`; returns its exit code, stdout+stderr, JSON.
    fn migrate(&self, to: &str, extra: &[&str]) -> (i32, String, Value) {
        let (code, text, stats) = common::migrate_via(&self.source_control(), to, &self.dir.join("stats.json"), extra);
        (code.unwrap_or(-1), text, stats)
    }

    /// The source VM runs and its guest makes progress.
    fn assert_source_runs(&self) {
        let first = control(&self.source_control(), &json!({"cmd": "stats"}));
        assert_eq!(first["status"], "running", "source VM is not running: {first}");
        std::thread::sleep(Duration::from_millis(300));
        let later = control(&self.source_control(), &json!({"cmd": "stats"}));
        assert!(
            later["guest"]["ops"].as_u64() > first["guest"]["ops"].as_u64(),
            "source guest stopped making progress: {first} then {later}"
        );
    }

    /// The destination runs no VM: it is dead or waiting again.
    fn assert_no_copy_at_destination(&mut self) {
        std::thread::sleep(Duration::from_millis(200));
        if self.dest.0.try_wait().unwrap().is_some() {
            return;
        }
        let stats = control(&self.dest_control(), &json!({"cmd": "stats"}));
        assert_eq!(stats["status"], "waiting", "destination runs a copy: {stats}");
    }
}

const SMALL_VM: &[&str] = &["--memory", "128M", "--workload", "kv", "--workload-arg", "wss=32M"];

#[test]
fn migrate_between_processes_and_guest_continues() {
    if !kvm_or_skip() {
        return;
    }
    let mut pair = Pair::start("mig-ok", SMALL_VM, &[]);
    std::thread::sleep(Duration::from_millis(500));
    let before = control(&pair.source_control(), &json!({"cmd": "stats"}))["guest"]["ops"].as_u64().unwrap();
    let (code, text, stats) = pair.migrate(&pair.incoming(), &[]);
    assert_eq!(code, 0, "{text}");
    assert_eq!(stats["status"], "completed");
    assert_eq!(stats["digest_verified"], true);
    for field in [
        "total_time_ms",
        "downtime_ms",
        "setup_time_ms",
        "iterations",
        "converged",
        "stop_reason",
        "bytes_on_wire",
        "pages_total",
        "pages_sent",
        "pages_zero",
        "memory_bytes",
        "cpu_seconds",
        "per_iteration",
        "codec",
    ] {
        assert!(stats.get(field).is_some(), "stats lack {field}: {stats}");
    }
    assert!(stats["cpu_seconds"]["destination"].as_f64().unwrap() > 0.0);
    // The pause, on the clock host traces use: within the migration, which
    // ended before now.
    let paused = stats["paused_at_monotonic_s"].as_f64().unwrap();
    let now = tsubame_vmm::cpu_time::monotonic_seconds();
    let total = stats["total_time_ms"].as_f64().unwrap() / 1e3;
    assert!(paused > 0.0 && paused < now && paused > now - total - 60.0, "paused at {paused}, now {now}: {stats}");
    assert!(text.contains("migration completed"), "{text}");
    // The limit in force, in the statistics and the summary.
    assert_eq!(stats["downtime_limit_ms"].as_f64(), Some(300.0), "{stats}");
    assert!(text.contains("limit 300 ms") || text.contains("over the 300 ms limit"), "{text}");

    // The source process ends; the guest runs on at the destination.
    let status = pair.source.0.wait().unwrap();
    assert!(status.success());
    let first = control(&pair.dest_control(), &json!({"cmd": "stats"}));
    std::thread::sleep(Duration::from_millis(500));
    let later = control(&pair.dest_control(), &json!({"cmd": "stats"}));
    assert_eq!(later["status"], "running");
    let (a, b) = (first["guest"]["ops"].as_u64().unwrap(), later["guest"]["ops"].as_u64().unwrap());
    assert!(a >= before && b > a, "ops before {before}, at destination {a} then {b}");
    assert_eq!(later["guest"]["error"], Value::Null);
    control(&pair.dest_control(), &json!({"cmd": "quit"}));
    assert!(pair.dest.0.wait().unwrap().success());
}

#[test]
fn demo_completes_for_every_workload() {
    if !kvm_or_skip() {
        return;
    }
    let dir = scratch("demo-all");
    for workload in ["idle", "fill-zero", "fill-random", "kv", "bwmem", "sparse", "zero-clear", "stream"] {
        let json_path = dir.join(format!("{workload}.json"));
        let wss = if workload.starts_with("fill") { "wss=48M" } else { "wss=32M" };
        let out = tsubame()
            .args(["demo", "--memory", "96M", "--workload", workload, "--workload-arg", wss])
            .args(["--warmup", "0.7", "--after", "0.7", "--json"])
            .arg(&json_path)
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{workload}: {text}");
        let stats: Value = serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
        assert_eq!(stats["status"], "completed", "{workload}");
        assert_eq!(stats["digest_verified"], true, "{workload}");
        assert_eq!(stats["demo"]["guest_continued"], true, "{workload}: {text}");
    }
}

/// What the proxy does to the stream.
#[derive(Clone, Copy)]
enum Fault {
    /// Kill the destination when the Nth PAGES frame goes to it.
    KillAtPages(usize),
    /// Kill the destination when STATE goes to it (stop-and-copy).
    KillAtState,
    /// Kill the destination when its READY comes back; never deliver it.
    KillAtReady,
    /// Flip a byte in the payload of the Nth PAGES frame.
    CorruptPages(usize),
    /// Close both sides after the Nth PAGES frame.
    TruncateAfterPages(usize),
    /// Both preambles claim version 99.
    WrongVersion,
}

/// A man in the middle that understands frames, on a Unix socket.
fn start_proxy(listen: &Path, target: PathBuf, fault: Fault, dest_pid: u32) -> std::thread::JoinHandle<()> {
    let listener = UnixListener::bind(listen).unwrap();
    std::thread::spawn(move || {
        let (client, _) = listener.accept().unwrap();
        let server = UnixStream::connect(&target).unwrap();
        // Later connections (the channel post-copy keeps for asked-for
        // pages) go through as they are: the fault is channel 0's.
        let later = target.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(server) = UnixStream::connect(&later) else { return };
                for (mut from, mut to) in [(client.try_clone().unwrap(), server.try_clone().unwrap()), (server, client)]
                {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Write);
                    });
                }
            }
        });
        let kill = move || {
            let _ = std::process::Command::new("kill").args(["-9", &dest_pid.to_string()]).status();
        };
        // Like a TCP connection, each direction ends on its own: what one
        // side wrote before it hung up (an ERROR frame) still arrives.
        let relay = move |mut from: UnixStream, mut to: UnixStream, to_dest: bool| {
            let mut preamble = [0u8; PREAMBLE_LEN];
            if from.read_exact(&mut preamble).is_err() {
                return;
            }
            if let Fault::WrongVersion = fault {
                preamble[8..12].copy_from_slice(&99u32.to_le_bytes());
            }
            if to.write_all(&preamble).is_err() {
                return;
            }
            let mut pages = 0;
            while let Some((header, kind, mut payload)) = read_raw_frame(&mut from) {
                if kind == FrameKind::Pages && to_dest {
                    pages += 1;
                }
                let stop = match (fault, kind, to_dest) {
                    (Fault::KillAtPages(n), FrameKind::Pages, true) if pages == n => {
                        kill();
                        true
                    }
                    (Fault::KillAtState, FrameKind::State, true) => {
                        kill();
                        true
                    }
                    (Fault::KillAtReady, FrameKind::Ready, false) => {
                        kill();
                        true
                    }
                    (Fault::CorruptPages(n), FrameKind::Pages, true) if pages == n => {
                        let last = payload.len() - 1;
                        payload[last] ^= 0xFF;
                        false
                    }
                    (Fault::TruncateAfterPages(n), FrameKind::Pages, true) if pages == n => {
                        let _ = to.write_all(&header);
                        let _ = to.write_all(&payload[..payload.len() / 2]);
                        true
                    }
                    _ => false,
                };
                if stop || to.write_all(&header).is_err() || to.write_all(&payload).is_err() {
                    break;
                }
            }
            let _ = from.shutdown(std::net::Shutdown::Read);
            let _ = to.shutdown(std::net::Shutdown::Write);
        };
        let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
        let back = std::thread::spawn(move || relay(s2, c2, false));
        relay(client, server, true);
        let _ = back.join();
    })
}

fn fail_through_proxy(name: &str, fault: Fault, expect_in_error: &str) {
    let mut pair = Pair::start(name, SMALL_VM, &[]);
    std::thread::sleep(Duration::from_millis(300));
    let proxy_path = pair.dir.join("proxy.sock");
    let proxy = start_proxy(&proxy_path, pair.dir.join("incoming.sock"), fault, pair.dest.0.id());
    // Pre-copy's guarantee, the source keeps the VM: with the default
    // (auto) a busy host once made the proxied link look slower than the
    // guest's writes and handed over to post-copy, where a lost
    // destination loses the VM (tests/postcopy.rs).
    let (code, text, stats) = pair.migrate(&format!("unix:{}", proxy_path.display()), &["--postcopy", "off"]);
    let _ = proxy.join();
    assert_eq!(code, 1, "{name}: migrate should fail: {text}");
    assert_eq!(stats["status"], "failed", "{name}");
    let error = stats["error"].as_str().unwrap_or_default().to_string();
    assert!(error.contains(expect_in_error), "{name}: error '{error}' lacks '{expect_in_error}'");
    assert!(error.contains("keeps running here"), "{name}: {error}");
    pair.assert_source_runs();
    pair.assert_no_copy_at_destination();
}

#[test]
fn destination_killed_during_iteration_0() {
    if kvm_or_skip() {
        fail_through_proxy("kill-it0", Fault::KillAtPages(10), "connection");
    }
}

#[test]
fn destination_killed_during_stop_and_copy() {
    if kvm_or_skip() {
        fail_through_proxy("kill-sac", Fault::KillAtState, "connection");
    }
}

#[test]
fn destination_killed_after_ready_before_commit() {
    if kvm_or_skip() {
        fail_through_proxy("kill-ready", Fault::KillAtReady, "connection");
    }
}

#[test]
fn corrupted_frame_is_refused() {
    if kvm_or_skip() {
        fail_through_proxy("corrupt", Fault::CorruptPages(5), "CRC32C");
    }
}

#[test]
fn truncated_stream_fails_cleanly() {
    if kvm_or_skip() {
        fail_through_proxy("truncate", Fault::TruncateAfterPages(5), "connection");
    }
}

#[test]
fn version_mismatch_is_refused() {
    if kvm_or_skip() {
        fail_through_proxy("version", Fault::WrongVersion, "version 99");
    }
}

#[test]
fn memory_size_mismatch_is_refused() {
    if !kvm_or_skip() {
        return;
    }
    let mut pair = Pair::start("memsize", SMALL_VM, &["--memory", "256M"]);
    std::thread::sleep(Duration::from_millis(300));
    let (code, text, stats) = pair.migrate(&pair.incoming(), &[]);
    assert_eq!(code, 1, "{text}");
    let error = stats["error"].as_str().unwrap();
    assert!(error.contains("memory size mismatch"), "{error}");
    pair.assert_source_runs();
    pair.assert_no_copy_at_destination();
}

#[test]
fn a_failed_demo_leaves_no_scratch_directory() {
    let child =
        tsubame().args(["demo", "--transport", "smoke-signals"]).stderr(std::process::Stdio::null()).spawn().unwrap();
    let dir = std::env::temp_dir().join(format!("tsubame-demo-{}", child.id()));
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(!dir.exists(), "{} left behind", dir.display());
}

#[test]
fn migrate_bad_input_is_exit_2() {
    let dir = scratch("mig-usage");
    for args in [
        vec!["migrate", "--control", "/nonexistent.sock", "--to", "carrier-pigeon"],
        vec!["migrate", "--control", "/nonexistent.sock", "--to", "unix:/x", "--max-bandwidth", "fast"],
        vec!["receive", "--listen", "nowhere"],
        vec!["demo", "--transport", "smoke-signals"],
    ] {
        let out = tsubame().args(&args).current_dir(&dir).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
    }
    // A control socket nobody serves: a failed operation, exit 1.
    let out = tsubame().args(["migrate", "--control", "/nonexistent.sock", "--to", "unix:/x"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("is `tsubame run --control` running?"));
}

#[test]
fn gpu_without_a_driver_is_one_clear_line() {
    if !kvm_or_skip() {
        return;
    }
    if tsubame_gpu_driver_present() {
        tsubame_testkit::skip("a CUDA driver is present, so --gpu would not fail here");
        return;
    }
    let dir = scratch("gpu-none");
    let out =
        tsubame().args(["demo", "--memory", "128M", "--workload", "idle", "--gpu"]).current_dir(&dir).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let last = stderr.trim().lines().last().unwrap_or_default();
    assert!(last.contains("no CUDA driver found") && last.contains("keeps running here"), "{stderr}");
}

fn tsubame_gpu_driver_present() -> bool {
    ["libcuda.so.1", "libcuda.so"].iter().any(|name| {
        std::process::Command::new("sh")
            .args(["-c", &format!("ldconfig -p | grep -q {name}")])
            .status()
            .is_ok_and(|s| s.success())
    })
}
