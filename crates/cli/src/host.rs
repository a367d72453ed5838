//! A VM running in this process: its console, its control socket, and
//! the wait for it to end (time limit, `quit`, or the guest stopping).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tsubame_vmm::{VcpuStatus, Vm};

use crate::control::ControlHandler;
use crate::guest_host::{ConsoleFollower, GuestProgress};

/// Why the host stopped waiting.
#[derive(Debug, PartialEq)]
pub enum HostEnd {
    /// The time limit passed.
    TimeUp,
    /// A `quit` request arrived.
    Quit,
    /// The guest halted on its own.
    GuestHalted,
}

/// The VM and what watches it.
pub struct Host {
    /// The VM.
    pub vm: Arc<Vm>,
    /// The console follower.
    pub console: ConsoleFollower,
    /// When the guest started running here.
    pub started: Instant,
    quit: AtomicBool,
}

impl Host {
    /// Wraps a started VM.
    pub fn new(vm: Arc<Vm>, console: ConsoleFollower) -> Arc<Host> {
        Arc::new(Host { vm, console, started: Instant::now(), quit: AtomicBool::new(false) })
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
            if limit.is_some_and(|l| self.started.elapsed() >= l) {
                return Ok(HostEnd::TimeUp);
            }
            match self.vm.wait_stopped(Duration::from_millis(50)) {
                VcpuStatus::Halted => {
                    // Let the console thread catch the guest's last line.
                    std::thread::sleep(Duration::from_millis(50));
                    if let Some(error) = self.console.snapshot().error {
                        anyhow::bail!("the guest failed: {error}");
                    }
                    return Ok(HostEnd::GuestHalted);
                }
                VcpuStatus::Failed(reason) => anyhow::bail!("the VM failed: {reason}"),
                VcpuStatus::Stopped => anyhow::bail!("the vCPU thread ended unexpectedly"),
                _ => {}
            }
        }
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
    fn handle(&self, cmd: &str, _request: &Value) -> Result<Value, String> {
        match cmd {
            "stats" => Ok(self.stats()),
            "pause" => self.vm.pause().map(|_| json!({})).map_err(|e| e.to_string()),
            "resume" => self.vm.resume().map(|_| json!({})).map_err(|e| e.to_string()),
            "quit" => {
                self.request_quit();
                Ok(json!({}))
            }
            other => Err(format!("unknown command '{other}' (known: stats, pause, resume, quit)")),
        }
    }
}
