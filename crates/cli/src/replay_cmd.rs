//! `tsubame replay`: migrate a recorded dirty trace replaying into plain
//! memory — the real engine without KVM (a GPU machine with no /dev/kvm,
//! say). The destination is `tsubame receive --memory-only`.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use serde_json::json;
use tsubame_migrate::replay::TraceReplay;
use tsubame_migrate::{source, Address, ProgressCell};
use tsubame_trace::format::Trace;

use crate::migrate_cmd::{print_summary, progress_bar, progress_message, write_json, MigrateFlags};
use crate::usage_error;

/// Options of `tsubame replay`.
#[derive(Args, Debug)]
pub struct ReplayArgs {
    /// The dirty trace to replay (`tsubame trace --out FILE`).
    #[arg(long)]
    pub trace: PathBuf,
    /// Destination (`tsubame receive --memory-only`); default: start one
    /// here over loopback.
    #[arg(long)]
    pub to: Option<String>,
    /// Replay speed: 2 dirties twice as fast as recorded.
    #[arg(long, default_value_t = 1.0)]
    pub speed: f64,
    /// Seconds the replay runs before the migration starts.
    #[arg(long, default_value_t = 1.0)]
    pub warmup: f64,
    /// Loopback transport when starting the destination here: unix or tcp.
    #[arg(long, default_value = "unix")]
    pub transport: String,
    #[command(flatten)]
    pub flags: MigrateFlags,
}

/// Runs `tsubame replay`.
pub fn replay(args: ReplayArgs) -> anyhow::Result<()> {
    let options = args.flags.options()?;
    if !(args.speed > 0.0 && args.speed.is_finite() && args.warmup >= 0.0 && args.warmup.is_finite()) {
        return Err(usage_error("--speed must be > 0 and --warmup >= 0"));
    }
    let trace = Trace::open(&args.trace).map_err(|e| anyhow::anyhow!("{}: {e}", args.trace.display()))?;
    let workload = trace.setup.workload.clone();
    let dir = std::env::temp_dir().join(format!("tsubame-replay-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let (to, mut child) = match &args.to {
        Some(text) => {
            (text.parse().map_err(|e: tsubame_migrate::transport::TransportError| usage_error(e.to_string()))?, None)
        }
        None => {
            let to = match args.transport.as_str() {
                "unix" => Address::Unix(dir.join("migration.sock")),
                "tcp" => {
                    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
                    Address::Tcp(format!("127.0.0.1:{port}"))
                }
                other => return Err(usage_error(format!("--transport '{other}': use unix or tcp"))),
            };
            let child = Command::new(std::env::current_exe()?)
                .args(["receive", "--memory-only", "--once", "--listen", &to.to_string()])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(dir.join("destination.log"))?)
                .spawn()
                .map_err(|e| anyhow::anyhow!("cannot start the destination process: {e}"))?;
            (to, Some(child))
        }
    };
    let replay = Arc::new(TraceReplay::start(trace, args.speed)?);
    eprintln!(
        "tsubame replay: {} of memory replaying '{workload}' at {}× speed; destination {to}",
        crate::units::format_bytes(tsubame_migrate::source::SourceVm::memory_bytes(&*replay)),
        args.speed
    );
    let bar = progress_bar();
    bar.set_message("warming up");
    std::thread::sleep(Duration::from_secs_f64(args.warmup));
    let before = replay.progress();
    let progress = Arc::new(ProgressCell::default());
    let engine = {
        let (replay, to, progress, options) = (replay.clone(), to.clone(), progress.clone(), options.clone());
        std::thread::spawn(move || source::migrate(&*replay, &to, &options, &progress))
    };
    while !engine.is_finished() {
        bar.set_message(progress_message(&progress.get()));
        std::thread::sleep(Duration::from_millis(100));
    }
    let stats = engine.join().expect("migration thread");
    bar.finish_and_clear();
    let after = replay.progress();
    let mut json_stats = serde_json::to_value(&stats)?;
    json_stats["replay"] = json!({
        "trace": args.trace.display().to_string(),
        "workload": workload,
        "speed": args.speed,
        "intervals_before": before.intervals,
        "intervals_during": after.intervals - before.intervals,
        "page_writes_during": after.page_writes - before.page_writes,
    });
    print_summary(&stats);
    println!(
        "  replay:      {} trace intervals ({} page writes) replayed during the migration",
        after.intervals - before.intervals,
        after.page_writes - before.page_writes
    );
    write_json(&args.flags.json, &json_stats)?;
    let destination_ok = match child.as_mut() {
        Some(c) => c.wait()?.success(),
        None => true,
    };
    let log = std::fs::read_to_string(dir.join("destination.log")).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    if stats.status != tsubame_migrate::stats::Status::Completed {
        anyhow::bail!("migration failed: {}", stats.error.as_deref().unwrap_or("unknown error"));
    }
    if !destination_ok {
        anyhow::bail!("the destination failed: {}", log.lines().last().unwrap_or("no message"));
    }
    Ok(())
}
