//! Fault injection: kill -9 the source, kill -9 the destination, or cut
//! the connection at random points of a live migration, then check that
//! the VM runs exactly once.
//!
//! `cargo test --release --test faults -- --nocapture` runs 50 trials
//! (`TSUBAME_FAULT_TRIALS=N` for more, `TSUBAME_FAULT_SEED=S` to repeat a
//! run) and prints `faults: N trials, L lost, D duplicated`.
//!
//! Each trial starts a source VM (`run --control`) and a destination
//! (`receive --control`) joined by a frame-aware proxy on Unix sockets,
//! migrates, and lets the proxy strike at one point: a PAGES frame of
//! iteration 0 or of a later iteration, STATE or DIGEST (stop-and-copy),
//! READY (between READY and COMMIT), COMMIT (delivered or not) or RESUMED.
//! Then:
//! - never two running copies (`duplicated`);
//! - a copy runs, or else one of the outcomes that lose nothing to the
//!   protocol: the source was killed before the destination had COMMIT
//!   (the VM died with its host, and the destination must not run a
//!   half-received copy), or COMMIT left the source and the source is
//!   paused and says so (the cut fell between COMMIT sent and received, or
//!   the destination died after it); anything else is `lost`;
//! - a running copy's guest makes progress without a guest error (the kv
//!   guest verifies the values it reads: corrupted memory stops it), and a
//!   copy at the destination passed the memory digest check.
//!
//! The same trials run a second time with a `disk-mixed` guest on a disk
//! image both ends open (`TSUBAME_DISK_FAULT_TRIALS`, 50 by default):
//! afterwards every write the guest saw acknowledged must be on the image
//! exactly once, intact, in its place (`tsubame_block::records::check`),
//! and a guest that read back a stale block (a warm cache that missed a
//! write) stops with an error, which counts as broken.

#[path = "../common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{kvm_or_skip, read_raw_frame, scratch, spawn_receive, spawn_run, try_control as control, wait_for_socket};
use serde_json::{json, Value};
use tsubame_migrate::protocol::{self as wire, FrameKind, PREAMBLE_LEN};

/// xorshift64*: enough randomness for choosing fault points.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Action {
    KillSource,
    KillDestination,
    Cut,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Point {
    /// The Nth PAGES frame of an iteration (or that iteration's end).
    Pages { iteration: u32, nth: u32 },
    /// STATE, before it is delivered.
    State,
    /// DIGEST, before it is delivered.
    Digest,
    /// READY, before it reaches the source.
    Ready,
    /// COMMIT: delivered first, or dropped.
    Commit { delivered: bool },
    /// RESUMED, before it reaches the source.
    Resumed,
}

/// What the proxy saw and did.
#[derive(Default, Debug)]
struct Seen {
    struck: bool,
    commit_sent: bool,
    commit_delivered: bool,
    pages_in_target: u32,
}

struct Proxy {
    action: Action,
    point: Point,
    source_pid: u32,
    dest_pid: u32,
    seen: Mutex<Seen>,
    conns: Mutex<Vec<UnixStream>>,
    stop: AtomicBool,
}

impl Proxy {
    fn strike(&self, seen: &mut Seen) {
        if seen.struck {
            return;
        }
        seen.struck = true;
        let pid = match self.action {
            Action::KillSource => Some(self.source_pid),
            Action::KillDestination => Some(self.dest_pid),
            Action::Cut => None,
        };
        if let Some(pid) = pid {
            // SIGKILL, as `kill -9`.
            let _ = std::process::Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
        self.stop.store(true, Ordering::Release);
        for c in self.conns.lock().unwrap().iter() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Decides what to do with one frame: forward it (true) or not.
    fn on_frame(&self, kind: FrameKind, payload: &[u8], to_dest: bool, to: &mut UnixStream) -> bool {
        let mut seen = self.seen.lock().unwrap();
        if seen.struck {
            return false;
        }
        let hit = match (self.point, kind, to_dest) {
            (Point::Pages { iteration, nth }, FrameKind::Pages, true) => {
                let it = payload.get(..4).map_or(0, |b| u32::from_le_bytes(b.try_into().unwrap()));
                if it == iteration {
                    seen.pages_in_target += 1;
                }
                it > iteration || (it == iteration && seen.pages_in_target >= nth)
            }
            (Point::Pages { iteration, .. }, FrameKind::IterationEnd, true) => {
                payload.get(..4).map_or(0, |b| u32::from_le_bytes(b.try_into().unwrap())) >= iteration
            }
            (Point::Pages { .. }, FrameKind::State, true) => true,
            (Point::State, FrameKind::State, true) => true,
            (Point::Digest, FrameKind::Digest, true) => true,
            (Point::Ready, FrameKind::Ready, false) => true,
            (Point::Resumed, FrameKind::Resumed, false) => true,
            (Point::Commit { delivered }, FrameKind::Commit, true) => {
                seen.commit_sent = true;
                if delivered {
                    let header = wire::frame_header(FrameKind::Commit, &[]);
                    if to.write_all(&header).is_ok() {
                        seen.commit_delivered = true;
                    }
                }
                true
            }
            _ => false,
        };
        if kind == FrameKind::Commit && to_dest {
            seen.commit_sent = true;
        }
        if hit {
            self.strike(&mut seen);
            return false;
        }
        if kind == FrameKind::Commit && to_dest {
            seen.commit_delivered = true; // forwarded below
        }
        true
    }

    fn relay(self: &Arc<Self>, mut from: UnixStream, mut to: UnixStream, to_dest: bool) {
        let mut preamble = [0u8; PREAMBLE_LEN];
        if from.read_exact(&mut preamble).is_ok() && to.write_all(&preamble).is_ok() {
            while let Some((header, kind, payload)) = read_raw_frame(&mut from) {
                if !self.on_frame(kind, &payload, to_dest, &mut to) {
                    break;
                }
                if to.write_all(&header).is_err() || to.write_all(&payload).is_err() {
                    break;
                }
            }
        }
        // One side closed: close the other, as a network would.
        let _ = from.shutdown(std::net::Shutdown::Both);
        let _ = to.shutdown(std::net::Shutdown::Both);
    }

    /// Relays every connection to `listen` on to `target` until struck.
    fn start(self: &Arc<Self>, listen: &Path, target: PathBuf) -> std::thread::JoinHandle<()> {
        let listener = UnixListener::bind(listen).unwrap();
        listener.set_nonblocking(true).unwrap();
        let proxy = self.clone();
        std::thread::spawn(move || {
            let mut relays = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(120);
            while !proxy.stop.load(Ordering::Acquire) && Instant::now() < deadline {
                let client = match listener.accept() {
                    Ok((c, _)) => c,
                    Err(_) => {
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    }
                };
                client.set_nonblocking(false).unwrap();
                let Ok(server) = UnixStream::connect(&target) else {
                    continue;
                };
                {
                    let mut conns = proxy.conns.lock().unwrap();
                    conns.push(client.try_clone().unwrap());
                    conns.push(server.try_clone().unwrap());
                }
                let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                let p = proxy.clone();
                relays.push(std::thread::spawn(move || p.relay(s2, c2, false)));
                let p = proxy.clone();
                relays.push(std::thread::spawn(move || p.relay(client, server, true)));
            }
            for r in relays {
                let _ = r.join();
            }
        })
    }
}

/// How a trial ended.
#[derive(Debug, PartialEq)]
enum Outcome {
    /// One copy runs (here or there), the other is gone, waiting or paused.
    OneRunning(&'static str),
    /// The source was killed before the destination had COMMIT; the
    /// destination runs nothing.
    DiedWithSource,
    /// COMMIT left the source, the destination does not run the VM, and
    /// the source is paused and says so.
    SourcePausedSaysSo,
    Lost(String),
    Duplicated(String),
    /// A running copy misbehaves, or a check failed.
    Broken(String),
}

const VM: &[&str] = &["--memory", "64M", "--workload", "kv", "--workload-arg", "wss=16M"];
const DISK_VM: &[&str] = &["--memory", "64M", "--workload", "disk-mixed", "--block-cache", "8M"];
/// Size of each disk trial's image.
const DISK_BYTES: u64 = 32 << 20;

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// The ops counter of a copy rises and its guest reports no error.
fn guest_progresses(socket: &Path) -> Result<(), String> {
    let first = control(socket, &json!({"cmd": "stats"})).ok_or("no stats")?;
    std::thread::sleep(Duration::from_millis(400));
    let later = control(socket, &json!({"cmd": "stats"})).ok_or("no stats")?;
    let ops = |v: &Value| v["guest"]["ops"].as_u64().unwrap_or(0);
    if later["status"] != "running" || ops(&later) <= ops(&first) {
        return Err(format!("guest does not progress: {first} then {later}"));
    }
    if !later["guest"]["error"].is_null() {
        return Err(format!("guest failed: {later}"));
    }
    Ok(())
}

/// One trial; with a disk, then checks the image against the last write
/// the surviving copy's guest saw acknowledged.
fn trial(index: usize, rng: &mut Rng, action: Action, point: Point, disk: bool) -> Outcome {
    let dir = scratch(&format!("faults-{}{index}", if disk { "disk-" } else { "" }));
    let image = dir.join("disk.img");
    let mut vm: Vec<String> = (if disk { DISK_VM } else { VM }).iter().map(|s| s.to_string()).collect();
    if disk {
        std::fs::File::create(&image).unwrap().set_len(DISK_BYTES).unwrap();
        vm.extend(["--disk".to_string(), image.display().to_string()]);
    }
    let (outcome, acked) = trial_outcome(&dir, rng, action, point, &vm);
    if !disk || !matches!(outcome, Outcome::OneRunning(_) | Outcome::DiedWithSource | Outcome::SourcePausedSaysSo) {
        return outcome;
    }
    // Both processes are gone now (killed when the trial ended).
    let report = tsubame_block::records::check(&mut std::fs::File::open(&image).unwrap(), None, acked).unwrap();
    if report.run.is_none() || !report.ok() {
        return Outcome::Broken(format!("{outcome:?}, last acknowledged write {acked:?}: the image fails: {report:?}"));
    }
    outcome
}

/// The last write the guest at `socket` saw acknowledged.
fn acked(socket: &Path) -> Option<u64> {
    control(socket, &json!({"cmd": "stats"}))?["guest"]["fields"]["ack"].as_u64()
}

fn trial_outcome(dir: &Path, rng: &mut Rng, action: Action, point: Point, vm: &[String]) -> (Outcome, Option<u64>) {
    let vm: Vec<&str> = vm.iter().map(String::as_str).collect();
    let source_sock = dir.join("source.sock");
    let dest_sock = dir.join("dest.sock");
    let incoming = dir.join("incoming.sock");
    let dest_log = dir.join("dest.log");
    let mut source = spawn_run(&source_sock, &vm, Stdio::null());
    let mut dest = spawn_receive(&incoming, Some(&dest_sock), std::fs::File::create(&dest_log).unwrap().into());
    wait_for_socket(&source_sock);
    wait_for_socket(&dest_sock);
    std::thread::sleep(Duration::from_millis(200 + rng.below(200)));

    let proxy = Arc::new(Proxy {
        action,
        point,
        source_pid: source.0.id(),
        dest_pid: dest.0.id(),
        seen: Mutex::new(Seen::default()),
        conns: Mutex::new(Vec::new()),
        stop: AtomicBool::new(false),
    });
    let proxy_path = dir.join("proxy.sock");
    let relay = proxy.start(&proxy_path, incoming.clone());
    let channels = 1 + rng.below(2);
    let request = json!({
        "cmd": "migrate",
        "to": format!("unix:{}", proxy_path.display()),
        // Iterate a few times whatever the dirtying rate: later iterations exist.
        "downtime_limit_ms": 0,
        "max_iterations": 3 + rng.below(2),
        "channels": channels,
        "encode_threads": 2,
        // The pre-copy exchange's fault points: post-copy's own (cuts at
        // random points of its phase, kill -9 of either end) are tested
        // in crates/migrate/tests/postcopy.rs and tests/postcopy.rs.
        "postcopy": "off",
    });
    let reply = control(&source_sock, &request);
    if reply.as_ref().map(|r| r["ok"] != true).unwrap_or(true) {
        return (Outcome::Broken(format!("migrate request failed: {reply:?}")), None);
    }

    // Wait until the source's migration ended (or the source is gone).
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut source_query = Value::Null;
    while Instant::now() < deadline {
        match control(&source_sock, &json!({"cmd": "query-migrate"})) {
            Some(q) if q["status"] == "active" => std::thread::sleep(Duration::from_millis(50)),
            Some(q) => {
                source_query = q;
                break;
            }
            None if !source.alive() => break,
            None => std::thread::sleep(Duration::from_millis(50)),
        }
    }
    proxy.stop.store(true, Ordering::Release);
    // Wait until the destination settled: runs the VM, failed, or is gone.
    let deadline = Instant::now() + Duration::from_secs(45);
    loop {
        let log = read(&dest_log);
        if !dest.alive() || log.contains("the VM runs here now") || log.contains("incoming migration failed") {
            break;
        }
        if Instant::now() > deadline {
            return (Outcome::Broken(format!("destination never settled: {log}")), None);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = relay.join();
    let seen = std::mem::take(&mut *proxy.seen.lock().unwrap());

    let source_status = control(&source_sock, &json!({"cmd": "stats"}));
    let dest_status = control(&dest_sock, &json!({"cmd": "stats"}));
    let source_running = source_status.as_ref().is_some_and(|s| s["status"] == "running");
    let source_paused = source_status.as_ref().is_some_and(|s| s["status"] == "paused");
    let dest_running = dest_status.as_ref().is_some_and(|s| s["status"] == "running");
    let dest_other = dest_status.as_ref().is_some_and(|s| s["status"] != "running" && s["status"] != "waiting");
    let describe = || {
        format!(
            "{action:?} at {point:?} ({channels} ch), proxy {seen:?}: source {source_status:?}, query {source_query}, \
             destination {dest_status:?}, log: {}",
            read(&dest_log).trim().replace('\n', " | ")
        )
    };
    if dest_other {
        return (Outcome::Broken(format!("destination holds a VM that does not run: {}", describe())), None);
    }
    if source_running && dest_running {
        return (Outcome::Duplicated(describe()), None);
    }
    if source_running {
        if let Err(e) = guest_progresses(&source_sock) {
            return (Outcome::Broken(format!("{e}: {}", describe())), None);
        }
        if seen.commit_delivered {
            return (Outcome::Broken(format!("the source resumed after COMMIT: {}", describe())), None);
        }
        return (Outcome::OneRunning("source"), acked(&source_sock));
    }
    if dest_running {
        if let Err(e) = guest_progresses(&dest_sock) {
            return (Outcome::Broken(format!("{e}: {}", describe())), None);
        }
        if !read(&dest_log).contains("memory verified") {
            return (Outcome::Broken(format!("destination runs an unverified VM: {}", describe())), None);
        }
        if source_query["status"] == "completed" && source_query["stats"]["digest_verified"] != true {
            return (Outcome::Broken(format!("completed without digest_verified: {}", describe())), None);
        }
        return (Outcome::OneRunning("destination"), acked(&dest_sock));
    }
    let says_paused = source_query["stats"]["error"].as_str().is_some_and(|e| e.contains("stays paused here"));
    if source_paused && says_paused && seen.commit_sent {
        return (Outcome::SourcePausedSaysSo, acked(&source_sock));
    }
    if action == Action::KillSource && !seen.commit_delivered && !source.alive() {
        return (Outcome::DiedWithSource, None);
    }
    (Outcome::Lost(describe()), None)
}

#[test]
fn faults_at_random_points_never_lose_or_duplicate_the_vm() {
    if !kvm_or_skip() {
        return;
    }
    fault_suite("TSUBAME_FAULT_TRIALS", false);
}

#[test]
fn faults_never_lose_an_acknowledged_disk_write() {
    if !kvm_or_skip() {
        return;
    }
    fault_suite("TSUBAME_DISK_FAULT_TRIALS", true);
}

fn fault_suite(trials_variable: &str, disk: bool) {
    let name = if disk { "disk faults" } else { "faults" };
    let trials: usize = std::env::var(trials_variable).ok().and_then(|t| t.parse().ok()).unwrap_or(50);
    let seed: u64 = std::env::var("TSUBAME_FAULT_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1
    });
    println!("{name}: seed {seed} (TSUBAME_FAULT_SEED={seed} repeats this run)");
    let mut rng = Rng(seed);
    let actions = [Action::KillSource, Action::KillDestination, Action::Cut];
    let started = Instant::now();
    let (mut lost, mut duplicated, mut broken) = (0, 0, Vec::new());
    let mut tally: std::collections::BTreeMap<String, usize> = Default::default();
    for index in 0..trials {
        // Every action meets every point in turn; where inside it is random.
        let action = actions[index % 3];
        let point = match (index / 3) % 7 {
            0 => Point::Pages { iteration: 0, nth: 1 + rng.below(8) as u32 },
            1 => Point::Pages { iteration: 1 + rng.below(2) as u32, nth: 1 + rng.below(3) as u32 },
            2 => Point::State,
            3 => Point::Digest,
            4 => Point::Ready,
            5 => Point::Commit { delivered: rng.below(2) == 0 },
            _ => Point::Resumed,
        };
        let outcome = trial(index, &mut rng, action, point, disk);
        println!("{name}: trial {index:>3}: {action:?} at {point:?}: {outcome:?}");
        let key = match &outcome {
            Outcome::OneRunning(w) => format!("one running ({w})"),
            Outcome::DiedWithSource => "died with the killed source".into(),
            Outcome::SourcePausedSaysSo => "source paused after commit, says so".into(),
            Outcome::Lost(_) => "lost".into(),
            Outcome::Duplicated(_) => "duplicated".into(),
            Outcome::Broken(_) => "broken".into(),
        };
        *tally.entry(key).or_default() += 1;
        match outcome {
            Outcome::Lost(_) => lost += 1,
            Outcome::Duplicated(_) => duplicated += 1,
            Outcome::Broken(why) => broken.push(format!("trial {index}: {why}")),
            _ => {}
        }
    }
    println!("{name}: outcomes {tally:?} in {:.0} s", started.elapsed().as_secs_f64());
    println!("{name}: {trials} trials, {lost} lost, {duplicated} duplicated");
    assert!(broken.is_empty(), "{} broken trials:\n{}", broken.len(), broken.join("\n"));
    assert_eq!((lost, duplicated), (0, 0), "VMs lost or duplicated");
}
