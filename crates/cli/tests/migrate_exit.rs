//! `tsubame migrate`'s exit code says where the VM runs: 0 exactly when
//! it runs at the destination, with the statistics; 3 when the VM's
//! process went away before saying (issue 54: a source that ended right
//! after a completed post-copy used to take its reply with it, and the
//! migration that succeeded was reported as failed).

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{migrate_via, scratch, spawn_receive, spawn_run, try_control, tsubame, wait_for_socket, Proc};
use serde_json::json;

const VM: [&str; 6] = ["--memory", "64M", "--workload", "kv", "--workload-arg", "wss=24M"];

/// Waits (`seconds` at most) for `proc` to exit; its exit code.
fn exit_code(proc: &mut Proc, seconds: u64) -> Option<i32> {
    let deadline = Instant::now() + Duration::from_secs(seconds);
    loop {
        if let Some(status) = proc.0.try_wait().unwrap() {
            return status.code();
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_completed_post_copy_migration_exits_0_with_its_statistics_20_times() {
    if !common::kvm_or_skip() {
        return;
    }
    let dir = scratch("migrate-exit");
    for round in 0..20 {
        let (source_sock, dest_sock) = (dir.join("source.sock"), dir.join("dest.sock"));
        let incoming = dir.join("incoming.sock");
        let mut source = spawn_run(&source_sock, &VM, Stdio::null());
        // The destination's lines, for a round that fails.
        let dest_log = dir.join("dest.log");
        let dest = spawn_receive(&incoming, Some(&dest_sock), std::fs::File::create(&dest_log).unwrap().into());
        wait_for_socket(&source_sock);
        wait_for_socket(&dest_sock);
        let json_path = dir.join("stats.json");
        let to = format!("unix:{}", incoming.display());
        let (code, text, stats) = migrate_via(&source_sock, &to, &json_path, &["--postcopy", "after=0"]);
        let dest_lines = || std::fs::read_to_string(&dest_log).unwrap_or_default();
        assert_eq!(code, Some(0), "round {round}: {text}\ndestination:\n{}", dest_lines());
        assert_eq!(stats["status"], "completed", "round {round}: {stats}");
        assert!(stats["postcopy"].is_object(), "round {round}: not post-copy: {stats}");
        assert!(text.contains("migration completed"), "round {round}: {text}");
        // The source ends once its reply is out; the VM runs on there.
        assert_eq!(exit_code(&mut source, 10), Some(0), "round {round}: the source did not end well");
        let running = try_control(&dest_sock, &json!({"cmd": "query-status"}));
        assert_eq!(running, Some(json!({"ok": true, "running": true, "status": "running"})), "round {round}");
        let _ = try_control(&dest_sock, &json!({"cmd": "quit"}));
        drop(dest);
    }
}

#[test]
fn a_source_that_dies_mid_migration_is_an_unknown_outcome_exit_3() {
    if !common::kvm_or_skip() {
        return;
    }
    let dir = scratch("migrate-unknown");
    let (source_sock, dest_sock) = (dir.join("source.sock"), dir.join("dest.sock"));
    let (incoming, dest_log) = (dir.join("incoming.sock"), dir.join("dest.log"));
    let mut source = spawn_run(&source_sock, &VM, Stdio::null());
    let _dest = spawn_receive(&incoming, Some(&dest_sock), std::fs::File::create(&dest_log).unwrap().into());
    wait_for_socket(&source_sock);
    wait_for_socket(&dest_sock);
    let mut migrate = Proc(
        tsubame()
            .args(["migrate", "--control"])
            .arg(&source_sock)
            .args(["--to", &format!("unix:{}", incoming.display()), "--postcopy", "after=0"])
            .args(["--max-bandwidth", "4MB", "--postcopy-timeout", "2"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(&dest_log).unwrap_or_default().contains("post-copy: the VM runs here") {
        assert!(Instant::now() < deadline, "post-copy never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    source.0.kill().unwrap();
    let code = exit_code(&mut migrate, 20);
    let mut stderr = String::new();
    std::io::Read::read_to_string(migrate.0.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert_eq!(code, Some(3), "{stderr}");
    assert!(stderr.contains("outcome unknown"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
}
