//! Helpers shared by the CLI's integration tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

/// The built `tsubame` binary.
pub fn tsubame() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tsubame"))
}

/// True when KVM tests can run (`tsubame_testkit::kvm`).
pub fn kvm_or_skip() -> bool {
    tsubame_testkit::kvm()
}

/// A fresh scratch directory under the system temp dir, removed when the
/// test is done with it (kept when the test fails, to look at).
pub fn scratch(name: &str) -> Scratch {
    let dir = std::env::temp_dir().join(format!("tsubame-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    Scratch(dir)
}

/// See [`scratch`].
pub struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl AsRef<std::path::Path> for Scratch {
    fn as_ref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// Parses the ops counters out of guest output.
pub fn ops_in(text: &str) -> Vec<u64> {
    text.lines().filter_map(|l| tsubame_vmm::guest_elf::parse_progress(l).map(|p| p.ops)).collect()
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

/// Sends one control request on a new connection and returns the reply,
/// or what went wrong (the server's QMP greeting is skipped).
pub fn ask(socket: &std::path::Path, request: &serde_json::Value) -> Result<serde_json::Value, String> {
    use std::io::{BufRead, BufReader, Write};
    let mut stream = std::os::unix::net::UnixStream::connect(socket).map_err(|e| format!("connect: {e}"))?;
    stream.set_read_timeout(Some(std::time::Duration::from_secs(10))).map_err(|e| e.to_string())?;
    stream.write_all(format!("{request}\n").as_bytes()).map_err(|e| format!("write: {e}"))?;
    // read_line goes on after EINTR; a bare read returns it as an error.
    let mut reader = BufReader::new(stream);
    let mut greeting = String::new();
    loop {
        let mut line = String::new();
        match reader.read_line(&mut line) {
            Ok(0) => return Err(format!("connection closed (after {greeting:?})")),
            Ok(_) if line.starts_with("{\"QMP\"") => greeting = line,
            Ok(_) => return serde_json::from_str(&line).map_err(|e| format!("{e} in {line:?}")),
            Err(e) => return Err(format!("read: {e} ({:?}; after {greeting:?})", e.kind())),
        }
    }
}

/// [`ask`], None when it went wrong.
pub fn try_control(socket: &std::path::Path, request: &serde_json::Value) -> Option<serde_json::Value> {
    ask(socket, request).ok()
}

/// Sends one control request and returns the reply.
pub fn control(socket: &std::path::Path, request: &serde_json::Value) -> serde_json::Value {
    try_control(socket, request).unwrap_or_else(|| panic!("{}: no reply to {request}", socket.display()))
}

/// Polls `stats` on `socket` until `done` holds (returning that reply),
/// failing on a guest error or after `seconds`.
pub fn wait_stats(
    socket: &std::path::Path,
    what: &str,
    seconds: u64,
    done: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(seconds);
    loop {
        let stats = control(socket, &serde_json::json!({"cmd": "stats"}));
        assert!(stats["guest"]["error"].is_null(), "guest failed: {stats}");
        if done(&stats) {
            return stats;
        }
        assert!(std::time::Instant::now() < deadline, "{what}: never happened: {stats}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// A child process, killed when dropped.
pub struct Proc(pub std::process::Child);

impl Proc {
    /// True while it has not exited.
    pub fn alive(&mut self) -> bool {
        self.0.try_wait().map(|s| s.is_none()).unwrap_or(false)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Reads one whole frame as it travels (header and payload, unchecked
/// beyond the header), for the tests' man-in-the-middle proxies.
pub fn read_raw_frame(
    from: &mut impl std::io::Read,
) -> Option<([u8; tsubame_migrate::protocol::FRAME_HEADER_LEN], tsubame_migrate::protocol::FrameKind, Vec<u8>)> {
    let mut header = [0u8; tsubame_migrate::protocol::FRAME_HEADER_LEN];
    from.read_exact(&mut header).ok()?;
    let (kind, len) = tsubame_migrate::protocol::parse_header(&header).ok()?;
    let mut payload = vec![0u8; len];
    from.read_exact(&mut payload).ok()?;
    Some((header, kind, payload))
}

/// `tsubame run --quiet --control CONTROL VM_ARGS...`, its stderr to `stderr`.
pub fn spawn_run(control: &std::path::Path, vm_args: &[&str], stderr: std::process::Stdio) -> Proc {
    Proc(
        tsubame()
            .args(["run", "--quiet", "--control"])
            .arg(control)
            .args(vm_args)
            .stdout(std::process::Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap(),
    )
}

/// `tsubame receive --quiet --listen unix:LISTEN [--control CONTROL]`, its
/// stderr to `stderr`.
pub fn spawn_receive(listen: &std::path::Path, control: Option<&std::path::Path>, stderr: std::process::Stdio) -> Proc {
    let mut command = tsubame();
    command.args(["receive", "--quiet", "--listen"]).arg(format!("unix:{}", listen.display()));
    if let Some(control) = control {
        command.arg("--control").arg(control);
    }
    Proc(command.stdout(std::process::Stdio::null()).stderr(stderr).spawn().unwrap())
}

/// `tsubame migrate --control CONTROL --to TO --json JSON EXTRA...`: its
/// exit code, its stdout and stderr, and the statistics it wrote to `json`
/// (Null when it wrote none).
pub fn migrate_via(
    control: &std::path::Path,
    to: &str,
    json: &std::path::Path,
    extra: &[&str],
) -> (Option<i32>, String, serde_json::Value) {
    let _ = std::fs::remove_file(json);
    let out = tsubame()
        .args(["migrate", "--control"])
        .arg(control)
        .args(["--to", to, "--json"])
        .arg(json)
        .args(extra)
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let stats = std::fs::read_to_string(json).map(|t| serde_json::from_str(&t).unwrap()).unwrap_or_default();
    (out.status.code(), text, stats)
}

/// `nbdkit memory SIZE` on a unix socket, killed on drop.
pub struct MemoryHost {
    child: std::process::Child,
    socket: PathBuf,
}

impl MemoryHost {
    pub fn start(dir: &std::path::Path, name: &str, size: &str) -> MemoryHost {
        let socket = dir.join(format!("{name}.sock"));
        let child = Command::new("nbdkit")
            .args(["-f", "--exit-with-parent", "-U"])
            .arg(&socket)
            .args(["memory", size])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run nbdkit ({e}): install it (apt-get install nbdkit)"));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            assert!(std::time::Instant::now() < deadline, "nbdkit did not listen on {}", socket.display());
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        MemoryHost { child, socket }
    }

    pub fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.socket.display())
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for MemoryHost {
    fn drop(&mut self) {
        self.kill();
    }
}
