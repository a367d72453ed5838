//! Post-copy on KVM: the destination runs the guest before all its memory
//! is there; every workload continues there with its memory verified page
//! by page, and the source never runs it again.

mod common;

use std::time::{Duration, Instant};

use common::{kvm_or_skip, ops_at_least, ops_until};
use crossbeam_channel::Receiver;
use tsubame_migrate::destination::{receive, ReceiveOptions};
use tsubame_migrate::stats::{Status, StopReason};
use tsubame_migrate::transport::{Address, Listener};
use tsubame_migrate::{source, MigrateOptions, PostcopyMode, ProgressCell};
use tsubame_vmm::{guest_elf, ConsoleLine, Vm, VmConfig};

/// Migrates a VM running `args` with `options`; checks the guest goes on
/// at the destination and the post-copy phase ends verified.
fn migrate_postcopy(memory_bytes: u64, args: &str, options: MigrateOptions) -> tsubame_migrate::MigrationStats {
    let mut vm = Vm::create(&VmConfig { memory_bytes, hugepages: true }).unwrap();
    let cmdline = format!("{args} tsc_khz={}", vm.tsc_khz());
    vm.load_guest(guest_elf::GUEST_ELF, &cmdline).unwrap();
    let console = vm.take_console().unwrap();
    vm.start(false).unwrap();
    let before = ops_at_least(&console, 1, Duration::from_millis(600));

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
        let after = ops_at_least(&console, 3usize.saturating_sub(during.len()), Duration::from_millis(700));
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
    // After one iteration, on a slow link and with a 1 ms downtime limit,
    // so that these writers do not converge first: on a loaded host a
    // writer slowed down converged within the default 300 ms (the switch
    // never came); 1 ms at this link is 7 pages, fewer than any of them
    // dirties in an iteration however slowly it runs.
    for workload in ["sparse", "zero-clear", "stream"] {
        let options = MigrateOptions {
            postcopy: PostcopyMode::After(1),
            max_bandwidth: Some(30_000_000),
            downtime_limit: Duration::from_millis(1),
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
    // Every page the guest ever touched (pages never populated are zeros
    // at the destination already, and left out).
    let missing = stats.postcopy.unwrap().pages_missing;
    assert!((16 << 20 >> 12..=64 << 20 >> 12).contains(&missing), "{missing} pages missing");
}

#[test]
fn auto_hands_over_a_guest_that_outruns_the_link() {
    if !kvm_or_skip() {
        return;
    }
    // 4 MB/s: the guest's sparse writes dirty memory ten times faster, and
    // still more than twice as fast on a host so loaded that the guest gets
    // a fraction of a CPU (at 12 MB/s such a host once let pre-copy end).
    let options =
        MigrateOptions { postcopy: PostcopyMode::Auto, max_bandwidth: Some(4_000_000), ..MigrateOptions::default() };
    let stats = migrate_postcopy(64 << 20, "workload=sparse wss=32M rate=40", options);
    // Handed over during the first iteration, not after it.
    assert_eq!(stats.iterations, 1, "{:?}", stats.per_iteration);
    assert!(stats.per_iteration[0].pages_sent < 32 << 20 >> 12);
    // And says so, with what it measured.
    let choice = stats.choices.iter().find(|c| c.what == "post-copy").expect("a post-copy choice");
    assert!(choice.chose.starts_with("switched at"), "{choice:?}");
    assert!(choice.why.contains("the guest dirtied memory at"), "{choice:?}");
    let granularity = stats.choices.iter().find(|c| c.what == "granularity").expect("a granularity choice");
    assert!(granularity.why.starts_with("auto: "), "{granularity:?}");
}

/// Forwards connections from one Unix socket to another; `cut` breaks
/// every connection open now (both directions, at once), as a link that
/// goes down; later connections go through again.
struct Proxy {
    addr: Address,
    open: std::sync::Arc<std::sync::Mutex<Vec<std::os::unix::net::UnixStream>>>,
    cuts: std::sync::Arc<std::sync::atomic::AtomicU32>,
    /// Refuses new connections (a link that stays down).
    down: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// The listening thread runs on for good: the socket file goes with the proxy.
impl Drop for Proxy {
    fn drop(&mut self) {
        if let Address::Unix(path) = &self.addr {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl Proxy {
    fn start(to: std::path::PathBuf, name: &str) -> Proxy {
        use std::os::unix::net::{UnixListener, UnixStream};
        let path = std::env::temp_dir().join(format!("tsubame-proxy-{}-{name}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        let open = std::sync::Arc::new(std::sync::Mutex::new(Vec::<UnixStream>::new()));
        let cuts = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
        let registry = open.clone();
        let down = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let refuse = down.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                if refuse.load(std::sync::atomic::Ordering::Relaxed) {
                    continue;
                }
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
        Proxy { addr: Address::Unix(path), open, cuts, down }
    }

    fn cut(&self) {
        for s in self.open.lock().unwrap().drain(..) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        self.cuts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Boots a VM running `args`, lets it warm up.
fn boot(memory_bytes: u64, args: &str) -> (Vm, Receiver<ConsoleLine>) {
    let mut vm = Vm::create(&VmConfig { memory_bytes, hugepages: true }).unwrap();
    let cmdline = format!("{args} tsc_khz={}", vm.tsc_khz());
    vm.load_guest(guest_elf::GUEST_ELF, &cmdline).unwrap();
    let console = vm.take_console().unwrap();
    vm.start(false).unwrap();
    ops_until(&console, Duration::from_millis(300));
    (vm, console)
}

/// What the destination thread of [`Behind::start`] ends with: the phase's
/// outcome, the guest's progress afterwards, and the VM (kept alive).
type Arrived = (
    Result<tsubame_migrate::destination::PostcopyOutcome, tsubame_migrate::destination::ReceiveError>,
    Vec<u64>,
    tsubame_migrate::destination::Incoming,
);

/// A destination behind a proxy, receiving on a thread of its own.
struct Behind {
    proxy: std::sync::Arc<Proxy>,
    /// Set once the destination runs the VM.
    running: std::sync::Arc<std::sync::atomic::AtomicBool>,
    dest: std::thread::JoinHandle<Arrived>,
    /// The destination's listening socket.
    path: std::path::PathBuf,
}

impl Behind {
    /// Listens, and watches the guest for `watch` after the phase ends.
    fn start(name: &str, watch: Duration) -> Behind {
        let path = std::env::temp_dir().join(format!("tsubame-postcopy-cut-{}-{name}", std::process::id()));
        let listener = Listener::bind(&Address::Unix(path.clone())).unwrap();
        let proxy = std::sync::Arc::new(Proxy::start(path.clone(), name));
        let running = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let runs = running.clone();
        let dest = std::thread::spawn(move || {
            let log = |line: &str| {
                if line.contains("the VM runs here") {
                    runs.store(true, std::sync::atomic::Ordering::Release);
                }
            };
            let mut incoming = receive(&listener, &ReceiveOptions::default(), &log).unwrap_or_else(|e| panic!("{e}"));
            let console = incoming.vm.take_console().unwrap();
            let outcome = incoming.postcopy.take().expect("post-copy").wait();
            // After a failure the guest may run on in pages it holds; it
            // never sees a wrong one (ops_until fails on a guest error).
            let after = ops_until(&console, watch);
            (outcome, after, incoming)
        });
        Behind { proxy, running, dest, path }
    }

    /// What the destination ended with. Call once the source is done: a
    /// source cut off as the phase ended may reconnect until then, to hear
    /// the outcome again from the destination's listener, which lingers
    /// for it (and holds the socket file).
    fn join(dest: std::thread::JoinHandle<Arrived>, path: &std::path::Path) -> Arrived {
        let arrived = dest.join().unwrap();
        let _ = std::fs::remove_file(path);
        arrived
    }

    /// Waits until the destination runs the VM (15 s at most).
    fn wait_running(running: &std::sync::atomic::AtomicBool) {
        let deadline = Instant::now() + Duration::from_secs(15);
        while !running.load(std::sync::atomic::Ordering::Acquire) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Migrates a fresh VM with post-copy through a proxy and cuts the link
/// once per entry of `delays`, that long into the post-copy phase: both
/// ends wait, the source reconnects, and the migration completes verified
/// with the guest going on at the destination (and only there).
fn cut_during_postcopy(delays: &[Duration], name: &str) -> tsubame_migrate::MigrationStats {
    let (vm, _console) = boot(64 << 20, "workload=kv wss=24M");
    // Cuts come once the destination runs the VM: a cut in the instant
    // before (it lacks STATE or a channel's last pre-copy pages) loses the
    // VM, as in QEMU (docs/security.md).
    let Behind { proxy, running, dest, path } = Behind::start(name, Duration::from_millis(300));
    let options = MigrateOptions {
        postcopy: PostcopyMode::After(0),
        max_bandwidth: Some(40_000_000),
        postcopy_timeout: Duration::from_secs(10),
        ..MigrateOptions::default()
    };
    let progress = std::sync::Arc::new(ProgressCell::default());
    let cutter = {
        let (progress, proxy, delays) = (progress.clone(), proxy.clone(), delays.to_vec());
        std::thread::spawn(move || {
            use tsubame_migrate::protocol::SourceState;
            for delay in delays {
                // Each cut comes `delay` after the phase (re)started.
                let deadline = Instant::now() + Duration::from_secs(15);
                while progress.get().phase != SourceState::Postcopy && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(1));
                }
                Behind::wait_running(&running);
                std::thread::sleep(delay);
                if progress.get().phase == SourceState::Postcopy {
                    proxy.cut();
                }
            }
        })
    };
    let stats = source::migrate(&vm, &proxy.addr, &options, &progress);
    cutter.join().unwrap();
    let (outcome, after, _incoming) = Behind::join(dest, &path);
    // The reasons last: CI shows a failure's last lines.
    assert!(
        stats.status == Status::Completed,
        "{name}: {:?}\nsource: {:?}\ndestination: {outcome:?}",
        stats.status,
        stats.error
    );
    let outcome = outcome.unwrap();
    assert!(stats.digest_verified);
    assert!(vm.status().is_stopped(), "{name}: the source runs again");
    assert!(after.last() > after.first(), "{name}: the guest did not go on after the resume");
    // A cut as the phase ends (every page and the digest already through)
    // leaves nothing to resume.
    let cuts = proxy.cuts.load(std::sync::atomic::Ordering::Relaxed);
    assert!(stats.postcopy.as_ref().unwrap().resumes <= cuts, "{name}");
    eprintln!("{name}: cuts {delays:?} into post-copy ({cuts} made): {outcome:?}");
    stats
}

/// A link that stays down past `--postcopy-timeout` loses the VM: both
/// ends say so, the source never runs it again, and the destination's
/// guest waits on the pages it lacks instead of reading them as zeros.
#[test]
fn a_link_down_for_good_loses_the_vm_but_never_corrupts_it() {
    if !kvm_or_skip() {
        return;
    }
    let (vm, _console) = boot(64 << 20, "workload=kv wss=24M");
    let Behind { proxy, running, dest, path } = Behind::start("down", Duration::from_millis(500));
    let options = MigrateOptions {
        postcopy: PostcopyMode::After(0),
        max_bandwidth: Some(20_000_000),
        postcopy_timeout: Duration::from_secs(1),
        ..MigrateOptions::default()
    };
    let cutter = {
        let proxy = proxy.clone();
        std::thread::spawn(move || {
            Behind::wait_running(&running);
            std::thread::sleep(Duration::from_millis(100));
            proxy.down.store(true, std::sync::atomic::Ordering::Relaxed);
            proxy.cut();
        })
    };
    let stats = source::migrate(&vm, &proxy.addr, &options, &ProgressCell::default());
    cutter.join().unwrap();
    let (outcome, after, _incoming) = Behind::join(dest, &path);
    assert_eq!(stats.status, Status::Failed);
    let error = stats.error.clone().unwrap();
    assert!(error.contains("lost"), "{error}");
    assert!(vm.status().is_stopped(), "the source ran the VM again: two copies");
    let err = outcome.expect_err("the destination cannot finish without the source").to_string();
    assert!(err.contains("did not come back"), "{err}");
    eprintln!("source: {error}\ndestination: {err}\nguest progress lines after: {}", after.len());
}

/// A link cut while the destination drops stale pages (the guest still
/// runs at the source, POSTCOPY not sent yet) is a pre-copy failure: the
/// source VM keeps running and the destination never runs its half.
#[test]
fn a_cut_before_the_switch_keeps_the_vm_at_the_source() {
    if !kvm_or_skip() {
        return;
    }
    use std::io::{Read, Write};
    use std::os::unix::net::{UnixListener, UnixStream};
    use tsubame_migrate::protocol::{parse_header, FrameKind, FRAME_HEADER_LEN, PREAMBLE_LEN};
    let (vm, console) = boot(64 << 20, "workload=kv wss=24M");
    let dir = std::env::temp_dir().join(format!("tsubame-postcopy-prepare-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let listener = Listener::bind(&Address::Unix(dir.join("dest.sock"))).unwrap();
    let dest = std::thread::spawn(move || receive(&listener, &ReceiveOptions::default(), &|_| {}).map(drop));
    // Channel 0 goes through here: source → destination as is; destination
    // → source frame by frame, until POSTCOPY_PREPARED, which cuts both.
    let front = UnixListener::bind(dir.join("front.sock")).unwrap();
    let to = dir.join("dest.sock");
    std::thread::spawn(move || {
        for (n, client) in front.incoming().flatten().enumerate() {
            let server = UnixStream::connect(&to).unwrap();
            let (mut up_from, mut up_to) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            std::thread::spawn(move || drop(std::io::copy(&mut up_from, &mut up_to)));
            let (mut down_from, mut down_to) = (server, client);
            std::thread::spawn(move || {
                let mut preamble = [0u8; PREAMBLE_LEN];
                if down_from.read_exact(&mut preamble).is_err() || down_to.write_all(&preamble).is_err() {
                    return;
                }
                loop {
                    let mut header = [0u8; FRAME_HEADER_LEN];
                    if down_from.read_exact(&mut header).is_err() {
                        return;
                    }
                    let (kind, len) = parse_header(&header).unwrap();
                    if n == 0 && kind == FrameKind::PostcopyPrepared {
                        let _ = down_from.shutdown(std::net::Shutdown::Both);
                        let _ = down_to.shutdown(std::net::Shutdown::Both);
                        return;
                    }
                    let mut payload = vec![0u8; len];
                    if down_from.read_exact(&mut payload).is_err()
                        || down_to.write_all(&header).and_then(|_| down_to.write_all(&payload)).is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    let options = MigrateOptions {
        postcopy: PostcopyMode::After(1),
        max_bandwidth: Some(40_000_000),
        ..MigrateOptions::default()
    };
    let progress = ProgressCell::default();
    let stats = source::migrate(&vm, &Address::Unix(dir.join("front.sock")), &options, &progress);
    assert_eq!(stats.status, Status::Failed, "the cut came before POSTCOPY");
    let error = stats.error.clone().unwrap();
    assert!(error.contains("keeps running here"), "{error}");
    assert!(!vm.status().is_stopped(), "the source VM was left stopped");
    let went_on = ops_until(&console, Duration::from_millis(300));
    assert!(went_on.last() > went_on.first(), "the guest did not go on at the source");
    assert!(dest.join().unwrap().is_err(), "the destination took a VM it never got whole");
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!("cut at POSTCOPY_PREPARED: {error}");
}

#[test]
fn a_cut_link_pauses_post_copy_and_it_resumes() {
    if !kvm_or_skip() {
        return;
    }
    for (i, ms) in [5u64, 200].into_iter().enumerate() {
        let stats = cut_during_postcopy(&[Duration::from_millis(ms)], &format!("cut{i}"));
        assert_eq!(stats.postcopy.unwrap().resumes, 1, "a cut {ms} ms into the phase");
    }
}

/// xorshift64*: enough randomness for choosing cut points.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n
    }
}

/// The fault test of issue 18: the link cut at random points of the
/// post-copy phase (once or twice per migration), 50 times
/// (`TSUBAME_POSTCOPY_FAULT_TRIALS=N` for more, `TSUBAME_FAULT_SEED=S` to
/// repeat a run): every one resumes and completes verified, the guest
/// going on at the destination only.
#[test]
fn post_copy_survives_cuts_at_random_points() {
    if !kvm_or_skip() {
        return;
    }
    let trials: u32 = std::env::var("TSUBAME_POSTCOPY_FAULT_TRIALS").ok().and_then(|v| v.parse().ok()).unwrap_or(50);
    let seed = std::env::var("TSUBAME_FAULT_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1
    });
    eprintln!("post-copy cuts: {trials} trials, TSUBAME_FAULT_SEED={seed}");
    let mut rng = Rng(seed);
    let mut cut_total = 0;
    for trial in 0..trials {
        // The phase lasts about half a second here.
        let cuts = 1 + rng.below(2);
        let delays: Vec<Duration> = (0..cuts).map(|_| Duration::from_millis(rng.below(500))).collect();
        eprintln!("trial{trial}: cutting at {delays:?}");
        let stats = cut_during_postcopy(&delays, &format!("trial{trial}"));
        cut_total += stats.postcopy.unwrap().resumes;
    }
    eprintln!("post-copy cuts: {trials} trials, {cut_total} cuts, every one resumed and verified, 0 duplicated");
    assert!(cut_total >= trials / 2, "too few cuts landed inside the phase: {cut_total}");
}
