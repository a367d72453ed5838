//! `tsubame receive`: wait for incoming VMs and run the one that arrives.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Args;
use serde_json::{json, Value};
use tsubame_migrate::destination::{receive_into, receive_on, MemoryLanding, ReceiveOptions};
use tsubame_migrate::transport::Listener;
use tsubame_migrate::Address;

use crate::console::{ConsoleFollower, Echo};
use crate::control::{ControlHandler, ControlServer, VmState};
use crate::running_vm::{RunningVm, VmEnd};
use crate::units::parse_size;
use crate::usage_error;

/// Options of `tsubame receive`.
#[derive(Args, Debug)]
pub struct ReceiveArgs {
    /// Where to listen: tcp:HOST:PORT or unix:PATH.
    #[arg(long)]
    pub listen: String,
    /// Serve the control socket (JSON lines: tsubame's `{"cmd":...}` form
    /// or QMP) at this path.
    #[arg(long)]
    pub control: Option<PathBuf>,
    /// Exit after one incoming migration, failed or not (default: a failed
    /// one is discarded and the next is awaited).
    #[arg(long)]
    pub once: bool,
    /// Accept only a VM with this much memory.
    #[arg(long)]
    pub memory: Option<String>,
    /// Give up on a source that sends nothing for this many seconds.
    #[arg(long, visible_alias = "io-timeout", default_value_t = 30)]
    pub timeout: u64,
    /// Accept only sources that hold the pre-shared key in FILE; every
    /// channel is authenticated and encrypted (docs/security.md).
    #[arg(long, value_name = "FILE")]
    pub psk_file: Option<PathBuf>,
    #[command(flatten)]
    pub tls: crate::migrate_cmd::TlsFlags,
    /// Accept unencrypted TCP from sources that are not on this host.
    #[arg(long)]
    pub insecure: bool,
    /// Back guest memory with 4 KiB pages only.
    #[arg(long)]
    pub no_hugepages: bool,
    /// Prefix the guest's lines with host time (ms since the VM arrived).
    #[arg(long, short)]
    pub verbose: bool,
    /// Do not print the guest's lines.
    #[arg(long, short)]
    pub quiet: bool,
    /// Receive memory only, into plain memory with no VM (the source is a
    /// `tsubame replay`): verify it, report, and exit. Needs no /dev/kvm.
    #[arg(long)]
    pub memory_only: bool,
}

/// Control requests before and after the VM arrives.
struct ReceiveControl {
    host: Mutex<Option<Arc<RunningVm>>>,
    quit: AtomicBool,
    phase: Mutex<String>,
}

impl ControlHandler for ReceiveControl {
    fn handle(&self, cmd: &str, request: &Value) -> Result<Value, String> {
        if let Some(host) = self.host.lock().unwrap().clone() {
            return host.handle(cmd, request);
        }
        match cmd {
            "stats" => Ok(json!({"status": "waiting", "phase": self.phase.lock().unwrap().clone()})),
            "query-status" => Ok(json!({"running": false, "status": "inmigrate"})),
            "quit" => {
                self.quit.store(true, Ordering::Release);
                Ok(json!({}))
            }
            other => Err(format!("no VM here yet; '{other}' needs one (known now: stats, query-status, quit)")),
        }
    }

    fn state(&self) -> Option<VmState> {
        self.host.lock().unwrap().as_ref().and_then(|host| host.state())
    }
}

/// Runs `tsubame receive`.
pub fn receive(args: ReceiveArgs) -> anyhow::Result<()> {
    let addr: Address =
        args.listen.parse().map_err(|e: tsubame_migrate::transport::TransportError| usage_error(e.to_string()))?;
    let expect_memory = match &args.memory {
        Some(m) => Some(parse_size(m).map_err(|e| usage_error(format!("--memory: {e}")))?),
        None => None,
    };
    if args.timeout == 0 {
        return Err(usage_error("--timeout must be at least 1 second"));
    }
    let security = crate::migrate_cmd::security(args.psk_file.as_deref(), &args.tls, args.insecure)?;
    let options = ReceiveOptions {
        expect_memory,
        io_timeout: Duration::from_secs(args.timeout),
        hugepages: !args.no_hugepages,
        security,
        ..ReceiveOptions::default()
    };
    let listener = Listener::bind(&addr)?;
    if args.memory_only {
        return receive_memory_only(&listener, &options);
    }
    let control = Arc::new(ReceiveControl {
        host: Mutex::new(None),
        quit: AtomicBool::new(false),
        phase: Mutex::new("listening".into()),
    });
    let server = match &args.control {
        Some(path) => Some(ControlServer::start(path, control.clone() as Arc<dyn ControlHandler>)?),
        None => None,
    };
    eprintln!("tsubame: waiting for a VM on {}", listener.local_address());
    let log = |m: &str| {
        *control.phase.lock().unwrap() = m.to_string();
        eprintln!("tsubame: {m}");
    };
    let incoming = loop {
        let Some(stream) = listener.accept_until(&|| control.quit.load(Ordering::Acquire))? else {
            return Ok(()); // quit before a VM arrived
        };
        let stream = match options.security.accepted(stream) {
            Ok(stream) => stream,
            Err(e) if args.once => return Err(anyhow::anyhow!("incoming migration refused: {e}")),
            Err(e) => {
                eprintln!("tsubame: incoming migration refused: {e}; waiting for the next one");
                continue;
            }
        };
        match receive_on(stream, Some(&listener), &options, &log) {
            Ok(incoming) => break incoming,
            Err(e) if args.once => return Err(anyhow::anyhow!("incoming migration failed: {e}")),
            Err(e) => eprintln!("tsubame: incoming migration failed: {e}; waiting for the next one"),
        }
    };
    eprintln!(
        "tsubame: VM received: {} iterations, {} bytes in {:.1} ms, {:.2} CPU-seconds",
        incoming.iterations,
        incoming.bytes,
        incoming.duration.as_secs_f64() * 1e3,
        incoming.cpu_seconds
    );
    let mut vm = incoming.vm;
    let echo = Echo::from_flags(args.quiet, args.verbose);
    let console = ConsoleFollower::start(vm.take_console().expect("received VM has a console"), echo);
    let host = RunningVm::new(Arc::new(vm), console, "received by migration".into());
    *control.host.lock().unwrap() = Some(host.clone());
    match (incoming.postcopy, incoming.far) {
        (Some(postcopy), far) => follow_postcopy(postcopy, host.clone(), far),
        (None, Some(far)) => start_far_memory(&host, far)?,
        (None, None) => {}
    }
    let end = host.wait(None);
    if let Some(server) = &server {
        server.drain(host.migrated_away());
    }
    let end = end?;
    let progress = host.console.snapshot();
    eprintln!(
        "tsubame: {} — guest at ops={} ({:.0} ops/s here)",
        match end {
            VmEnd::Migrated(stats) => format!("migrated on to {}", stats.destination),
            VmEnd::GuestHalted => "guest halted".into(),
            _ => "quit".into(),
        },
        progress.ops,
        progress.mean_ops_per_sec
    );
    if let Some(far) = host.far_stats() {
        eprintln!("tsubame: {}", crate::run::far_summary(&far));
        if let Some(error) = far.error {
            anyhow::bail!("{error}");
        }
    }
    Ok(())
}

/// Post-copy: the VM runs while its memory arrives. Waits for the rest on
/// a thread of its own; if it cannot come, the VM cannot go on — this
/// process says so and ends, and the VM with it (the source never runs
/// its stale copy again).
fn follow_postcopy(
    postcopy: tsubame_migrate::destination::PostcopyHandle,
    host: Arc<RunningVm>,
    far: Option<tsubame_farmem::FarSetup>,
) {
    host.set_arriving(true);
    let page_faults = postcopy.page_faults();
    let ops = host.clone();
    postcopy.watch_guest(Box::new(move || ops.console.snapshot().ops));
    let _ = std::thread::Builder::new().name("postcopy-wait".into()).spawn(move || match postcopy.wait() {
        Ok(outcome) => {
            host.set_arriving(false);
            eprintln!(
                "tsubame: post-copy done: every page here after {:.1} s; {} faults served (p50 {} µs, p99 {} µs, max {} µs)",
                outcome.duration.as_secs_f64(),
                outcome.faults.faults,
                outcome.faults.latency_p50_us,
                outcome.faults.latency_p99_us,
                outcome.faults.latency_max_us
            );
            if let Some(mut far) = far {
                // Post-copy's fault thread is done: far memory serves the
                // far pages (and keeps residency under the limit) from now on.
                far.adopt(page_faults);
                if let Err(e) = start_far_memory(&host, far) {
                    eprintln!("tsubame: error: {e}");
                    std::process::exit(1);
                }
            }
        }
        Err(e) => {
            eprintln!("tsubame: error: {e}: the VM is lost — it ran here without all its memory, and the source's copy is stale");
            std::process::exit(1);
        }
    });
}

/// Starts the arrived VM's far memory: the memory hosts are ours now.
fn start_far_memory(host: &Arc<RunningVm>, far: tsubame_farmem::FarSetup) -> anyhow::Result<()> {
    let far = far
        .start(host.vm.clone())
        .map_err(|e| anyhow::anyhow!("far memory: {e}: the VM cannot run without its far pages"))?;
    host.set_far(far);
    crate::run::watch_far_memory(host);
    Ok(())
}

/// `receive --memory-only`: one migration into plain memory.
fn receive_memory_only(listener: &Listener, options: &ReceiveOptions) -> anyhow::Result<()> {
    eprintln!("tsubame: waiting for memory on {}", listener.local_address());
    let stream = options
        .security
        .accepted(listener.accept()?)
        .map_err(|e| anyhow::anyhow!("incoming migration refused: {e}"))?;
    let mut landing = MemoryLanding { max_bytes: tsubame_vmm::memory::MAX_MEMORY, memory: None, started: false };
    let log = |m: &str| eprintln!("tsubame: {m}");
    let mut received = receive_into(stream, Some(listener), options, &log, &mut landing)
        .map_err(|e| anyhow::anyhow!("incoming migration failed: {e}"))?;
    if let Some(postcopy) = received.postcopy.take() {
        // The source switched to post-copy: the memory is ours only once
        // every page has come, so stay until then (no guest faults here,
        // the source pushes them all).
        let outcome = postcopy.wait().map_err(|e| anyhow::anyhow!("post-copy failed: {e}"))?;
        eprintln!(
            "tsubame: post-copy done: every page here after {:.1} s ({} asked for)",
            outcome.duration.as_secs_f64(),
            outcome.requested
        );
    }
    eprintln!(
        "tsubame: memory received and verified: {} iterations, {} bytes in {:.1} ms, {:.2} CPU-seconds",
        received.iterations,
        received.bytes,
        received.duration.as_secs_f64() * 1e3,
        received.cpu_seconds
    );
    Ok(())
}
