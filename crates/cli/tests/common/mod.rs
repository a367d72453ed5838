//! Helpers shared by the CLI's integration tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

/// The built `tsubame` binary.
pub fn tsubame() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tsubame"))
}

/// True when KVM tests can run; with TSUBAME_REQUIRE_KVM set, a missing
/// /dev/kvm fails the test instead of skipping it.
pub fn kvm_or_skip() -> bool {
    if std::path::Path::new("/dev/kvm").exists() {
        return true;
    }
    assert!(std::env::var("TSUBAME_REQUIRE_KVM").is_err(), "/dev/kvm is missing but TSUBAME_REQUIRE_KVM is set");
    eprintln!("skipped: no /dev/kvm");
    false
}

/// A fresh scratch directory under the system temp dir.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tsubame-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Parses the ops counters out of guest output.
pub fn ops_in(text: &str) -> Vec<u64> {
    text.lines().filter_map(|l| l.strip_prefix("tsb ops=")?.split(' ').next()?.parse().ok()).collect()
}
