//! `cargo xtask test`: README's test command. It runs scripts/setup.sh
//! (installs what is missing, or says the one command to run), then every
//! test: `cargo test --workspace --release --no-fail-fast` and the
//! benchmark harness's pytest suite, and ends with one line that counts
//! them all: `tests: N passed, N failed, N skipped`.
//!
//! A skipped test is one that called `tsubame_testkit::skip` (libtest
//! counts it as passed); each is listed with its reason. Once the set-up
//! has run, a test that would skip for a missing program fails instead
//! (TSUBAME_REQUIRE_TOOLS), and so does a KVM test where /dev/kvm exists
//! (TSUBAME_REQUIRE_KVM).

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

const USAGE: &str = "usage: cargo xtask test [-- ARGS FOR cargo test]
       cargo xtask setup [--check]

test   install what is missing (scripts/setup.sh), run every test of the
       workspace (release) and of bench/, print one closing line
setup  only the set-up; --check lists what is missing and installs nothing";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let root = workspace_root();
    match args.first().map(String::as_str) {
        Some("test") => {
            let extra = match args.get(1).map(String::as_str) {
                None => &[][..],
                Some("--") => &args[2..],
                Some(other) => return usage_error(&format!("unknown argument '{other}'")),
            };
            test(&root, extra)
        }
        Some("setup") => match setup(&root, &args[1..]) {
            Ok(()) => ExitCode::SUCCESS,
            Err(code) => code,
        },
        Some("-h" | "--help") => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        Some(other) => usage_error(&format!("unknown command '{other}'")),
        None => usage_error("no command"),
    }
}

fn usage_error(what: &str) -> ExitCode {
    eprintln!("xtask: {what}\n{USAGE}");
    ExitCode::from(2)
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").to_path_buf()
}

/// Runs scripts/setup.sh; its own output says what it did or what to do.
fn setup(root: &Path, args: &[String]) -> Result<(), ExitCode> {
    let status = Command::new("bash").arg(root.join("scripts/setup.sh")).args(args).current_dir(root).status();
    match status {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => Err(ExitCode::from(s.code().unwrap_or(1).clamp(1, 255) as u8)),
        Err(e) => {
            eprintln!("xtask: cannot run bash scripts/setup.sh: {e}");
            Err(ExitCode::FAILURE)
        }
    }
}

/// Counts of one runner, or of all.
#[derive(Default, Debug, PartialEq)]
struct Counts {
    passed: u64,
    failed: u64,
    skipped: u64,
}

fn test(root: &Path, extra: &[String]) -> ExitCode {
    if let Err(code) = setup(root, &[]) {
        eprintln!("xtask: the set-up did not finish: no test was run");
        return code;
    }
    let skip_log = root.join("target").join("tsubame-skipped.log");
    let _ = std::fs::create_dir_all(skip_log.parent().expect("a parent"));
    let _ = std::fs::remove_file(&skip_log);

    let mut cargo = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cargo.args(["test", "--workspace", "--release", "--no-fail-fast"]).args(extra);
    cargo.current_dir(root).env("TSUBAME_SKIP_LOG", &skip_log).env("TSUBAME_REQUIRE_TOOLS", "1");
    if Path::new("/dev/kvm").exists() {
        cargo.env("TSUBAME_REQUIRE_KVM", "1");
    }
    let (cargo_ok, cargo_lines) = run_teed(&mut cargo);
    let mut total = cargo_counts(&cargo_lines);

    let mut pytest = Command::new("python3");
    pytest.args(["-m", "pytest", "-q"]).args(harness_tests(root)).current_dir(root);
    let (pytest_ok, pytest_lines) = run_teed(&mut pytest);
    let harness = pytest_counts(&pytest_lines);
    total.passed += harness.passed;
    total.failed += harness.failed;
    total.skipped += harness.skipped;

    // libtest counted each skipped test as passed.
    let skipped = skipped_tests(&skip_log);
    let rust_skipped = skipped.len() as u64;
    total.passed = total.passed.saturating_sub(rust_skipped);
    total.skipped += rust_skipped;
    println!();
    for line in &skipped {
        println!("{line}");
    }
    let mut failed = total.failed;
    if !cargo_ok && failed == 0 {
        // A build error or a crashed test binary leaves no result line.
        eprintln!("xtask: cargo test failed without a failing test: see its output above");
        failed = 1;
    }
    if !pytest_ok && harness.failed == 0 {
        eprintln!("xtask: pytest failed without a failing test: see its output above");
        failed += 1;
    }
    println!("tests: {} passed, {} failed, {} skipped", total.passed, failed, total.skipped);
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The harness's test files, bench/test_*.py.
fn harness_tests(root: &Path) -> Vec<String> {
    let mut files: Vec<String> = std::fs::read_dir(root.join("bench"))
        .map(|dir| {
            dir.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|name| name.starts_with("test_") && name.ends_with(".py"))
                .map(|name| format!("bench/{name}"))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

/// Runs `command`, passing its output through line by line, and returns
/// whether it succeeded and its lines (stdout and stderr).
fn run_teed(command: &mut Command) -> (bool, Vec<String>) {
    let mut child = match command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn() {
        Ok(child) => child,
        Err(e) => {
            eprintln!("xtask: cannot run {:?}: {e}", command.get_program());
            return (false, Vec::new());
        }
    };
    let stdout = child.stdout.take().expect("piped");
    let stderr = child.stderr.take().expect("piped");
    let err_thread = std::thread::spawn(move || {
        let mut lines = Vec::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = writeln!(std::io::stderr(), "{line}");
            lines.push(line);
        }
        lines
    });
    let mut lines = Vec::new();
    for line in BufReader::new(stdout).lines().map_while(Result::ok) {
        let _ = writeln!(std::io::stdout(), "{line}");
        lines.push(line);
    }
    lines.extend(err_thread.join().unwrap_or_default());
    let ok = child.wait().is_ok_and(|s| s.success());
    (ok, lines)
}

/// Sums libtest's `test result: ok. N passed; N failed; N ignored; ...`
/// lines (ignored tests count as skipped).
fn cargo_counts(lines: &[String]) -> Counts {
    let mut counts = Counts::default();
    for line in lines {
        let Some(rest) = line.strip_prefix("test result: ") else { continue };
        for part in rest.split(';') {
            let mut words = part.split_whitespace().rev();
            let (Some(what), Some(n)) = (words.next(), words.next()) else { continue };
            let Ok(n) = n.parse::<u64>() else { continue };
            match what {
                "passed" => counts.passed += n,
                "failed" => counts.failed += n,
                "ignored" => counts.skipped += n,
                _ => {}
            }
        }
    }
    counts
}

/// pytest's closing line: `3 failed, 30 passed, 2 skipped in 4.1s`.
fn pytest_counts(lines: &[String]) -> Counts {
    let mut counts = Counts::default();
    let Some(last) = lines.iter().rev().find(|l| l.contains(" in ") && (l.contains("passed") || l.contains("failed")))
    else {
        return counts;
    };
    let summary = last.trim_matches(|c: char| c == '=' || c.is_whitespace());
    let summary = summary.split(" in ").next().unwrap_or_default();
    for part in summary.split(',') {
        let mut words = part.split_whitespace();
        let (Some(n), Some(what)) = (words.next(), words.next()) else { continue };
        let Ok(n) = n.parse::<u64>() else { continue };
        match what {
            "passed" | "xpassed" => counts.passed += n,
            "failed" | "error" | "errors" => counts.failed += n,
            "skipped" | "xfailed" | "deselected" => counts.skipped += n,
            _ => {}
        }
    }
    counts
}

/// The distinct lines `tsubame_testkit::skip` logged.
fn skipped_tests(log: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    lines.sort();
    lines.dedup();
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(lines: &[&str]) -> Vec<String> {
        lines.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn libtest_result_lines_are_summed() {
        let lines = strings(&[
            "running 3 tests",
            "test result: ok. 3 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.01s",
            "test result: FAILED. 5 passed; 2 failed; 1 ignored; 0 measured; 0 filtered out; finished in 1.2s",
        ]);
        assert_eq!(cargo_counts(&lines), Counts { passed: 8, failed: 2, skipped: 1 });
    }

    #[test]
    fn pytest_closing_lines_are_read() {
        let one = strings(&["....", "35 passed in 3.21s"]);
        assert_eq!(pytest_counts(&one), Counts { passed: 35, failed: 0, skipped: 0 });
        let mixed = strings(&["=== 1 failed, 30 passed, 2 skipped in 4.10s ==="]);
        assert_eq!(pytest_counts(&mixed), Counts { passed: 30, failed: 1, skipped: 2 });
    }
}
