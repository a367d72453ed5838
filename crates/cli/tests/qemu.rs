//! The embedded guest boots under QEMU too (`tsubame guest-elf`), so both
//! VMMs can be compared on identical work.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{kvm_or_skip, ops_in, scratch, tsubame};

fn qemu_present() -> bool {
    let found = Command::new("qemu-system-x86_64").arg("--version").stdout(Stdio::null()).status().is_ok();
    if !found {
        assert!(
            std::env::var("TSUBAME_REQUIRE_KVM").is_err(),
            "qemu-system-x86_64 is missing (apt-get install qemu-system-x86)"
        );
        eprintln!("skipped: no qemu-system-x86_64");
    }
    found
}

fn boot_under_qemu(workload: &str) -> String {
    let dir = scratch(&format!("qemu-{workload}"));
    let elf = dir.join("guest.elf");
    let log = dir.join("console.log");
    assert!(tsubame().arg("guest-elf").arg(&elf).status().unwrap().success());
    let mut qemu = Command::new("qemu-system-x86_64")
        .args(["-enable-kvm", "-cpu", "host,-arch-capabilities", "-m", "1G", "-nodefaults", "-nographic", "-kernel"])
        .arg(&elf)
        .args(["-append", &format!("workload={workload} wss=64M")])
        .args(["-chardev", &format!("file,id=d,path={}", log.display())])
        .args(["-device", "isa-debugcon,iobase=0xe9,chardev=d"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start qemu");
    // Booting is ring-0 work, which PVM emulates slowly: wait for the
    // first progress lines rather than a fixed time.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::time::Instant::now() < deadline && ops_in(&std::fs::read_to_string(&log).unwrap_or_default()).len() < 12
    {
        std::thread::sleep(Duration::from_millis(200));
    }
    let _ = qemu.kill();
    let out = qemu.wait_with_output().unwrap();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(!text.is_empty(), "QEMU printed nothing; its stderr: {}", String::from_utf8_lossy(&out.stderr));
    text
}

#[test]
fn guest_prints_progress_under_qemu() {
    if !kvm_or_skip() || !qemu_present() {
        return;
    }
    for workload in ["kv", "sparse"] {
        let text = boot_under_qemu(workload);
        assert!(!text.contains("error") && !text.contains("exception"), "{workload}: {text}");
        let ops = ops_in(&text);
        assert!(ops.len() >= 10, "{workload}: {} progress lines under QEMU:\n{text}", ops.len());
        assert!(ops.last() > ops.first());
    }
}
