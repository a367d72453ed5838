//! `tsubame run`: boot a VM with a workload and let it run.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;

use crate::console::{ConsoleFollower, Echo};
use crate::control::{ControlHandler, ControlServer};
use crate::far_args::{far_error, BootedVm, FarArgs};
use crate::running_vm::{RunningVm, VmEnd};
use crate::units::format_bytes;
use crate::usage_error;
use crate::vm_args::VmArgs;

/// Options of `tsubame run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub vm: VmArgs,
    /// Stop after this many seconds (default: run until `quit` or Ctrl-C).
    #[arg(long)]
    pub seconds: Option<f64>,
    /// Serve the control socket (JSON lines: tsubame's `{"cmd":...}` form
    /// or QMP) at this path.
    #[arg(long)]
    pub control: Option<PathBuf>,
    /// Prefix each guest line with the host time it arrived (ms since boot).
    #[arg(long, short)]
    pub verbose: bool,
    /// Do not print the guest's lines.
    #[arg(long, short)]
    pub quiet: bool,
    #[command(flatten)]
    pub far: FarArgs,
}

/// Boots, runs until the end condition, prints the throughput.
pub fn run(args: RunArgs) -> anyhow::Result<()> {
    if args.seconds.is_some_and(|s| !(s > 0.0 && s.is_finite())) {
        return Err(usage_error("--seconds must be a positive number"));
    }
    // `_memory_host` lives as long as the VM: with `auto` it is ours.
    let BootedVm { mut vm, far, memory_host: _memory_host } = args.far.boot(&args.vm)?;
    let echo = Echo::from_flags(args.quiet, args.verbose);
    let console = ConsoleFollower::start(vm.take_console().expect("fresh VM has a console"), echo);
    vm.start(false)?;
    let vm = Arc::new(vm);
    let host = RunningVm::new(vm.clone(), console, args.vm.description());
    if let Some(far) = far {
        host.set_far(far.start(vm).map_err(far_error)?);
        watch_far_memory(&host);
    }
    let server = match &args.control {
        Some(path) => Some(ControlServer::start(path, host.clone() as Arc<dyn ControlHandler>)?),
        None => None,
    };
    let end = host.wait(args.seconds.map(Duration::from_secs_f64));
    if let Some(server) = &server {
        // The last replies and events go out before the process ends.
        server.drain(host.migrated_away());
    }
    let end = end?;
    let progress = host.console.snapshot();
    let elapsed = host.started.elapsed().as_secs_f64();
    let how = match &end {
        VmEnd::TimeUp => "stopped".to_string(),
        VmEnd::Quit => "quit".to_string(),
        VmEnd::GuestHalted => "guest halted".to_string(),
        VmEnd::Migrated(stats) => format!("migrated to {}", stats.destination),
    };
    eprintln!(
        "tsubame: {how} after {elapsed:.1} s: workload {} on {} — {} ops, {:.0} ops/s here",
        args.vm.workload,
        format_bytes(host.vm.memory_bytes()),
        progress.ops,
        progress.mean_ops_per_sec,
    );
    if let Some(disk) = host.vm.disk_stats() {
        eprintln!("tsubame: {}", crate::disk_cmd::disk_summary(&disk));
    }
    if let Some(far) = host.far_stats() {
        eprintln!("tsubame: {}", far_summary(&far));
        if let Some(error) = far.error {
            anyhow::bail!("{error}");
        }
    }
    if progress.lines == 0 && !matches!(end, VmEnd::Migrated(_)) {
        anyhow::bail!("the guest printed no progress");
    }
    Ok(())
}

/// Says once, on stderr, when far memory is lost and the VM paused.
pub fn watch_far_memory(host: &Arc<RunningVm>) {
    let host = Arc::downgrade(host);
    let _ = std::thread::Builder::new().name("far-watch".into()).spawn(move || {
        let mut told = Vec::new();
        while let Some(host) = host.upgrade() {
            let Some(stats) = host.far_stats() else { return };
            drop(host);
            for store in stats.stores.iter().filter(|s| !s.ok) {
                if !told.contains(&store.uri) {
                    eprintln!(
                        "tsubame: far memory {} failed ({}); {}",
                        store.uri,
                        store.error.as_deref().unwrap_or("unknown"),
                        if stats.error.is_none() { "its mirror serves on" } else { "no mirror left" }
                    );
                    told.push(store.uri.clone());
                }
            }
            if let Some(error) = &stats.error {
                eprintln!("tsubame: error: {error}");
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
}

/// One line of far memory's counters.
pub fn far_summary(far: &tsubame_farmem::FarStats) -> String {
    let mib = |pages: u64| pages as f64 * 4096.0 / (1u64 << 20) as f64;
    format!(
        "far memory: {:.0} MiB resident of {} (most {:.0} MiB), {:.0} MiB far; {} faults ({} zero-filled), \
         p50 {} µs, p99 {} µs; read-ahead {} pages, {} used; {} pages evicted ({} without a write) \
         in {} stops ({:.1} ms); {} read, {} written; {}",
        mib(far.resident_pages),
        format_bytes(far.local_limit_bytes),
        mib(far.resident_max_pages),
        mib(far.far_pages),
        far.faults,
        far.zero_fills,
        far.fault_latency_p50_us,
        far.fault_latency_p99_us,
        far.readahead_pages,
        far.readahead_hits,
        far.evicted_pages,
        far.clean_drops,
        far.evictions,
        far.eviction_pause_ms,
        format_bytes(far.bytes_read),
        format_bytes(far.bytes_written),
        far.stores
            .iter()
            .map(|s| format!("{} {}", s.uri, if s.ok { "ok" } else { "failed" }))
            .collect::<Vec<_>>()
            .join(", "),
    )
}
