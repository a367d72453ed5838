//! `tsubame demo`: the whole job in one command. Starts a destination
//! process, boots a VM with a workload here, lets it warm up, migrates it
//! live over loopback, and shows the guest carrying on at the destination.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use serde_json::{json, Value};
use tsubame_migrate::{source, Address, ProgressCell};

use crate::console::{ConsoleFollower, Echo};
use crate::control::ControlClient;
use crate::far_args::far_error;
use crate::far_args::{BootedVm, FarArgs};
use crate::migrate_cmd::{print_summary, progress_bar, progress_message, write_json, MigrateFlags};
use crate::run::far_summary;
use crate::usage_error;
use crate::vm_args::VmArgs;

/// Options of `tsubame demo`.
#[derive(Args, Debug)]
pub struct DemoArgs {
    #[command(flatten)]
    pub vm: VmArgs,
    #[command(flatten)]
    pub flags: MigrateFlags,
    #[command(flatten)]
    pub far: FarArgs,
    /// Seconds the workload runs before the migration starts.
    #[arg(long, default_value_t = 2.0)]
    pub warmup: f64,
    /// Seconds to watch the guest at the destination afterwards.
    #[arg(long, default_value_t = 2.0)]
    pub after: f64,
    /// Loopback transport: unix or tcp.
    #[arg(long, default_value = "unix")]
    pub transport: String,
}

/// The destination child process; killed if still there on drop.
struct Destination {
    child: Child,
    control: std::path::PathBuf,
    log: std::path::PathBuf,
}

impl Destination {
    fn log_tail(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default().lines().last().unwrap_or("").to_string()
    }

    fn client(&self) -> anyhow::Result<ControlClient> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match ControlClient::connect(&self.control) {
                Ok(c) => return Ok(c),
                Err(e) if Instant::now() > deadline => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

impl Drop for Destination {
    fn drop(&mut self) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        if let Ok(mut c) = ControlClient::connect(&self.control) {
            let _ = c.request(&json!({"cmd": "quit"}));
        }
        for _ in 0..50 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn ops_of(stats: &Value) -> u64 {
    stats["guest"]["ops"].as_u64().unwrap_or(0)
}

/// The demo's directory, removed however the demo ends (it was left
/// behind by every demo that failed).
struct ScratchDir(std::path::PathBuf);

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `tsubame demo`.
pub fn demo(args: DemoArgs) -> anyhow::Result<()> {
    let options = args.flags.options()?;
    if !(args.warmup >= 0.0 && args.after > 0.0 && args.warmup.is_finite() && args.after.is_finite()) {
        return Err(usage_error("--warmup must be >= 0 and --after > 0 seconds"));
    }
    // Dropped last, after the destination: it holds the sockets and the
    // destination's log, whose last lines go into any error returned.
    let scratch = ScratchDir(std::env::temp_dir().join(format!("tsubame-demo-{}", std::process::id())));
    let dir = &scratch.0;
    std::fs::create_dir_all(dir)?;
    let to: Address = match args.transport.as_str() {
        "unix" => Address::Unix(dir.join("migration.sock")),
        "tcp" => {
            // Ask the kernel for a free port, then hand it to the child.
            let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
            Address::Tcp(format!("127.0.0.1:{port}"))
        }
        other => return Err(usage_error(format!("--transport '{other}': use unix or tcp"))),
    };

    let memory = args.vm.memory_bytes()?;
    // `_memory_host` lives until the demo ends: with `auto` it is ours.
    let BootedVm { mut vm, far: far_setup, memory_host: _memory_host } = args.far.boot(&args.vm)?;
    let log = dir.join("destination.log");
    let child = Command::new(std::env::current_exe()?)
        .args(["receive", "--once", "--quiet", "--listen", &to.to_string()])
        .arg("--control")
        .arg(dir.join("destination.sock"))
        .arg("--memory")
        .arg(memory.to_string())
        .args(args.flags.psk_file.iter().flat_map(|p| [std::ffi::OsStr::new("--psk-file"), p.as_os_str()]))
        .args(args.flags.tls.args())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .spawn()
        .map_err(|e| anyhow::anyhow!("cannot start the destination process: {e}"))?;
    let destination = Destination { child, control: dir.join("destination.sock"), log };

    let console = ConsoleFollower::start(vm.take_console().expect("fresh VM has a console"), Echo::Quiet);
    vm.start(false)?;
    let vm = Arc::new(vm);
    let far = match far_setup {
        Some(setup) => Some(Arc::new(setup.start(vm.clone()).map_err(far_error)?)),
        None => None,
    };
    eprintln!(
        "tsubame demo: {} VM running '{}' here; destination is process {} on {to}",
        crate::units::format_bytes(memory),
        args.vm.workload,
        destination.child.id()
    );
    let bar = progress_bar();
    bar.set_message("warming up");
    std::thread::sleep(Duration::from_secs_f64(args.warmup));
    let before = console.snapshot();
    if let Some(error) = &before.error {
        anyhow::bail!("the guest failed before migration: {error}");
    }

    let far_before = far.as_ref().map(|f| f.stats());
    let progress = Arc::new(ProgressCell::default());
    let engine = {
        let (vm, to, progress, options, far) = (vm.clone(), to.clone(), progress.clone(), options.clone(), far.clone());
        std::thread::spawn(move || match far {
            Some(far) => source::migrate_far(&vm, &far, &to, &options, &progress),
            None => source::migrate(&*vm, &to, &options, &progress),
        })
    };
    while !engine.is_finished() {
        bar.set_message(progress_message(&progress.get()));
        std::thread::sleep(Duration::from_millis(100));
    }
    let stats = engine.join().expect("migration thread");
    let at_switch = console.snapshot();
    bar.finish_and_clear();
    let mut json_stats = serde_json::to_value(&stats)?;

    if stats.status != tsubame_migrate::stats::Status::Completed {
        print_summary(&stats);
        write_json(&args.flags.json, &json_stats)?;
        let tail = destination.log_tail();
        anyhow::bail!(
            "migration failed: {}{}",
            stats.error.as_deref().unwrap_or("unknown error"),
            if tail.is_empty() { String::new() } else { format!(" (destination: {tail})") }
        );
    }

    // The guest must go on at the destination from where it stopped here.
    let mut client = destination.client()?;
    let mut first = client.request(&json!({"cmd": "stats"}))?;
    let deadline = Instant::now() + Duration::from_secs(2);
    while first["guest"]["lines"].as_u64().unwrap_or(0) == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        first = client.request(&json!({"cmd": "stats"}))?;
    }
    std::thread::sleep(Duration::from_secs_f64(args.after));
    let later = client.request(&json!({"cmd": "stats"}))?;
    let dest_rate = later["guest"]["ops_per_sec"].as_f64().unwrap_or(0.0);
    let continued = ops_of(&later) > ops_of(&first) && ops_of(&first) >= at_switch.ops;
    json_stats["demo"] = json!({
        "workload": args.vm.workload,
        "source_ops_per_sec": before.ops_per_sec,
        "destination_ops_per_sec": dest_rate,
        "ops_at_switch": at_switch.ops,
        "ops_at_destination": ops_of(&later),
        "guest_continued": continued,
        "far_memory": far_before.as_ref().map(|source| json!({"source": source, "destination": later["far_memory"]})),
    });
    let _ = client.request(&json!({"cmd": "quit"}));
    drop(destination);

    print_summary(&stats);
    println!(
        "  guest:       {:.0} ops/s before, {:.0} ops/s at the destination; ops {} at switch-over, {} now",
        before.ops_per_sec,
        dest_rate,
        at_switch.ops,
        ops_of(&later)
    );
    if let Some(source) = &far_before {
        println!("  far memory:  here before: {}", far_summary(source));
        if let Ok(destination) = serde_json::from_value(later["far_memory"].clone()) {
            println!("               destination: {}", far_summary(&destination));
        }
    }
    write_json(&args.flags.json, &json_stats)?;
    if !continued {
        anyhow::bail!("the guest did not continue at the destination");
    }
    Ok(())
}
