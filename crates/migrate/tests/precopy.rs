//! Pre-copy between two VMs in one process, over a real socket.

use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use tsubame_migrate::destination::{receive, ReceiveOptions};
use tsubame_migrate::subpage::Detector;
use tsubame_migrate::transport::{Address, Listener};
use tsubame_migrate::{source, MigrateOptions, ProgressCell};
use tsubame_vmm::{guest_elf, ConsoleLine, Vm, VmConfig};

fn kvm_or_skip() -> bool {
    tsubame_vmm::kvm::kvm_tests_enabled()
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

fn migrate_workload(args: &str, options: MigrateOptions) -> tsubame_migrate::MigrationStats {
    migrate_sized(128 << 20, args, options, Duration::from_millis(700))
}

fn migrate_sized(
    memory_bytes: u64,
    args: &str,
    options: MigrateOptions,
    watch: Duration,
) -> tsubame_migrate::MigrationStats {
    let mut vm = Vm::create(&VmConfig { memory_bytes, hugepages: true }).unwrap();
    let cmdline = format!("{args} tsc_khz={}", vm.tsc_khz());
    vm.load_guest(guest_elf::GUEST_ELF, &cmdline).unwrap();
    let console = vm.take_console().unwrap();
    vm.start(false).unwrap();
    let before = ops_until(&console, watch);

    // Tests run in parallel threads of one process: a counter keeps paths apart.
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!("tsubame-precopy-{}-{n}", std::process::id()));
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
    let after = ops_until(&dest_console, watch);
    assert!(after.len() >= 3, "{args}: destination printed {} progress lines", after.len());
    assert!(after[0] >= source_last.unwrap(), "{args}: ops restarted: {after:?} after {source_last:?}");
    assert!(after.last() > after.first());
    stats
}

#[test]
fn kv_migrates_and_continues() {
    if !kvm_or_skip() {
        return;
    }
    migrate_workload("workload=kv wss=32M", MigrateOptions::default());
}

const WORKLOADS: [&str; 8] = ["idle", "fill-zero", "fill-random", "kv", "bwmem", "sparse", "zero-clear", "stream"];

#[test]
fn every_workload_at_every_granularity_and_detector() {
    if !kvm_or_skip() {
        return;
    }
    for workload in WORKLOADS {
        for (granularity, detector) in [
            (4096, Detector::Shadow),
            (1024, Detector::Shadow),
            (1024, Detector::Hash),
            (128, Detector::Shadow),
            (128, Detector::Hash),
        ] {
            let options = MigrateOptions { granularity, subpage_detector: detector, ..Default::default() };
            let args = format!("workload={workload} wss=16M");
            let stats = migrate_sized(64 << 20, &args, options, Duration::from_millis(350));
            assert_eq!(stats.subpage.is_some(), granularity < 4096, "{args}");
            assert_eq!(stats.regions_repaired, 0, "{args} at {granularity}/{detector:?} needed repair");
        }
    }
}

#[test]
fn forged_hash_collisions_are_repaired_by_verification() {
    if !kvm_or_skip() {
        return;
    }
    // Every sub-page hash is 0: after iteration 0 the detector sees no
    // change at all, so only the digest comparison can catch what moved.
    let options = MigrateOptions {
        granularity: 128,
        subpage_detector: Detector::Hash,
        subpage_hash_mask: 0,
        ..Default::default()
    };
    let stats = migrate_workload("workload=sparse wss=16M", options);
    assert!(stats.digest_verified);
    assert!(stats.regions_repaired > 0, "no region needed repair: {:?}", stats.subpage);
    assert_eq!(stats.subpage.unwrap().regions_repaired, stats.regions_repaired);
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

#[test]
fn every_codec_list_migrates_and_verifies() {
    if !kvm_or_skip() {
        return;
    }
    for codecs in [
        "none",
        "zero",
        "zero,rle",
        "zero,xbzrle=16M",
        "zero,dedup=8M",
        "zero,lz4",
        "zero,zstd",
        "zero,xbzrle=16M,dedup=8M,zstd",
    ] {
        for workload in ["kv", "stream", "fill-random"] {
            let options = MigrateOptions {
                codecs: codecs.parse().unwrap(),
                // A slow link keeps every codec switched on (they pay there).
                max_bandwidth: Some(200_000_000),
                ..Default::default()
            };
            let args = format!("workload={workload} wss=16M");
            let stats = migrate_sized(64 << 20, &args, options, Duration::from_millis(350));
            assert!(stats.digest_verified, "{codecs} {workload}");
        }
    }
}
