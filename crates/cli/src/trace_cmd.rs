//! `tsubame trace`, `simulate` and `plan`: record a VM's dirtying, replay
//! it as a pseudo-migration, and predict migrations from a fitted model.

use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Duration;

use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::json;
use tsubame_trace::clock::{ClockBasis, GuestClock};
use tsubame_trace::plan::{fit, measure_dirty_curve, predict};
use tsubame_trace::simulate::{
    replays_with_spread, simulate_with_spread_reporting, Method, SimOptions, Spread, GUEST_SPEED_WANDER,
};
use tsubame_trace::Trace;

use crate::control::ControlClient;
use crate::units::{format_bytes, parse_duration, parse_rate};
use crate::usage_error;

/// Options of `tsubame trace`.
#[derive(Args, Debug)]
pub struct TraceArgs {
    /// Control socket of the running VM (`tsubame run --control PATH`).
    #[arg(long)]
    pub control: PathBuf,
    /// Trace file to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Time between dirty-log reads, e.g. 10ms.
    #[arg(long, default_value = "10ms")]
    pub interval: String,
    /// How long to record, in seconds.
    #[arg(long, default_value_t = 10.0)]
    pub seconds: f64,
    /// Sub-page size of the recorded change masks (64 to 4096).
    #[arg(long, default_value_t = 128)]
    pub granularity: u32,
    /// How long to time the guest's undisturbed speed first, e.g. 3s: the
    /// replay's clock rests on it, and the speed wanders from second to
    /// second.
    #[arg(long, default_value = "3s")]
    pub baseline: String,
}

/// Runs `tsubame trace`.
pub fn trace(args: TraceArgs) -> anyhow::Result<()> {
    let interval = parse_duration(&args.interval).map_err(|e| usage_error(format!("--interval: {e}")))?;
    if !(args.seconds > 0.0 && args.seconds <= 3600.0) {
        return Err(usage_error("--seconds must be between 0 and 3600"));
    }
    tsubame_migrate::subpage::check_granularity(args.granularity)
        .map_err(|e| usage_error(format!("--granularity: {e}")))?;
    let baseline = parse_duration(&args.baseline).map_err(|e| usage_error(format!("--baseline: {e}")))?;
    if !(Duration::from_millis(200)..=Duration::from_secs(60)).contains(&baseline) {
        return Err(usage_error("--baseline must be between 200ms and 60s"));
    }
    let out = std::path::absolute(&args.out)?;
    let mut client = ControlClient::connect(&args.control)?;
    client.set_timeout(Duration::from_secs_f64(args.seconds + 2.0 * baseline.as_secs_f64() + 60.0))?;
    eprintln!(
        "tsubame: timing the guest for {:.1} s, then recording {} s of dirtying into {}",
        baseline.as_secs_f64(),
        args.seconds,
        out.display()
    );
    let reply = client.request(&json!({
        "cmd": "trace",
        "out": out,
        "interval_ms": interval.as_secs_f64() * 1e3,
        "seconds": args.seconds,
        "granularity": args.granularity,
        "baseline_s": baseline.as_secs_f64(),
    }))?;
    println!(
        "trace written to {}: {} intervals, {} page changes, {} pages non-zero at the start, longest tick {:.1} ms",
        out.display(),
        reply["intervals"],
        reply["changes"],
        reply["nonzero_pages"],
        reply["longest_tick_ms"].as_f64().unwrap_or(0.0)
    );
    Ok(())
}

fn open_trace(path: &std::path::Path) -> anyhow::Result<Trace> {
    Trace::open(path).map_err(|e| {
        let detail = match &e {
            tsubame_trace::TraceError::Io(io) => format!("{e}: {io}"),
            _ => e.to_string(),
        };
        usage_error(format!("{}: {detail}", path.display()))
    })
}

fn methods(text: &str) -> anyhow::Result<Vec<Method>> {
    if text == "all" {
        return Ok(Method::ALL.to_vec());
    }
    text.split(',').map(|m| m.parse::<Method>().map_err(|e| usage_error(format!("--method: {e}")))).collect()
}

/// Says how the trace is replayed: on the guest's work clock (with what
/// a fault costs) or on wall time, and why.
fn print_clock(trace: &Trace) {
    let clock = GuestClock::of(trace);
    match clock.basis {
        ClockBasis::GuestWork => println!(
            "replayed by guest work: {:.2} s of undisturbed work in {:.2} s traced ({:.0} ops/s before tracing), \
             a write-protect fault costs the guest {:.1} us",
            clock.span,
            trace.duration_s(),
            trace.setup.native_ops_per_sec,
            clock.fault_s * 1e6
        ),
        ClockBasis::WallNoOps => {
            println!("replayed on wall time (the trace has no guest ops counter: recorded by an older tsubame)")
        }
        ClockBasis::WallBarelyRan { work_s, traced_s } => println!("{}", barely_ran(work_s, traced_s)),
    }
}

/// The note for a trace whose guest clock is unusable.
fn barely_ran(work_s: f64, traced_s: f64) -> String {
    format!(
        "replayed on wall time: the guest barely ran between faults ({work_s:.2} s of undisturbed work in \
         {traced_s:.2} s traced, its ops counter rose less than twice), too little to replay by its work"
    )
}

/// A bar on stderr that shows only once the work has taken `delay`: a
/// replay is mostly over in well under a second, and should print nothing
/// but its results then.
struct LateBar {
    bar: ProgressBar,
    finished: Option<mpsc::Sender<()>>,
    shower: Option<std::thread::JoinHandle<()>>,
}

impl LateBar {
    fn new(len: u64, delay: Duration) -> LateBar {
        let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::hidden());
        bar.set_style(
            ProgressStyle::with_template("{spinner} {elapsed_precise} [{bar:30}] {pos}/{len} replays {msg}")
                .expect("valid template"),
        );
        let (finished, wait) = mpsc::channel::<()>();
        let late = bar.clone();
        let shower = std::thread::spawn(move || {
            // Only a timeout shows it: finishing drops the sender first.
            if wait.recv_timeout(delay) == Err(mpsc::RecvTimeoutError::Timeout) {
                late.set_draw_target(ProgressDrawTarget::stderr());
                late.enable_steady_tick(Duration::from_millis(100));
            }
        });
        LateBar { bar, finished: Some(finished), shower: Some(shower) }
    }

    fn finish(mut self) {
        drop(self.finished.take());
        if let Some(shower) = self.shower.take() {
            let _ = shower.join();
        }
        self.bar.finish_and_clear();
    }
}

/// Options of `tsubame simulate`.
#[derive(Args, Debug)]
pub struct SimulateArgs {
    /// A trace from `tsubame trace`.
    #[arg(long)]
    pub trace: PathBuf,
    /// Link bandwidth, e.g. 1Gbit.
    #[arg(long, default_value = "1Gbit")]
    pub bandwidth: String,
    /// page, page+xbzrle, subpage, or all.
    #[arg(long, default_value = "all")]
    pub method: String,
    /// Stop iterating once the rest takes at most this long, e.g. 300ms.
    #[arg(long, default_value = "300ms")]
    pub downtime_limit: String,
    /// Give up and stop-and-copy after this many iterations.
    #[arg(long, default_value_t = 20)]
    pub max_iterations: u32,
    /// Guest speed during migration relative to while traced (1 − β of the
    /// RDMA paper's model): 0.5 replays the trace at half speed.
    #[arg(long, default_value_t = 1.0)]
    pub guest_speed: f64,
    /// Also replay with the guest this much slower and faster (0.1: ±10 %,
    /// about how much a guest's speed wanders) and print the range; a
    /// migration whose outcome moves within it is on the convergence
    /// edge. 0 turns this off.
    #[arg(long, default_value_t = GUEST_SPEED_WANDER)]
    pub speed_spread: f64,
    /// Whether the migrating VM's memory is backed by 2 MiB pages: auto
    /// (as when traced), yes or no. Under KVM the first write after
    /// write-protection dirties a whole 2 MiB piece once.
    #[arg(long, default_value = "auto")]
    pub huge_pages: String,
    /// Replay `migrate --auto-converge`: the same policy slows the replayed
    /// guest as it would slow the real one.
    #[arg(long)]
    pub auto_converge: bool,
    /// Write a PNG of the remaining bytes per iteration, one line per method.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Write the results as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

fn sim_options(
    bandwidth: &str,
    limit: &str,
    max_iterations: u32,
    guest_speed: f64,
    huge_pages: &str,
) -> anyhow::Result<SimOptions> {
    let huge_pages = match huge_pages {
        "auto" => None,
        "yes" => Some(true),
        "no" => Some(false),
        other => return Err(usage_error(format!("--huge-pages: '{other}' is not auto, yes or no"))),
    };
    if !(guest_speed > 0.0 && guest_speed <= 10.0) {
        return Err(usage_error("--guest-speed must be in (0, 10]"));
    }
    let bandwidth = parse_rate(bandwidth).map_err(|e| usage_error(format!("--bandwidth: {e}")))? as f64;
    let limit = parse_duration(limit).map_err(|e| usage_error(format!("--downtime-limit: {e}")))?;
    if max_iterations == 0 {
        return Err(usage_error("--max-iterations must be at least 1"));
    }
    Ok(SimOptions {
        bandwidth,
        downtime_limit: limit.as_secs_f64(),
        max_iterations,
        guest_speed,
        huge_pages,
        auto_converge: false,
    })
}

/// Runs `tsubame simulate`.
pub fn simulate_cmd(args: SimulateArgs) -> anyhow::Result<()> {
    let options = SimOptions {
        auto_converge: args.auto_converge,
        ..sim_options(&args.bandwidth, &args.downtime_limit, args.max_iterations, args.guest_speed, &args.huge_pages)?
    };
    let methods = methods(&args.method)?;
    if !(0.0..0.9).contains(&args.speed_spread) {
        return Err(usage_error("--speed-spread must be in [0, 0.9)"));
    }
    let trace = open_trace(&args.trace)?;
    println!(
        "trace: {} ({} of memory, {:.1} s, {} intervals, {} B sub-pages); link {}/s",
        trace.setup.workload,
        format_bytes(trace.setup.memory_bytes),
        trace.duration_s(),
        trace.intervals.len(),
        trace.setup.granularity,
        format_bytes(options.bandwidth as u64)
    );
    print_clock(&trace);
    let bar = LateBar::new(methods.len() as u64 * replays_with_spread(args.speed_spread), Duration::from_secs(2));
    let results: Vec<_> = methods
        .iter()
        .map(|&m| {
            bar.bar.set_message(m.name());
            simulate_with_spread_reporting(&trace, m, &options, args.speed_spread, &mut || bar.bar.inc(1))
        })
        .collect();
    bar.finish();
    let rows = results.iter().map(|r| r.iterations.len()).max().unwrap_or(0);
    print!("{:>9}", "iteration");
    for r in &results {
        print!(" {:>22}", format!("{} (MiB)", r.method.name()));
    }
    println!();
    for i in 0..rows {
        print!("{i:>9}");
        for r in &results {
            match r.iterations.get(i) {
                Some(it) => print!(" {:>22.2}", it.bytes / (1 << 20) as f64),
                None => print!(" {:>22}", ""),
            }
        }
        println!();
    }
    for r in &results {
        println!(
            "{:<12} total {:.2} s, downtime {:.0} ms, {} iterations, {}, {} sent",
            r.method.name(),
            r.total_time_s,
            r.downtime_s * 1e3,
            r.iterations.len(),
            if r.converged { "converged".to_string() } else { format!("not converged ({})", r.stop_reason) },
            format_bytes(r.bytes_total as u64),
        );
        let most = r.iterations.iter().map(|i| i.throttle).fold(0.0, f64::max);
        if most > 0.0 {
            println!("{:<12} auto-converge throttled the guest up to {:.0} %", "", most * 100.0);
        }
        if let Some(spread) = &r.spread {
            println!("{:<12} {}", "", spread_line(spread));
        }
    }
    if let Some(path) = &args.plot {
        let title = format!(
            "{} ({}), {}/s: bytes per iteration",
            trace.setup.workload,
            format_bytes(trace.setup.memory_bytes),
            format_bytes(options.bandwidth as u64)
        );
        crate::plot::iterations_png(path, &title, &results, options.bandwidth * options.downtime_limit)?;
        println!("plot written to {}", path.display());
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&results)? + "\n")?;
    }
    Ok(())
}

/// The range of a replay with the guest slower and faster, in words.
fn spread_line(spread: &Spread) -> String {
    let verdict = match (spread.converged_if_slower, spread.converged_if_faster) {
        (true, true) => "converges either way",
        (false, false) => "converges neither way",
        (true, false) => "converges only if the guest is not faster",
        (false, true) => "converges only if the guest is faster",
    };
    format!(
        "guest ±{:.0} %: {}–{} iterations, {:.2}–{:.2} s, {}{}",
        spread.by * 100.0,
        spread.iterations.0,
        spread.iterations.1,
        spread.total_time_s.0,
        spread.total_time_s.1,
        verdict,
        if spread.on_edge() { " — on the convergence edge: the count hangs on the guest's speed" } else { "" }
    )
}

/// Options of `tsubame plan`.
#[derive(Args, Debug)]
pub struct PlanArgs {
    /// A trace from `tsubame trace`.
    #[arg(long, required_unless_present = "control", conflicts_with = "control")]
    pub trace: Option<PathBuf>,
    /// Or: the control socket of a running VM (`tsubame run --control`);
    /// plan records a trace of it first (the VM keeps running).
    #[arg(long)]
    pub control: Option<PathBuf>,
    /// With --control: how long to record, in seconds.
    #[arg(long, default_value_t = 10.0, requires = "control")]
    pub seconds: f64,
    /// With --control: time between dirty-log reads.
    #[arg(long, default_value = "50ms", requires = "control")]
    pub interval: String,
    /// Bandwidths to predict for, comma-separated.
    #[arg(long, default_value = "100Mbit,1Gbit,2.5Gbit,10Gbit")]
    pub bandwidths: String,
    /// Downtime to stay within, e.g. 300ms.
    #[arg(long, default_value = "300ms")]
    pub downtime_limit: String,
    /// Iterations before giving up.
    #[arg(long, default_value_t = 30)]
    pub max_iterations: u32,
    /// Share of the guest's CPU the migration takes (the model's β).
    #[arg(long, default_value_t = 0.0)]
    pub beta: f64,
    /// Write the model and predictions as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Runs `tsubame plan`.
pub fn plan(args: PlanArgs) -> anyhow::Result<()> {
    if !(0.0..1.0).contains(&args.beta) {
        return Err(usage_error("--beta must be in [0, 1)"));
    }
    let trace = match (&args.trace, &args.control) {
        (Some(path), _) => open_trace(path)?,
        (None, Some(control)) => {
            let path = std::env::temp_dir().join(format!("tsubame-plan-{}.trace", std::process::id()));
            let recorded = trace(TraceArgs {
                control: control.clone(),
                out: path.clone(),
                interval: args.interval.clone(),
                seconds: args.seconds,
                granularity: 128,
                baseline: "3s".into(),
            })
            .and_then(|_| open_trace(&path));
            let _ = std::fs::remove_file(&path);
            recorded?
        }
        (None, None) => return Err(usage_error("give --trace FILE or --control PATH")),
    };
    let basis = GuestClock::of(&trace).basis;
    if let ClockBasis::WallBarelyRan { work_s, traced_s } = basis {
        println!("{}", barely_ran(work_s, traced_s));
    }
    let curve = measure_dirty_curve(&trace);
    let model = fit(&curve).ok_or_else(|| {
        anyhow::anyhow!("the trace is too short to fit D(t): record at least a second with several intervals")
    })?;
    println!(
        "D(t) = M - M*(1/2)^(t(1-beta)/tau), t in seconds of {}: M = {:.0} pages ({}), tau = {:.3} s, \
         R^2 = {:.4}, RMSE = {:.0} pages",
        if basis == ClockBasis::GuestWork { "guest work" } else { "wall time" },
        model.m,
        format_bytes((model.m * 4096.0) as u64),
        model.tau,
        model.r_squared,
        model.rmse
    );
    let mut predictions = Vec::new();
    println!(
        "{:<12} {:>10} {:>10} {:>12} {:>11} {:>12}",
        "method", "bandwidth", "converges", "iterations", "total (s)", "downtime (ms)"
    );
    for text in args.bandwidths.split(',') {
        let options = sim_options(text, &args.downtime_limit, args.max_iterations, 1.0 - args.beta, "auto")?;
        for method in Method::ALL {
            let p = predict(&trace, &model, method, &options);
            println!(
                "{:<12} {:>10} {:>10} {:>12} {:>11.2} {:>12.0}",
                method.name(),
                text,
                match (p.converged, p.converged_if_faster) {
                    (true, true) => "yes",
                    (true, false) => "edge",
                    (false, _) => "no",
                },
                p.iterations,
                p.total_time_s,
                p.downtime_s * 1e3
            );
            predictions.push(p);
        }
    }
    // Recommend only what converges with the guest faster by its usual wander too.
    let margin = GUEST_SPEED_WANDER * 100.0;
    match predictions
        .iter()
        .filter(|p| p.converged && p.converged_if_faster)
        .min_by(|a, b| a.bandwidth.total_cmp(&b.bandwidth).then(a.total_time_s.total_cmp(&b.total_time_s)))
    {
        Some(p) => println!(
            "needs at least {}/s with {} to stop within {}, with the guest {margin:.0} % faster too \
             (predicted {:.2} s total, {:.0} ms downtime)",
            format_bytes(p.bandwidth as u64),
            p.method.name(),
            args.downtime_limit,
            p.total_time_s,
            p.downtime_s * 1e3
        ),
        None => println!(
            "no method converges within {} at these bandwidths with a {margin:.0} % margin on the guest's speed",
            args.downtime_limit
        ),
    }
    if predictions.iter().any(|p| p.converged && !p.converged_if_faster) {
        println!("edge: converges at the traced speed but not with the guest {margin:.0} % faster");
    }
    if let Some(first) = predictions.first() {
        println!(
            "predicted iteration-1 dirty pages at {}: {:.0}",
            args.bandwidths.split(',').next().unwrap_or(""),
            first.iteration1_dirty_pages
        );
    }
    if let Some(path) = &args.json {
        let doc = json!({"model": model, "curve": curve, "predictions": predictions});
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")?;
    }
    Ok(())
}
