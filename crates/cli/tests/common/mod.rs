//! Helpers shared by the CLI's integration tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

/// The built `tsubame` binary.
pub fn tsubame() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tsubame"))
}

/// True when KVM tests can run (see `kvm_tests_enabled`).
pub fn kvm_or_skip() -> bool {
    tsubame_vmm::kvm::kvm_tests_enabled()
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

/// Waits (10 s at most) until something listens on the Unix socket `path`.
pub fn wait_for_socket(path: &std::path::Path) -> std::os::unix::net::UnixStream {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        if let Ok(stream) = std::os::unix::net::UnixStream::connect(path) {
            return stream;
        }
        assert!(std::time::Instant::now() < deadline, "{} never appeared", path.display());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}
