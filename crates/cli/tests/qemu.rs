//! The embedded guest boots under QEMU too (`tsubame guest-elf`), so both
//! VMMs can be compared on identical work.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{kvm_or_skip, ops_in, scratch, tsubame};

fn qemu_present() -> bool {
    tsubame_testkit::program("qemu-system-x86_64")
}

fn boot_under_qemu(workload: &str) -> String {
    boot_under_qemu_with(workload, &[], "wss=64M")
}

/// Boots `workload` under QEMU with `devices` and the extra guest
/// `args`; returns the console once it printed a dozen progress lines.
fn boot_under_qemu_with(workload: &str, devices: &[String], args: &str) -> String {
    let dir = scratch(&format!("qemu-{workload}"));
    let elf = dir.join("guest.elf");
    let log = dir.join("console.log");
    assert!(tsubame().arg("guest-elf").arg(&elf).status().unwrap().success());
    let mut qemu = Command::new("qemu-system-x86_64")
        .args(["-enable-kvm", "-cpu", "host,-arch-capabilities", "-m", "1G", "-nodefaults", "-nographic", "-kernel"])
        .arg(&elf)
        .args(["-append", &format!("workload={workload} {args}")])
        .args(devices)
        .args(["-chardev", &format!("file,id=d,path={}", log.display())])
        .args(["-device", "isa-debugcon,iobase=0xe9,chardev=d"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start qemu");
    // Booting is ring-0 work, which PVM emulates slowly: wait for the
    // first progress lines rather than a fixed time (a minute or two on a
    // host loaded to 10 runnable threads per CPU: 30 s once saw nothing).
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
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

/// The value of `key=` in the last complete progress line of `text` (QEMU
/// is killed mid-line at times: a cut line's figures are cut too).
fn last_field(text: &str, key: &str) -> u64 {
    let complete = &text[..text.rfind('\n').unwrap_or(0)];
    let line = complete.lines().rev().find(|l| l.starts_with("tsb ")).unwrap_or("");
    let prefix = format!("{key}=");
    line.split_whitespace().find_map(|t| t.strip_prefix(prefix.as_str())?.parse().ok()).unwrap_or(0)
}

#[test]
fn the_same_guest_drives_qemus_virtio_blk() {
    if !kvm_or_skip() || !qemu_present() {
        return;
    }
    for workload in ["disk-seq", "disk-random", "disk-mixed"] {
        let dir = scratch(&format!("qemu-disk-{workload}"));
        let image = dir.join("disk.img");
        std::fs::File::create(&image).unwrap().set_len(32 << 20).unwrap();
        let devices = [
            "-drive".to_string(),
            format!("file={},format=raw,if=none,id=d0,cache=none", image.display()),
            "-device".to_string(),
            "virtio-blk-pci,drive=d0,disable-modern=on".to_string(),
        ];
        let text = boot_under_qemu_with(workload, &devices, "disk=16M");
        assert!(!text.contains("error") && !text.contains("exception"), "{workload}: {text}");
        assert!(text.contains("disk id=") && text.contains("capacity=33554432"), "{workload}: {text}");
        assert!(ops_in(&text).len() >= 10, "{workload}: {text}");
        assert!(last_field(&text, "rd") > 0, "{workload} read nothing: {text}");
        if workload == "disk-mixed" {
            // QEMU is gone: what the guest saw acknowledged is on the image
            // (flushes went through), each write once, intact.
            let acked = last_field(&text, "ack");
            assert!(acked > 64 && last_field(&text, "wr") > 0, "{text}");
            let report = tsubame_block::records::check(&mut std::fs::File::open(&image).unwrap(), None, Some(acked));
            let report = report.unwrap();
            assert!(report.ok() && report.run.is_some(), "acknowledged up to {acked}: {report:?}");
        }
    }
}
