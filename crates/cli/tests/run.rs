//! `tsubame run` end to end: progress, control socket, and usage errors.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::process::Stdio;
use std::time::Duration;

use common::{kvm_or_skip, ops_in, scratch, tsubame, wait_for_socket};

#[test]
fn run_prints_progress_and_throughput() {
    if !kvm_or_skip() {
        return;
    }
    let out = tsubame()
        .args(["run", "--memory", "256M", "--workload", "kv", "--workload-arg", "wss=64M", "--seconds", "2"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(ops_in(&stdout).len() >= 20);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("ops/s"), "{stderr}");
}

#[test]
fn bad_input_is_one_line_and_exit_2() {
    for args in [
        vec!["run", "--workload", "nope"],
        vec!["run", "--memory", "lots"],
        vec!["run", "--memory", "4M"],
        vec!["run", "--workload-arg", "colour=blue"],
        vec!["run", "--workload-arg", "wss=huge"],
        vec!["run", "--seconds", "-1"],
    ] {
        let out = tsubame().args(&args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.starts_with("tsubame: error: "), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"));
    }
}

/// One request on `stream`, its reply (byte by byte: nothing read
/// ahead is lost; the greeting line is skipped).
fn request(stream: &mut UnixStream, line: &str) -> serde_json::Value {
    stream.write_all(format!("{line}\n").as_bytes()).unwrap();
    loop {
        let mut reply = Vec::new();
        let mut byte = [0u8; 1];
        while stream.read(&mut byte).unwrap() == 1 && byte[0] != b'\n' {
            reply.push(byte[0]);
        }
        if !reply.starts_with(b"{\"QMP\"") {
            return serde_json::from_slice(&reply).unwrap();
        }
    }
}

#[test]
fn control_socket_stats_pause_resume_quit() {
    if !kvm_or_skip() {
        return;
    }
    let dir = scratch("control");
    let socket = dir.join("vm.sock");
    let mut child = tsubame()
        .args(["run", "--memory", "128M", "--workload", "sparse", "--workload-arg", "wss=16M", "--quiet", "--control"])
        .arg(&socket)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stream = wait_for_socket(&socket);
    std::thread::sleep(Duration::from_millis(500));
    let stats = request(&mut stream, r#"{"cmd":"stats"}"#);
    assert_eq!(stats["ok"], true);
    assert_eq!(stats["status"], "running");
    assert!(stats["guest"]["ops"].as_u64().unwrap() > 0);

    assert_eq!(request(&mut stream, r#"{"cmd":"pause"}"#)["ok"], true);
    std::thread::sleep(Duration::from_millis(200));
    let paused = request(&mut stream, r#"{"cmd":"stats"}"#);
    assert_eq!(paused["status"], "paused");
    let ops_paused = paused["guest"]["ops"].as_u64().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(request(&mut stream, r#"{"cmd":"stats"}"#)["guest"]["ops"].as_u64().unwrap(), ops_paused);

    assert_eq!(request(&mut stream, r#"{"cmd":"resume"}"#)["ok"], true);
    std::thread::sleep(Duration::from_millis(300));
    assert!(request(&mut stream, r#"{"cmd":"stats"}"#)["guest"]["ops"].as_u64().unwrap() > ops_paused);

    let bad = request(&mut stream, r#"{"cmd":"dance"}"#);
    assert_eq!(bad["ok"], false);
    assert!(bad["error"].as_str().unwrap().contains("unknown command"));

    assert_eq!(request(&mut stream, r#"{"cmd":"quit"}"#)["ok"], true);
    let status = child.wait().unwrap();
    assert!(status.success());
    assert!(!socket.exists(), "control socket left behind");
}
