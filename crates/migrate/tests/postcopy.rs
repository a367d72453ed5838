//! Post-copy on KVM: the destination runs the guest before all its memory
//! is there; every workload continues there with its memory verified page
//! by page, and the source never runs it again.

use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use tsubame_migrate::destination::{receive, ReceiveOptions};
use tsubame_migrate::stats::{Status, StopReason};
use tsubame_migrate::transport::{Address, Listener};
use tsubame_migrate::{source, MigrateOptions, PostcopyMode, ProgressCell};
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
        if let Some(line) = guest_elf::parse_progress(&l.text) {
            ops.push(line.ops);
        }
    }
    ops
}

/// Migrates a VM running `args` with `options`; checks the guest goes on
/// at the destination and the post-copy phase ends verified.
fn migrate_postcopy(memory_bytes: u64, args: &str, options: MigrateOptions) -> tsubame_migrate::MigrationStats {
    let mut vm = Vm::create(&VmConfig { memory_bytes, hugepages: true }).unwrap();
    let cmdline = format!("{args} tsc_khz={}", vm.tsc_khz());
    vm.load_guest(guest_elf::GUEST_ELF, &cmdline).unwrap();
    let console = vm.take_console().unwrap();
    vm.start(false).unwrap();
    let before = ops_until(&console, Duration::from_millis(600));

    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!("tsubame-postcopy-{}-{n}", std::process::id()));
    let listener = Listener::bind(&Address::Unix(path)).unwrap();
    let addr = listener.local_address();
    let dest = std::thread::spawn(move || {
        let mut incoming =
            receive(&listener, &ReceiveOptions::default(), &|_| {}).unwrap_or_else(|e| panic!("destination: {e}"));
        let console = incoming.vm.take_console().unwrap();
        let postcopy = incoming.postcopy.take().expect("the source switched to post-copy");
        let during = ops_until(&console, Duration::from_millis(100));
        let outcome = postcopy.wait();
        let after = ops_until(&console, Duration::from_millis(700));
        (incoming, outcome, during, after)
    });
    let stats = source::migrate(&vm, &addr, &options, &ProgressCell::default());
    let (incoming, outcome, during, after) = dest.join().unwrap();
    assert_eq!(stats.status, Status::Completed, "{args}: {:?}; destination: {outcome:?}", stats.error);
    let outcome = outcome.unwrap_or_else(|e| panic!("{args}: post-copy at the destination: {e}"));
    assert!(stats.digest_verified, "{args}");
    assert_eq!(stats.stop_reason, StopReason::Postcopy);
    let postcopy = stats.postcopy.as_ref().expect("post-copy statistics");
    assert!(postcopy.pages_pushed + postcopy.pages_sent_on_request >= postcopy.pages_missing, "{args}: {postcopy:?}");
    assert!(stats.downtime_ms > 0.0 && stats.downtime_ms < stats.total_time_ms);
    // The source stays paused; the guest goes on at the destination.
    assert!(vm.status().is_stopped());
    let all: Vec<u64> = during.iter().chain(&after).copied().collect();
    assert!(all.len() >= 3, "{args}: destination printed {} progress lines", all.len());
    assert!(all[0] >= *before.last().unwrap(), "{args}: ops restarted");
    assert!(all.last() > all.first(), "{args}: the guest did not go on");
    eprintln!("{args} {:?}: {postcopy:?}, destination {outcome:?}", options.postcopy);
    drop(incoming);
    stats
}

#[test]
fn every_workload_continues_after_a_switch() {
    if !kvm_or_skip() {
        return;
    }
    for workload in ["idle", "fill-zero", "fill-random", "kv", "bwmem", "sparse", "zero-clear", "stream"] {
        let wss = if workload.starts_with("fill") { "" } else { "wss=24M" };
        // At once: the guest faults on every page it touches first.
        let options = MigrateOptions { postcopy: PostcopyMode::After(0), ..MigrateOptions::default() };
        migrate_postcopy(96 << 20, &format!("workload={workload} {wss}"), options);
    }
    // After one iteration, on a link slow enough that these writers do not
    // converge first.
    for workload in ["sparse", "zero-clear", "stream"] {
        let options = MigrateOptions {
            postcopy: PostcopyMode::After(1),
            max_bandwidth: Some(30_000_000),
            ..MigrateOptions::default()
        };
        migrate_postcopy(96 << 20, &format!("workload={workload} wss=24M"), options);
    }
}

#[test]
fn post_copy_at_once_sends_everything_after_the_switch() {
    if !kvm_or_skip() {
        return;
    }
    let options = MigrateOptions { postcopy: PostcopyMode::After(0), channels: 2, ..MigrateOptions::default() };
    let stats = migrate_postcopy(64 << 20, "workload=kv wss=16M", options);
    assert_eq!(stats.iterations, 0);
    assert_eq!(stats.postcopy.unwrap().pages_missing, 64 << 20 >> 12);
}

#[test]
fn auto_hands_over_a_guest_that_outruns_the_link() {
    if !kvm_or_skip() {
        return;
    }
    // 12 MB/s: the guest's sparse writes dirty memory faster than that.
    let options =
        MigrateOptions { postcopy: PostcopyMode::Auto, max_bandwidth: Some(12_000_000), ..MigrateOptions::default() };
    let stats = migrate_postcopy(128 << 20, "workload=sparse wss=96M rate=40", options);
    // Handed over during the first iteration, not after it.
    assert_eq!(stats.iterations, 1, "{:?}", stats.per_iteration);
    assert!(stats.per_iteration[0].pages_sent < 96 << 20 >> 12);
}
