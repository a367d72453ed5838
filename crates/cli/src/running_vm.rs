//! A VM running in this process: its console, its control socket, and
//! the wait for it to end (time limit, `quit`, or the guest stopping).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tsubame_migrate::recorder::{self, RecordOptions};
use tsubame_migrate::{source, Address, GpuOffload, MigrateOptions, MigrationStats, ProgressCell};
use tsubame_vmm::{VcpuStatus, Vm};

use crate::control::ControlHandler;
use crate::guest_host::{ConsoleFollower, GuestProgress};

/// Why the host stopped waiting.
#[derive(Debug)]
pub enum HostEnd {
    /// The time limit passed.
    TimeUp,
    /// A `quit` request arrived.
    Quit,
    /// The guest halted on its own.
    GuestHalted,
    /// The VM was migrated away.
    Migrated(Box<MigrationStats>),
}

/// The source side's migration, as `query-migrate` reports it.
enum Migration {
    None,
    Active(Arc<ProgressCell>),
    Finished { stats: Box<MigrationStats>, at: Instant, delivered: bool },
}

/// After a completed migration the source lingers this long at most for a
/// client to collect the statistics.
const LINGER: Duration = Duration::from_secs(5);

/// The VM and what watches it.
pub struct Host {
    /// The VM.
    pub vm: Arc<Vm>,
    /// The console follower.
    pub console: ConsoleFollower,
    /// When the guest started running here.
    pub started: Instant,
    quit: AtomicBool,
    migration: Mutex<Migration>,
    tracing: AtomicBool,
    /// The guest's workload command line, as far as this process knows it.
    pub description: String,
    me: Weak<Host>,
}

impl Host {
    /// Wraps a started VM.
    pub fn new(vm: Arc<Vm>, console: ConsoleFollower, description: String) -> Arc<Host> {
        Arc::new_cyclic(|me| Host {
            vm,
            console,
            started: Instant::now(),
            quit: AtomicBool::new(false),
            migration: Mutex::new(Migration::None),
            tracing: AtomicBool::new(false),
            description,
            me: me.clone(),
        })
    }

    /// Asks `wait` to return.
    pub fn request_quit(&self) {
        self.quit.store(true, Ordering::Release);
    }

    /// Waits until the time limit, a quit request, or the guest stopping.
    pub fn wait(&self, limit: Option<Duration>) -> anyhow::Result<HostEnd> {
        loop {
            if self.quit.load(Ordering::Acquire) {
                return Ok(HostEnd::Quit);
            }
            if let Migration::Finished { stats, at, delivered } = &*self.migration.lock().unwrap() {
                if stats.status == tsubame_migrate::stats::Status::Completed && (*delivered || at.elapsed() > LINGER) {
                    return Ok(HostEnd::Migrated(stats.clone()));
                }
            }
            if limit.is_some_and(|l| self.started.elapsed() >= l) && !self.migrating() {
                return Ok(HostEnd::TimeUp);
            }
            match self.vm.wait_stopped(Duration::from_millis(50)) {
                VcpuStatus::Halted if !self.migrating() => {
                    // Let the console thread catch the guest's last line.
                    std::thread::sleep(Duration::from_millis(50));
                    if let Some(error) = self.console.snapshot().error {
                        anyhow::bail!("the guest failed: {error}");
                    }
                    return Ok(HostEnd::GuestHalted);
                }
                VcpuStatus::Failed(reason) if !self.migrating() => anyhow::bail!("the VM failed: {reason}"),
                VcpuStatus::Stopped => anyhow::bail!("the vCPU thread ended unexpectedly"),
                _ => {}
            }
        }
    }

    fn self_arc(&self) -> Arc<Host> {
        self.me.upgrade().expect("a Host lives in an Arc")
    }

    /// True from the start of a migration until it failed (then the VM
    /// runs here again) or completed (then it runs elsewhere).
    fn migrating(&self) -> bool {
        match &*self.migration.lock().unwrap() {
            Migration::None => false,
            Migration::Active(_) => true,
            Migration::Finished { stats, .. } => stats.status == tsubame_migrate::stats::Status::Completed,
        }
    }

    /// Starts migrating the VM to `to` on a thread of its own.
    pub fn start_migration(self: &Arc<Self>, to: Address, options: MigrateOptions) -> Result<(), String> {
        let progress = Arc::new(ProgressCell::default());
        if self.tracing.load(Ordering::Acquire) {
            return Err("a trace is being recorded; migrate when it is done".into());
        }
        {
            let mut slot = self.migration.lock().unwrap();
            match &*slot {
                Migration::Active(_) => return Err("a migration is already running".into()),
                Migration::Finished { stats, .. } if stats.status == tsubame_migrate::stats::Status::Completed => {
                    return Err("the VM has already been migrated away".into())
                }
                _ => {}
            }
            *slot = Migration::Active(progress.clone());
        }
        let host = self.clone();
        std::thread::Builder::new()
            .name("migration".into())
            .spawn(move || {
                let stats = source::migrate(&*host.vm, &to, &options, &progress);
                *host.migration.lock().unwrap() =
                    Migration::Finished { stats: Box::new(stats), at: Instant::now(), delivered: false };
            })
            .map_err(|e| format!("cannot start the migration thread: {e}"))?;
        Ok(())
    }

    /// The `query-migrate` reply; marks final statistics as delivered.
    pub fn query_migrate(&self) -> Value {
        match &mut *self.migration.lock().unwrap() {
            Migration::None => json!({"status": "none"}),
            Migration::Active(progress) => json!({"status": "active", "progress": progress.get()}),
            Migration::Finished { stats, delivered, .. } => {
                *delivered = true;
                json!({"status": stats.status, "stats": stats})
            }
        }
    }

    /// Records a dirty-page trace of the running VM (blocks the request).
    fn trace(&self, request: &Value) -> Result<Value, String> {
        let out = request.get("out").and_then(Value::as_str).ok_or("trace needs \"out\": a file path")?;
        let number = |key: &str, default: f64| -> Result<f64, String> {
            match request.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(v) => {
                    v.as_f64().filter(|x| *x > 0.0).ok_or_else(|| format!("\"{key}\" must be a positive number"))
                }
            }
        };
        let options = RecordOptions {
            interval: Duration::from_secs_f64(number("interval_ms", 10.0)? / 1e3),
            duration: Duration::from_secs_f64(number("seconds", 10.0)?),
            granularity: number("granularity", 128.0)? as u32,
            workload: self.description.clone(),
            baseline: Duration::from_secs_f64(number("baseline_s", 3.0)?),
        };
        if self.migrating() || matches!(&*self.migration.lock().unwrap(), Migration::Active(_)) {
            return Err("the VM is migrating; trace it before or after".into());
        }
        if self.tracing.swap(true, Ordering::AcqRel) {
            return Err("a trace is already being recorded".into());
        }
        let result = std::fs::File::create(out).map_err(|e| format!("cannot create {out}: {e}")).and_then(|file| {
            let guest_ops = || self.console.snapshot().ops;
            recorder::record(&self.vm, std::io::BufWriter::new(file), &options, &guest_ops).map_err(|e| e.to_string())
        });
        self.tracing.store(false, Ordering::Release);
        Ok(serde_json::to_value(result?).expect("summary serializes"))
    }

    /// The `stats` reply.
    pub fn stats(&self) -> Value {
        let progress: GuestProgress = self.console.snapshot();
        json!({
            "status": status_name(&self.vm.status()),
            "memory_bytes": self.vm.memory_bytes(),
            "uptime_ms": self.started.elapsed().as_millis() as u64,
            "guest": progress,
        })
    }
}

/// A short name for a vCPU status.
pub fn status_name(status: &VcpuStatus) -> &'static str {
    match status {
        VcpuStatus::Created => "created",
        VcpuStatus::Running => "running",
        VcpuStatus::Paused => "paused",
        VcpuStatus::Halted => "halted",
        VcpuStatus::Failed(_) => "failed",
        VcpuStatus::Stopped => "stopped",
    }
}

impl ControlHandler for Host {
    fn handle(&self, cmd: &str, request: &Value) -> Result<Value, String> {
        match cmd {
            "stats" => Ok(self.stats()),
            "migrate" => {
                let (to, options) = migrate_request(request)?;
                self.self_arc().start_migration(to, options)?;
                Ok(json!({}))
            }
            "query-migrate" => Ok(self.query_migrate()),
            "trace" => self.trace(request),
            "pause" => self.vm.pause().map(|_| json!({})).map_err(|e| e.to_string()),
            "resume" => self.vm.resume().map(|_| json!({})).map_err(|e| e.to_string()),
            "quit" => {
                self.request_quit();
                Ok(json!({}))
            }
            other => Err(format!(
                "unknown command '{other}' (known: stats, pause, resume, quit, migrate, query-migrate, trace)"
            )),
        }
    }
}

/// Reads `{"cmd":"migrate","to":ADDR, ...options}`.
pub fn migrate_request(request: &Value) -> Result<(Address, MigrateOptions), String> {
    let to =
        request.get("to").and_then(Value::as_str).ok_or("migrate needs \"to\": \"tcp:HOST:PORT\" or \"unix:PATH\"")?;
    let to: Address = to.parse().map_err(|e: tsubame_migrate::transport::TransportError| e.to_string())?;
    let mut options = MigrateOptions::default();
    let number = |key: &str| -> Result<Option<u64>, String> {
        match request.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| format!("\"{key}\" must be a non-negative integer")),
        }
    };
    options.max_bandwidth = number("max_bandwidth")?;
    if let Some(ms) = number("downtime_limit_ms")? {
        options.downtime_limit = Duration::from_millis(ms);
    }
    if let Some(n) = number("max_iterations")? {
        if n == 0 || n > 1000 {
            return Err("\"max_iterations\" must be between 1 and 1000".into());
        }
        options.max_iterations = n as u32;
    }
    if let Some(g) = number("granularity")? {
        let g = u32::try_from(g).map_err(|_| "\"granularity\" is too large".to_string())?;
        tsubame_migrate::subpage::check_granularity(g)?;
        options.granularity = g;
    }
    if let Some(d) = request.get("subpage_detect") {
        options.subpage_detector = d.as_str().ok_or("\"subpage_detect\" must be a string")?.parse()?;
    }
    if let Some(c) = request.get("codec") {
        options.codecs = c
            .as_str()
            .ok_or("\"codec\" must be a string")?
            .parse()
            .map_err(|e: tsubame_codec::CodecError| e.to_string())?;
    }
    if let Some(n) = number("channels")? {
        options.channels = u16::try_from(n).map_err(|_| "\"channels\" is too large".to_string())?;
    }
    if let Some(n) = number("encode_threads")? {
        options.encode_threads = u16::try_from(n).map_err(|_| "\"encode_threads\" is too large".to_string())?;
    }
    if let Some(n) = number("batch_pages")? {
        options.batch_pages = n;
    }
    if let Some(n) = number("buffers")? {
        options.buffers = usize::try_from(n).map_err(|_| "\"buffers\" is too large".to_string())?;
    }
    if let Some(v) = request.get("auto_converge") {
        options.auto_converge = v.as_bool().ok_or("\"auto_converge\" must be true or false")?;
    }
    if let Some(v) = request.get("pipeline") {
        options.pipeline = v.as_bool().ok_or("\"pipeline\" must be true or false")?;
    }
    if let Some(v) = request.get("gpu").filter(|v| !v.is_null()) {
        let text = v.as_str().ok_or("\"gpu\" must be a string: cuda:POLICY or emulator")?;
        options.gpu = Some(match text.split_once(':') {
            Some(("cuda", wait)) => GpuOffload::Cuda(wait.parse()?),
            None if text == "emulator" => GpuOffload::Emulator,
            _ => return Err(format!("\"gpu\": '{text}' is not cuda:POLICY or emulator")),
        });
    }
    if let Some(v) = request.get("zero_copy") {
        options.zero_copy = v.as_bool().ok_or("\"zero_copy\" must be true or false")?;
    }
    if let Some(v) = request.get("abort_if_not_converged") {
        options.abort_if_not_converged = v.as_bool().ok_or("\"abort_if_not_converged\" must be true or false")?;
    }
    if let Some(v) = request.get("insecure") {
        options.security.insecure = v.as_bool().ok_or("\"insecure\" must be true or false")?;
    }
    let path = |key: &str| -> Result<Option<&std::path::Path>, String> {
        match request.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => {
                v.as_str().map(|p| Some(std::path::Path::new(p))).ok_or(format!("\"{key}\" must be a file path"))
            }
        }
    };
    if let Some(path) = path("psk_file")? {
        options.security.psk = Some(tsubame_migrate::secure::Psk::read(path).map_err(|e| e.to_string())?);
    }
    match (path("tls_cert")?, path("tls_key")?, path("tls_ca")?) {
        (None, None, None) => {}
        (Some(cert), Some(key), Some(ca)) => {
            let tls = tsubame_migrate::secure::TlsConfig::load(cert, key, ca).map_err(|e| e.to_string())?;
            options.security.tls = Some(tls);
        }
        _ => return Err("\"tls_cert\", \"tls_key\" and \"tls_ca\" go together: give all three or none".into()),
    }
    options.check()?;
    Ok((to, options))
}

/// Key and certificate files of a migrate request (paths the VM's
/// process can open).
#[derive(Debug, Default)]
pub struct SecurityFiles {
    /// `--psk-file`.
    pub psk: Option<std::path::PathBuf>,
    /// `--tls-cert`.
    pub tls_cert: Option<std::path::PathBuf>,
    /// `--tls-key`.
    pub tls_key: Option<std::path::PathBuf>,
    /// `--tls-ca`.
    pub tls_ca: Option<std::path::PathBuf>,
}

/// The request fields for `options`, the inverse of [`migrate_request`].
pub fn migrate_request_fields(to: &Address, options: &MigrateOptions, files: &SecurityFiles) -> Value {
    let text = |p: &Option<std::path::PathBuf>| p.as_ref().map(|p| p.display().to_string());
    json!({
        "psk_file": text(&files.psk),
        "tls_cert": text(&files.tls_cert),
        "tls_key": text(&files.tls_key),
        "tls_ca": text(&files.tls_ca),
        "insecure": options.security.insecure,
        "cmd": "migrate",
        "to": to.to_string(),
        "max_bandwidth": options.max_bandwidth,
        "downtime_limit_ms": options.downtime_limit.as_millis() as u64,
        "max_iterations": options.max_iterations,
        "abort_if_not_converged": options.abort_if_not_converged,
        "auto_converge": options.auto_converge,
        "granularity": options.granularity,
        "codec": options.codecs.to_string(),
        "channels": options.channels,
        "encode_threads": options.encode_threads,
        "batch_pages": options.batch_pages,
        "buffers": options.buffers,
        "pipeline": options.pipeline,
        "zero_copy": options.zero_copy,
        "gpu": options.gpu.map(|gpu| match gpu {
            GpuOffload::Cuda(wait) => format!("cuda:{wait}"),
            GpuOffload::Emulator => "emulator".to_string(),
        }),
        "subpage_detect": match options.subpage_detector {
            tsubame_migrate::subpage::Detector::Shadow => "shadow",
            tsubame_migrate::subpage::Detector::Hash => "hash",
        },
    })
}
