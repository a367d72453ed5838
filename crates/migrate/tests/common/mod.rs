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
