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

/// A trace of a guest that barely ran between faults (its ops counter
/// rose once in 10 s) replays on wall time, says so in one line, and is
/// quick; no KVM needed.
#[test]
fn a_guest_that_barely_ran_is_replayed_on_wall_time() {
    use tsubame_trace::format::{PageChange, Setup, TraceWriter};
    let dir = scratch("trace-barely-ran");
    let path = dir.join("sparse.trace");
    let setup = Setup {
        memory_bytes: 64 << 20,
        granularity: 128,
        interval_us: 10_000,
        workload: "workload=sparse".into(),
        native_ops_per_sec: 30_000_000,
        huge_pages: false,
    };
    let mut writer = TraceWriter::new(std::fs::File::create(&path).unwrap(), &setup, &[u64::MAX; 256]).unwrap();
    for i in 1..=1000u64 {
        // 600 scattered pages a tick; the counter rises once, at the end.
        let mut pages: Vec<u64> = (0..600).map(|p| (p * 7919 + i * 104_729) % setup.pages()).collect();
        pages.sort_unstable();
        pages.dedup();
        let changes: Vec<PageChange> =
            pages.into_iter().map(|page| PageChange { page, mask: 1, xbzrle_bytes: 12, zero: false }).collect();
        writer.interval(i * 10_000, if i == 1000 { 600 } else { 0 }, &changes).unwrap();
    }
    writer.finish().unwrap();

    let json = dir.join("sim.json");
    let started = std::time::Instant::now();
    let out = tsubame().arg("simulate").arg("--trace").arg(&path).arg("--json").arg(&json).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(started.elapsed() < Duration::from_secs(30), "{:?}", started.elapsed());
    let notes: Vec<&str> = text.lines().filter(|l| l.starts_with("replayed ")).collect();
    assert_eq!(notes.len(), 1, "{text}");
    assert!(notes[0].starts_with("replayed on wall time: the guest barely ran between faults"), "{text}");
    let results: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(results.as_array().map(Vec::len), Some(3), "{results}");

    let out = tsubame().arg("plan").arg("--trace").arg(&path).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        text.contains("the guest barely ran between faults") && text.contains("t in seconds of wall time"),
        "{text}"
    );
}
