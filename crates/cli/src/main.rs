//! `tsubame`: live migration of KVM virtual machines.

mod console;
mod control;
mod demo;
mod disk_cmd;
mod far_args;
mod migrate_cmd;
mod plot;
mod receive;
mod replay_cmd;
mod request;
mod run;
mod running_vm;
mod trace_cmd;
mod units;
mod vm_args;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tsubame_vmm::VmError;

/// Live migration of KVM virtual machines.
///
/// tsubame boots a small test VM on KVM and moves it, running, to another
/// tsubame process. See `tsubame demo --help` for the one-command tour.
#[derive(Parser, Debug)]
#[command(name = "tsubame", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Boot a VM with a workload and run it.
    Run(run::RunArgs),
    /// Wait for an incoming VM and run it.
    Receive(receive::ReceiveArgs),
    /// Live-migrate the VM behind a control socket to a destination.
    #[command(after_help = migrate_cmd::EXIT_STATUS)]
    Migrate(migrate_cmd::MigrateArgs),
    /// The whole job in one command: boot a VM with a workload, migrate it
    /// live to a second tsubame process over loopback, show the result.
    Demo(demo::DemoArgs),
    /// Record what a running VM dirties, interval by interval, to a file.
    Trace(trace_cmd::TraceArgs),
    /// Replay a trace as a pseudo-migration over a link of given bandwidth.
    Simulate(trace_cmd::SimulateArgs),
    /// Fit the dirty-page model to a trace and predict migrations.
    Plan(trace_cmd::PlanArgs),
    /// Migrate a trace replaying into plain memory: the real engine without
    /// KVM (the destination runs `receive --memory-only`).
    Replay(replay_cmd::ReplayArgs),
    /// Create a raw disk image for --disk.
    DiskCreate(disk_cmd::DiskCreateArgs),
    /// Check a disk the disk-mixed workload wrote: every acknowledged write
    /// there once and intact.
    DiskCheck(disk_cmd::DiskCheckArgs),
    /// Write the embedded guest ELF to FILE (to boot it under QEMU).
    GuestElf {
        /// Where to write the multiboot ELF.
        file: PathBuf,
    },
}

/// An error in what the user asked for: exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(String);

/// Wraps a message as a usage error.
pub fn usage_error(message: impl Into<String>) -> anyhow::Error {
    UsageError(message.into()).into()
}

/// The outcome of what was asked is not known (the other process went
/// away before it said): exit code 3.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct OutcomeUnknown(String);

/// Wraps a message as an unknown outcome.
pub fn outcome_unknown(message: impl Into<String>) -> anyhow::Error {
    OutcomeUnknown(message.into()).into()
}

/// VM errors that come from the user's input or host setup are usage errors.
pub fn vm_error(e: VmError) -> anyhow::Error {
    use tsubame_vmm::memory::MemoryError;
    match e {
        VmError::Kvm(_) | VmError::Boot(_) | VmError::Memory(MemoryError::BadSize(_)) => usage_error(e.to_string()),
        other => other.into(),
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => {
            // --help and --version
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            // clap's message is several paragraphs; keep the first (with
            // its indented list, e.g. the missing arguments) on one line,
            // point at --help.
            let rendered = e.render().to_string();
            let first: Vec<&str> = rendered.lines().map(str::trim).take_while(|l| !l.is_empty()).collect();
            let first = first.join(" ");
            let first = first.strip_prefix("error: ").unwrap_or(&first);
            let first = if first.is_empty() { "bad usage" } else { first };
            eprintln!("tsubame: error: {first} (see tsubame --help)");
            return ExitCode::from(2);
        }
    };
    let result = match cli.command {
        Command::Run(args) => run::run(args),
        Command::Receive(args) => receive::receive(args),
        Command::Replay(args) => replay_cmd::replay(args),
        Command::Migrate(args) => migrate_cmd::migrate(args),
        Command::Demo(args) => demo::demo(args),
        Command::Trace(args) => trace_cmd::trace(args),
        Command::Simulate(args) => trace_cmd::simulate_cmd(args),
        Command::Plan(args) => trace_cmd::plan(args),
        Command::DiskCreate(args) => disk_cmd::create(args),
        Command::DiskCheck(args) => disk_cmd::check(args),
        Command::GuestElf { file } => std::fs::write(&file, tsubame_vmm::guest_elf::GUEST_ELF)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", file.display())),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tsubame: error: {e:#}");
            if e.is::<UsageError>() {
                ExitCode::from(2)
            } else if e.is::<OutcomeUnknown>() {
                ExitCode::from(3)
            } else {
                ExitCode::from(1)
            }
        }
    }
}
