//! Post-copy failures between real processes: a process killed during
//! the post-copy phase loses the VM — the survivor says so in one line and
//! never runs a copy of its own — and `tsubame migrate --resume` takes a
//! cut link back up, to a new address if need be.

mod common;

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{control, kvm_or_skip, scratch, spawn_receive, spawn_run, try_control, tsubame, wait_for_socket, Proc};
use serde_json::{json, Value};

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// A source VM, a destination, and a post-copy migration started between
/// them (through `to`, when given, else straight to the destination);
/// returns once the destination runs the VM.
struct Pair {
    source: Proc,
    dest: Proc,
    source_sock: std::path::PathBuf,
    dest_sock: std::path::PathBuf,
    incoming: std::path::PathBuf,
    dest_log: std::path::PathBuf,
    source_log: std::path::PathBuf,
    /// Last: removed after both processes stopped.
    _dir: common::Scratch,
}

impl Pair {
    fn start(name: &str) -> Pair {
        let dir = scratch(name);
        let (source_sock, dest_sock) = (dir.join("source.sock"), dir.join("dest.sock"));
        let (incoming, dest_log) = (dir.join("incoming.sock"), dir.join("dest.log"));
        let source_log = dir.join("source.log");
        let vm = ["--memory", "64M", "--workload", "kv", "--workload-arg", "wss=24M"];
        let source = spawn_run(&source_sock, &vm, std::fs::File::create(&source_log).unwrap().into());
        let dest = spawn_receive(&incoming, Some(&dest_sock), std::fs::File::create(&dest_log).unwrap().into());
        wait_for_socket(&source_sock);
        wait_for_socket(&dest_sock);
        std::thread::sleep(Duration::from_millis(300));
        Pair { source, dest, source_sock, dest_sock, incoming, dest_log, source_log, _dir: dir }
    }

    /// Starts post-copy at once at `rate` bytes/s (slow: the phase lasts).
    fn migrate(&self, to: &Path, rate: u64, timeout_s: u64) {
        let request = json!({
            "cmd": "migrate",
            "to": format!("unix:{}", to.display()),
            "postcopy": "after=0",
            "postcopy_timeout_s": timeout_s,
            "max_bandwidth": rate,
        });
        let reply = control(&self.source_sock, &request);
        assert_eq!(reply["ok"], true, "{reply}");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !read(&self.dest_log).contains("post-copy: the VM runs here") {
            assert!(Instant::now() < deadline, "post-copy never started: {}", read(&self.dest_log));
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The source's migration once it ended (None while it runs).
    fn ended(&self) -> Option<Value> {
        let q = try_control(&self.source_sock, &json!({"cmd": "query-migrate"}))?;
        (q["status"] != "active").then_some(q)
    }
}

#[test]
fn killing_the_source_during_post_copy_loses_the_vm_and_the_destination_says_so() {
    if !kvm_or_skip() {
        return;
    }
    let mut pair = Pair::start("pc-kill-source");
    pair.migrate(&pair.incoming.clone(), 4_000_000, 2);
    pair.source.0.kill().unwrap();
    says_the_vm_is_lost(&mut pair.dest, &pair.dest_log);
}

#[test]
fn killing_the_destination_during_post_copy_loses_the_vm_and_the_source_says_so() {
    if !kvm_or_skip() {
        return;
    }
    let mut pair = Pair::start("pc-kill-dest");
    pair.migrate(&pair.incoming.clone(), 4_000_000, 2);
    pair.dest.0.kill().unwrap();
    let _ = pair.dest.0.wait();
    let deadline = Instant::now() + Duration::from_secs(20);
    let query = loop {
        if let Some(q) = pair.ended() {
            break q;
        }
        assert!(Instant::now() < deadline, "the source never gave up");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(query["status"], "failed", "{query}");
    let error = query["stats"]["error"].as_str().unwrap();
    assert!(error.contains("the VM is lost") && !error.contains('\n'), "{error}");
    // Never a second copy: the source does not run its stale VM again
    // but ends, saying why in one line.
    says_the_vm_is_lost(&mut pair.source, &pair.source_log);
}

/// The surviving process exits 1, one line of its stderr saying the VM is
/// lost.
fn says_the_vm_is_lost(survivor: &mut Proc, log: &Path) {
    let status = wait_exit(survivor, Duration::from_secs(20));
    let log = read(log);
    assert_eq!(status.code(), Some(1), "{log}");
    let lines: Vec<&str> = log.lines().filter(|l| l.contains("error")).collect();
    assert_eq!(lines.len(), 1, "one line says what happened: {log}");
    assert!(lines[0].contains("the VM is lost"), "{log}");
}

#[test]
fn migrate_resume_reconnects_a_cut_link_to_a_new_address() {
    if !kvm_or_skip() {
        return;
    }
    let mut pair = Pair::start("pc-resume");
    // Nothing to resume yet: one line, non-zero exit.
    let out = tsubame().args(["migrate", "--resume", "--control"]).arg(&pair.source_sock).output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no paused post-copy migration to resume"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");

    // Migrate through a relay that then goes away for good: the link is
    // cut and every automatic retry at the relay's address fails.
    let relay_path = pair.incoming.with_file_name("relay.sock");
    let relay = Relay::start(&relay_path, &pair.incoming);
    pair.migrate(&relay_path, 4_000_000, 60);
    relay.remove();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let q = try_control(&pair.source_sock, &json!({"cmd": "query-migrate"}))
            .unwrap_or_else(|| panic!("source gone: {}", read(&pair.source_log)));
        if q["progress"]["phase"] == "postcopy-paused" {
            break;
        }
        assert!(Instant::now() < deadline, "the source never paused: {q}");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Against another destination (one that holds no part of this VM):
    // refused in one line, and the migration stays paused.
    let other = pair.incoming.with_file_name("other.sock");
    let _other = spawn_receive(&other, None, Stdio::null());
    wait_for_socket(&other);
    let out = tsubame()
        .args(["migrate", "--resume", "--control"])
        .arg(&pair.source_sock)
        .arg("--to")
        .arg(format!("unix:{}", other.display()))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("cannot resume"), "{stderr}");
    let q = control(&pair.source_sock, &json!({"cmd": "query-migrate"}));
    assert_eq!(q["progress"]["phase"], "postcopy-paused", "{q}");

    let out = tsubame()
        .args(["migrate", "--resume", "--control"])
        .arg(&pair.source_sock)
        .arg("--to")
        .arg(format!("unix:{}", pair.incoming.display()))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}{}", String::from_utf8_lossy(&out.stderr), read(&pair.source_log));
    assert!(stdout.contains("migration completed"), "{stdout}");
    assert!(stdout.contains("memory digest matched"), "{stdout}");
    let dest = control(&pair.dest_sock, &json!({"cmd": "stats"}));
    assert_eq!(dest["status"], "running", "{dest}");
    // The source ends once the VM is all at the destination.
    let status = wait_exit(&mut pair.source, Duration::from_secs(20));
    assert!(status.success(), "{}", read(&pair.source_log));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !read(&pair.dest_log).contains("post-copy done") {
        assert!(Instant::now() < deadline, "{}", read(&pair.dest_log));
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn wait_exit(p: &mut Proc, within: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Some(status) = p.0.try_wait().unwrap() {
            return status;
        }
        assert!(Instant::now() < deadline, "the process did not exit");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Forwards connections from a Unix socket to another until removed:
/// then it cuts them all and its address no longer exists.
struct Relay {
    path: std::path::PathBuf,
    open: std::sync::Arc<std::sync::Mutex<Vec<std::os::unix::net::UnixStream>>>,
}

impl Relay {
    fn start(path: &Path, to: &Path) -> Relay {
        use std::os::unix::net::{UnixListener, UnixStream};
        let listener = UnixListener::bind(path).unwrap();
        let open = std::sync::Arc::new(std::sync::Mutex::new(Vec::<UnixStream>::new()));
        let (registry, to) = (open.clone(), to.to_path_buf());
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(server) = UnixStream::connect(&to) else { continue };
                registry.lock().unwrap().extend([client.try_clone().unwrap(), server.try_clone().unwrap()]);
                for (mut from, mut into) in
                    [(client.try_clone().unwrap(), server.try_clone().unwrap()), (server, client)]
                {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut into);
                        let _ = into.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
        Relay { path: path.to_path_buf(), open }
    }

    fn remove(&self) {
        let _ = std::fs::remove_file(&self.path);
        for s in self.open.lock().unwrap().drain(..) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}
