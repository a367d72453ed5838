//! Pre-copy between two VMs in one process, over a real socket.

use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use tsubame_migrate::destination::{receive, ReceiveOptions};
use tsubame_migrate::transport::{Address, Listener};
use tsubame_migrate::{source, MigrateOptions, ProgressCell};
use tsubame_vmm::{guest_elf, ConsoleLine, Vm, VmConfig};

fn kvm_or_skip() -> bool {
    if std::path::Path::new("/dev/kvm").exists() {
        return true;
    }
    assert!(std::env::var("TSUBAME_REQUIRE_KVM").is_err(), "/dev/kvm is missing but TSUBAME_REQUIRE_KVM is set");
    eprintln!("skipped: no /dev/kvm");
    false
}

fn ops_until(console: &Receiver<ConsoleLine>, span: Duration) -> Vec<u64> {
    let end = Instant::now() + span;
    let mut ops = Vec::new();
    while let Ok(l) = console.recv_deadline(end) {
        assert!(!l.text.contains("error") && !l.text.contains("exception"), "guest: {}", l.text);
        if let Some(n) = l.text.strip_prefix("tsb ops=").and_then(|r| r.split(' ').next()?.parse().ok()) {
            ops.push(n);
        }
    }
    ops
}

fn migrate_workload(args: &str, options: MigrateOptions) {
    let memory_bytes = 128 << 20;
    let mut vm = Vm::create(&VmConfig { memory_bytes, hugepages: true }).unwrap();
    let cmdline = format!("{args} tsc_khz={}", vm.tsc_khz());
    vm.load_guest(guest_elf::GUEST_ELF, &cmdline).unwrap();
    let console = vm.take_console().unwrap();
    vm.start(false).unwrap();
    let before = ops_until(&console, Duration::from_millis(700));

    let path = std::env::temp_dir().join(format!("tsubame-precopy-{}-{}", std::process::id(), args.len()));
    let addr = Address::Unix(path);
    let listener = Listener::bind(&addr).unwrap();
    let dest = std::thread::spawn(move || receive(&listener, &ReceiveOptions::default(), &|_| {}));
    let stats = source::migrate(&vm, &addr, &options, &ProgressCell::default());
    let mut incoming = dest.join().unwrap().expect("destination received the VM");
    assert_eq!(stats.status, "completed", "{:?}", stats.error);
    assert!(stats.digest_verified);
    assert!(stats.iterations >= 2);
    assert_eq!(stats.per_iteration.len() as u32, stats.iterations);
    assert!(stats.downtime_ms > 0.0 && stats.downtime_ms < stats.total_time_ms);

    // The source stays paused; the guest continues at the destination.
    let source_last = ops_until(&console, Duration::from_millis(200)).last().copied().or(before.last().copied());
    assert!(vm.status().is_stopped());
    let dest_console = incoming.vm.take_console().unwrap();
    let after = ops_until(&dest_console, Duration::from_millis(700));
    assert!(after.len() >= 5, "{args}: destination printed {} progress lines", after.len());
    assert!(after[0] >= source_last.unwrap(), "{args}: ops restarted: {after:?} after {source_last:?}");
    assert!(after.last() > after.first());
}

#[test]
fn kv_migrates_and_continues() {
    if !kvm_or_skip() {
        return;
    }
    migrate_workload("workload=kv wss=32M", MigrateOptions::default());
}

#[test]
fn capped_bandwidth_bwmem_does_not_converge() {
    if !kvm_or_skip() {
        return;
    }
    // 8 MB/s link: 300 ms carries 2.4 MB; bwmem rewrites 8 MiB again and again.
    let options = MigrateOptions { max_bandwidth: Some(8_000_000), max_iterations: 3, ..Default::default() };
    let memory_bytes = 64 << 20;
    let mut vm = Vm::create(&VmConfig { memory_bytes, hugepages: true }).unwrap();
    let cmdline = format!("workload=bwmem wss=8M tsc_khz={}", vm.tsc_khz());
    vm.load_guest(guest_elf::GUEST_ELF, &cmdline).unwrap();
    vm.start(false).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let addr = Address::Unix(std::env::temp_dir().join(format!("tsubame-precopy-nc-{}", std::process::id())));
    let listener = Listener::bind(&addr).unwrap();
    let dest = std::thread::spawn(move || receive(&listener, &ReceiveOptions::default(), &|_| {}));
    let stats = source::migrate(&vm, &addr, &options, &ProgressCell::default());
    dest.join().unwrap().unwrap();
    assert_eq!(stats.status, "completed", "{:?}", stats.error);
    assert!(!stats.converged);
    assert_eq!(stats.stop_reason, "max-iterations");
    assert_eq!(stats.iterations, 4);
}
