//! A VM running in this process: its console, what its control socket
//! answers, and the wait for it to end (time limit, `quit`, the guest
//! stopping, or the VM migrating away).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tsubame_migrate::recorder::{self, RecordOptions};
use tsubame_migrate::stats::Status;
use tsubame_migrate::{source, Address, MigrateOptions, MigrationStats, ProgressCell};
use tsubame_vmm::{VcpuStatus, Vm};

use crate::console::{ConsoleFollower, GuestProgress};
use crate::control::{qmp, ControlHandler, VmState};
use crate::request::MigrateRequest;

/// Why the host stopped waiting.
#[derive(Debug)]
pub enum VmEnd {
    /// The time limit passed.
    TimeUp,
    /// A `quit` request arrived.
    Quit,
    /// The guest halted on its own.
    GuestHalted,
    /// The VM was migrated away.
    Migrated(Box<MigrationStats>),
}

/// The VM left with a migration: it completed, or failed once post-copy's
/// destination had said it runs the VM (before that, the copy here is
/// whole and stays paused).
fn went_away(stats: &MigrationStats) -> bool {
    stats.status == Status::Completed || stats.postcopy.as_ref().is_some_and(|p| p.switch_confirmed)
}

/// The source side's migration, as `query-migrate` reports it.
enum Migration {
    None,
    Active { progress: Arc<ProgressCell>, started: Instant },
    Finished(Box<MigrationStats>),
}

/// The VM and what watches it.
pub struct RunningVm {
    /// The VM.
    pub vm: Arc<Vm>,
    /// The console follower.
    pub console: ConsoleFollower,
    /// When the guest started running here.
    pub started: Instant,
    quit: AtomicBool,
    migration: Mutex<Migration>,
    /// How many migrations were started (the events tell them apart).
    migrations: AtomicU64,
    tracing: AtomicBool,
    /// Post-copy: the VM runs here while its memory still arrives.
    arriving: AtomicBool,
    /// The guest's workload command line, as far as this process knows it.
    pub description: String,
    /// Far memory, when the VM borrows a memory host's RAM.
    far: std::sync::OnceLock<tsubame_farmem::FarMemory>,
    me: Weak<RunningVm>,
}

impl RunningVm {
    /// Wraps a started VM.
    pub fn new(vm: Arc<Vm>, console: ConsoleFollower, description: String) -> Arc<RunningVm> {
        Arc::new_cyclic(|me| RunningVm {
            vm,
            console,
            started: Instant::now(),
            quit: AtomicBool::new(false),
            migration: Mutex::new(Migration::None),
            migrations: AtomicU64::new(0),
            tracing: AtomicBool::new(false),
            arriving: AtomicBool::new(false),
            description,
            far: std::sync::OnceLock::new(),
            me: me.clone(),
        })
    }

    /// Hands the VM's far memory to this host (once, right after start).
    pub fn set_far(&self, far: tsubame_farmem::FarMemory) {
        let _ = self.far.set(far);
    }

    /// Far memory's counters, when it has far memory.
    pub fn far_stats(&self) -> Option<tsubame_farmem::FarStats> {
        self.far.get().map(tsubame_farmem::FarMemory::stats)
    }

    /// Post-copy: the VM's memory is still arriving (it cannot be
    /// migrated on or traced until it is all here).
    pub fn set_arriving(&self, arriving: bool) {
        self.arriving.store(arriving, Ordering::Release);
    }

    /// Asks `wait` to return.
    pub fn request_quit(&self) {
        self.quit.store(true, Ordering::Release);
    }

    /// Waits until the time limit, a quit request, the guest stopping, or
    /// the VM migrating away (the caller then lets the control socket
    /// drain: `ControlServer::drain`).
    pub fn wait(&self, limit: Option<Duration>) -> anyhow::Result<VmEnd> {
        loop {
            if self.quit.load(Ordering::Acquire) {
                return Ok(VmEnd::Quit);
            }
            if let Migration::Finished(stats) = &*self.migration.lock().unwrap() {
                if stats.status == Status::Completed {
                    return Ok(VmEnd::Migrated(stats.clone()));
                }
                if stats.status == Status::Failed && stats.postcopy.as_ref().is_some_and(|p| p.switch_confirmed) {
                    // Past the switch: the VM never runs here again. (Before
                    // the destination confirmed it, the VM stays paused
                    // here, and the error says so.)
                    anyhow::bail!("{}", stats.error.as_deref().unwrap_or("post-copy failed: the VM is lost"));
                }
            }
            if limit.is_some_and(|l| self.started.elapsed() >= l) && !self.migrating() {
                return Ok(VmEnd::TimeUp);
            }
            match self.vm.wait_stopped(Duration::from_millis(50)) {
                VcpuStatus::Halted if !self.migrating() => {
                    // Let the console thread catch the guest's last line.
                    std::thread::sleep(Duration::from_millis(50));
                    if let Some(error) = self.console.snapshot().error {
                        anyhow::bail!("the guest failed: {error}");
                    }
                    return Ok(VmEnd::GuestHalted);
                }
                VcpuStatus::Failed(reason) if !self.migrating() => anyhow::bail!("the VM failed: {reason}"),
                VcpuStatus::Stopped => anyhow::bail!("the vCPU thread ended unexpectedly"),
                // Paused (or halted mid-migration): wait_stopped returns at
                // once, so sleep instead of spinning a core the migration
                // needs (a post-copy source stays paused for the whole phase).
                status if status.is_stopped() => std::thread::sleep(Duration::from_millis(50)),
                _ => {}
            }
        }
    }

    fn self_arc(&self) -> Arc<RunningVm> {
        self.me.upgrade().expect("a RunningVm lives in an Arc")
    }

    /// True from the start of a migration until it failed (then the VM
    /// runs here again) or completed (then it runs elsewhere).
    fn migrating(&self) -> bool {
        match &*self.migration.lock().unwrap() {
            Migration::None => false,
            Migration::Active { .. } => true,
            Migration::Finished(stats) => went_away(stats),
        }
    }

    /// The VM left: a migration completed, or failed past the switch to
    /// post-copy.
    pub fn migrated_away(&self) -> bool {
        matches!(&*self.migration.lock().unwrap(),
            Migration::Finished(stats) if went_away(stats))
    }

    /// Starts migrating the VM to `to` on a thread of its own.
    pub fn start_migration(self: &Arc<Self>, to: Address, options: MigrateOptions) -> Result<(), String> {
        let progress = Arc::new(ProgressCell::default());
        if self.tracing.load(Ordering::Acquire) {
            return Err("a trace is being recorded; migrate when it is done".into());
        }
        if self.arriving.load(Ordering::Acquire) {
            return Err("the VM's memory is still arriving (post-copy); migrate it once it is all here".into());
        }
        {
            let mut slot = self.migration.lock().unwrap();
            match &*slot {
                Migration::Active { .. } => return Err("a migration is already running".into()),
                Migration::Finished(stats) if went_away(stats) => {
                    return Err("the VM has already been migrated away".into())
                }
                _ => {}
            }
            *slot = Migration::Active { progress: progress.clone(), started: Instant::now() };
            self.migrations.fetch_add(1, Ordering::AcqRel);
        }
        let host = self.clone();
        std::thread::Builder::new()
            .name("migration".into())
            .spawn(move || {
                let stats = match host.far.get() {
                    Some(far) => source::migrate_far(&host.vm, far, &to, &options, &progress),
                    None => source::migrate(&*host.vm, &to, &options, &progress),
                };
                *host.migration.lock().unwrap() = Migration::Finished(Box::new(stats));
            })
            .map_err(|e| format!("cannot start the migration thread: {e}"))?;
        Ok(())
    }

    /// `migrate-resume`: asks a post-copy migration whose link is cut to
    /// reconnect now (to `to`, when given), and waits for the attempt.
    pub fn resume_migration(&self, request: &Value) -> Result<Value, String> {
        let to = match request.get("to").and_then(Value::as_str) {
            Some(to) => Some(to.parse::<Address>().map_err(|e| e.to_string())?),
            None => None,
        };
        let progress = match &*self.migration.lock().unwrap() {
            Migration::Active { progress, .. } => progress.clone(),
            _ => return Err("no paused post-copy migration to resume".into()),
        };
        let answer = progress.request_resume(to)?;
        match answer.recv_timeout(std::time::Duration::from_secs(30)) {
            Ok(Ok(())) => Ok(json!({})),
            Ok(Err(why)) => Err(why),
            Err(_) => Err("the migration did not answer the resume request".into()),
        }
    }

    /// The `query-migrate` reply.
    pub fn query_migrate(&self) -> Value {
        match &*self.migration.lock().unwrap() {
            Migration::None => json!({"status": "none"}),
            Migration::Active { progress, started } => json!({
                "status": "active",
                "progress": progress.get(),
                "total_time_ms": started.elapsed().as_secs_f64() * 1e3,
            }),
            Migration::Finished(stats) => json!({"status": stats.status, "stats": stats}),
        }
    }

    /// The `query-status` reply, QEMU's: whether the vCPU runs, and a
    /// run state name (`running`, `paused`, `finish-migrate` while a
    /// migration holds it paused, `postmigrate` once it left, ...).
    pub fn query_status(&self) -> Value {
        let status = self.vm.status();
        let name = match &status {
            VcpuStatus::Created => "prelaunch",
            VcpuStatus::Running => "running",
            VcpuStatus::Paused | VcpuStatus::Halted if self.migrating() => match &*self.migration.lock().unwrap() {
                Migration::Active { .. } => "finish-migrate",
                _ => "postmigrate",
            },
            VcpuStatus::Paused => "paused",
            VcpuStatus::Halted | VcpuStatus::Stopped => "shutdown",
            VcpuStatus::Failed(_) => "internal-error",
        };
        json!({"running": matches!(status, VcpuStatus::Running), "status": name})
    }

    /// Records a dirty-page trace of the running VM (blocks the request).
    fn trace(&self, request: &Value) -> Result<Value, String> {
        if self.far.get().is_some() {
            return Err(
                "far memory reads the dirty log itself: a trace of a VM with far memory is not supported".into()
            );
        }
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
        if self.migrating() || matches!(&*self.migration.lock().unwrap(), Migration::Active { .. }) {
            return Err("the VM is migrating; trace it before or after".into());
        }
        if self.arriving.load(Ordering::Acquire) {
            return Err("the VM's memory is still arriving (post-copy); trace it once it is all here".into());
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

    /// QEMU's `pmemsave`: writes `size` bytes of guest memory from
    /// address `val` to the file `filename`, as they are now (the guest
    /// keeps running unless paused first). Pages held in far memory or
    /// still arriving are not here to read, so those VMs are refused.
    fn pmemsave(&self, request: &Value) -> Result<Value, String> {
        let number = |key: &str| {
            request.get(key).and_then(Value::as_u64).ok_or_else(|| format!("pmemsave needs \"{key}\": a byte count"))
        };
        let (start, size) = (number("val")?, number("size")?);
        let path = request.get("filename").and_then(Value::as_str).ok_or("pmemsave needs \"filename\": a file path")?;
        let memory = self.vm.memory_bytes();
        if start.checked_add(size).is_none_or(|end| end > memory) {
            return Err(format!("{size} bytes at {start:#x} lie outside the guest's {memory} bytes of memory"));
        }
        if self.far.get().is_some() || self.arriving.load(Ordering::Acquire) {
            return Err("part of the guest's memory is not on this host (far memory or post-copy)".into());
        }
        let file = std::fs::File::create(path).map_err(|e| format!("cannot create {path}: {e}"))?;
        let mut out = std::io::BufWriter::new(file);
        let mut chunk = vec![0u8; 1 << 20];
        let mut at = start;
        while at < start + size {
            let len = chunk.len().min((start + size - at) as usize);
            tsubame_vmm::memory::read(self.vm.memory(), at, &mut chunk[..len]).map_err(|e| e.to_string())?;
            std::io::Write::write_all(&mut out, &chunk[..len]).map_err(|e| format!("cannot write {path}: {e}"))?;
            at += len as u64;
        }
        std::io::Write::flush(&mut out).map_err(|e| format!("cannot write {path}: {e}"))?;
        Ok(json!({}))
    }

    /// The `query-memory` reply: guest memory, and where its pages live.
    pub fn query_memory(&self) -> Value {
        json!({
            "memory_bytes": self.vm.memory_bytes(),
            "far_memory": self.far_stats(),
        })
    }

    /// The `stats` reply.
    pub fn stats(&self) -> Value {
        let progress: GuestProgress = self.console.snapshot();
        json!({
            "status": status_name(&self.vm.status()),
            "memory_bytes": self.vm.memory_bytes(),
            "uptime_ms": self.started.elapsed().as_millis() as u64,
            "memory_arriving": self.arriving.load(Ordering::Acquire),
            "guest": progress,
            "vcpu": self.vm.switch_times(),
            "disk": self.vm.disk_stats(),
            "far_memory": self.far_stats(),
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

impl ControlHandler for RunningVm {
    fn handle(&self, cmd: &str, request: &Value) -> Result<Value, String> {
        match cmd {
            "stats" => Ok(self.stats()),
            "query-memory" => Ok(self.query_memory()),
            "migrate" => {
                let (to, options) = MigrateRequest::parse(request)?.options()?;
                self.self_arc().start_migration(to, options)?;
                Ok(json!({}))
            }
            "query-migrate" => Ok(self.query_migrate()),
            "query-status" => Ok(self.query_status()),
            "migrate-resume" => self.resume_migration(request),
            "trace" => self.trace(request),
            "pmemsave" => self.pmemsave(request),
            "pause" => self.vm.pause().map(|_| json!({})).map_err(|e| e.to_string()),
            "resume" => self.vm.resume().map(|_| json!({})).map_err(|e| e.to_string()),
            "quit" => {
                self.request_quit();
                Ok(json!({}))
            }
            other => Err(format!(
                "unknown command '{other}' (known: stats, query-status, query-memory, pause, resume, quit, migrate, query-migrate, migrate-resume, trace, pmemsave)"
            )),
        }
    }

    fn state(&self) -> Option<VmState> {
        let running = matches!(self.vm.status(), VcpuStatus::Running);
        let id = self.migrations.load(Ordering::Acquire);
        let migration = match &*self.migration.lock().unwrap() {
            Migration::None => None,
            Migration::Active { progress, .. } => Some((id, qmp::migration_status(progress.get().phase))),
            Migration::Finished(stats) => Some((
                id,
                match stats.status {
                    Status::Completed => "completed",
                    Status::Failed => "failed",
                },
            )),
        };
        Some(VmState { running, migration })
    }
}
