//! Helpers the migration crate's KVM tests share.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use tsubame_vmm::{guest_elf, ConsoleLine};

/// True when KVM tests can run (`tsubame_testkit::kvm`: skipped without
/// /dev/kvm, a failure when CI requires it).
pub fn kvm_or_skip() -> bool {
    tsubame_testkit::kvm()
}

/// The longest a test waits for a guest's progress lines: a guest starved
/// of CPU by a loaded host prints them late, not never.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// The guest's ops counters printed within `span`, and after it until
/// there are at least `lines` of them (or [`PATIENCE`] ran out): how many
/// lines a fixed span holds depends on how much CPU the guest got.
pub fn ops_at_least(console: &Receiver<ConsoleLine>, lines: usize, span: Duration) -> Vec<u64> {
    let mut ops = ops_until(console, span);
    let end = Instant::now() + PATIENCE;
    while ops.len() < lines && Instant::now() < end {
        ops.extend(ops_until(console, Duration::from_millis(100)));
    }
    ops
}

/// The guest's ops counters printed within `span`; fails on a guest error.
pub fn ops_until(console: &Receiver<ConsoleLine>, span: Duration) -> Vec<u64> {
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
