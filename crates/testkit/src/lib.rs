//! What tsubame's tests share: a test that cannot run here says so.
//!
//! libtest has no runtime skip: a test that returns early counts as
//! passed. So a skipping test calls [`skip`], which prints
//! `skipped: <why> (<test> in <binary>)` past libtest's output capture (so plain
//! `cargo test` shows it) and appends the same line to the file named by
//! `TSUBAME_SKIP_LOG`, where `cargo xtask test` counts it in its closing
//! line `N passed, N failed, N skipped`.
//!
//! A skip that must not happen fails instead: `TSUBAME_REQUIRE_KVM`
//! (set where /dev/kvm exists), `TSUBAME_REQUIRE_TOOLS` (set once
//! scripts/setup.sh installed the external programs) and
//! `TSUBAME_REQUIRE_GPU` (set where a GPU is lent).

use std::io::Write;
use std::process::{Command, Stdio};

/// Records that the running test is skipped, and why.
pub fn skip(why: impl std::fmt::Display) {
    let test = std::thread::current().name().unwrap_or("?").to_string();
    let line = skip_line(&why.to_string(), &test, &test_binary());
    // One write, past the capture of print!/eprint!, so it shows whole.
    let _ = std::io::stderr().write_all(line.as_bytes());
    if let Some(path) = std::env::var_os("TSUBAME_SKIP_LOG") {
        append(std::path::Path::new(&path), &line);
    }
}

fn skip_line(why: &str, test: &str, binary: &str) -> String {
    format!("skipped: {why} ({test} in {binary})\n")
}

/// Appends `line`: O_APPEND writes of one short line do not interleave
/// across the test threads and binaries that share the file.
fn append(path: &std::path::Path, line: &str) {
    if let Ok(mut file) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
        let _ = file.write_all(line.as_bytes());
    }
}

/// The test binary's name without cargo's hash: `far_memory`, `tsubame_vmm`.
fn test_binary() -> String {
    let exe = std::env::current_exe().ok();
    let stem = exe.as_deref().and_then(|p| p.file_stem()).map(|s| s.to_string_lossy().into_owned());
    let stem = stem.unwrap_or_else(|| "?".into());
    match stem.rsplit_once('-') {
        Some((name, hash)) if hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit()) => name.to_string(),
        _ => stem,
    }
}

/// Skips, or fails when the environment variable `require` is set.
pub fn skip_unless_required(require: &str, why: impl std::fmt::Display) {
    assert!(std::env::var_os(require).is_none(), "{why}, and {require} is set: this test must run here");
    skip(why);
}

/// True when KVM tests can run: /dev/kvm exists. Otherwise the test is
/// skipped (failed under `TSUBAME_REQUIRE_KVM`).
pub fn kvm() -> bool {
    if std::path::Path::new("/dev/kvm").exists() {
        return true;
    }
    skip_unless_required("TSUBAME_REQUIRE_KVM", "no /dev/kvm");
    false
}

/// True when `program --version` runs. Otherwise the test is skipped
/// (failed under `TSUBAME_REQUIRE_TOOLS`), naming the script that
/// installs it.
pub fn program(program: &str) -> bool {
    let found = Command::new(program)
        .arg("--version")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    if !found {
        skip_unless_required("TSUBAME_REQUIRE_TOOLS", format!("no {program} (scripts/setup.sh installs it)"));
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skip_is_logged_with_the_test_and_the_reason() {
        let path = std::env::temp_dir().join(format!("tsubame-skip-log-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        append(&path, &skip_line("no /dev/kvm", "boots_the_guest", "kvm"));
        append(&path, &skip_line("no nbdkit", "serves_pages", "far_memory"));
        let log = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        assert_eq!(
            log,
            "skipped: no /dev/kvm (boots_the_guest in kvm)\nskipped: no nbdkit (serves_pages in far_memory)\n"
        );
    }

    #[test]
    fn the_binary_is_named_without_cargos_hash() {
        assert_eq!(test_binary(), "tsubame_testkit");
    }

    #[test]
    fn a_present_program_is_found() {
        assert!(program("sh") || !std::path::Path::new("/bin/sh").exists());
    }
}
