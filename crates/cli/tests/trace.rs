//! `tsubame trace`, `simulate` and `plan` end to end.

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::{kvm_or_skip, scratch, tsubame, wait_for_socket};

#[test]
fn trace_simulate_plan() {
    if !kvm_or_skip() {
        return;
    }
    let dir = scratch("trace");
    let socket = dir.join("vm.sock");
    let trace = dir.join("kv.trace");
    let mut vm = tsubame()
        .args(["run", "--quiet", "--memory", "128M", "--workload", "kv", "--workload-arg", "wss=32M", "--control"])
        .arg(&socket)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_socket(&socket);
    std::thread::sleep(Duration::from_millis(500));
    let out = tsubame()
        .arg("trace")
        .arg("--control")
        .arg(&socket)
        .arg("--out")
        .arg(&trace)
        .args(["--seconds", "2"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("intervals"));
    // plan can record its own trace of the running VM.
    let out = tsubame()
        .arg("plan")
        .arg("--control")
        .arg(&socket)
        .args(["--seconds", "2", "--bandwidths", "1Gbit"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("R^2 = ") && text.contains("page "), "{text}");
    let _ = vm.kill();
    let _ = vm.wait();

    let png = dir.join("iterations.png");
    let out = tsubame()
        .arg("simulate")
        .arg("--trace")
        .arg(&trace)
        .args(["--bandwidth", "100Mbit", "--plot"])
        .arg(&png)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    for method in ["page ", "page+xbzrle ", "subpage "] {
        assert!(text.lines().any(|l| l.starts_with(method) && l.contains("total")), "{method}: {text}");
    }
    // Traces carry the guest's ops: replay follows its work.
    assert!(text.contains("replayed by guest work"), "{text}");
    // Each method also gives its range with the guest ±10 % (the default).
    assert_eq!(text.matches("guest ±10 %: ").count(), 3, "{text}");
    let image = std::fs::read(&png).unwrap();
    assert!(image.starts_with(b"\x89PNG") && image.len() > 10_000, "{} bytes", image.len());

    let out = tsubame().arg("plan").arg("--trace").arg(&trace).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("R^2 = "), "{text}");
    // A recommendation keeps a 10 % margin on the guest's speed.
    assert!(text.contains("with the guest 10 % faster too") || text.contains("with a 10 % margin"), "{text}");

    // A damaged trace is one clear line and exit 2.
    let mut bytes = std::fs::read(&trace).unwrap();
    bytes.truncate(bytes.len() - 3);
    let cut = dir.join("cut.trace");
    std::fs::write(&cut, &bytes).unwrap();
    let out = tsubame().arg("simulate").arg("--trace").arg(&cut).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("truncated"), "{stderr}");
    let out = tsubame().args(["plan", "--trace", "/nonexistent.trace"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
}
