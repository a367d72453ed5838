//! What a control socket serves: the handler that answers commands, and
//! the VM's state its events are made from.

use serde_json::Value;

/// What the events are made from: the VM's state as the process sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmState {
    /// The vCPU runs.
    pub running: bool,
    /// The latest migration of this VM: its number (1, 2, ...) and its
    /// QEMU status (`setup`, `active`, `postcopy-active`,
    /// `postcopy-paused`, `completed`, `failed`).
    pub migration: Option<(u64, &'static str)>,
}

/// Answers control requests.
pub trait ControlHandler: Send + Sync + 'static {
    /// Handles one command (tsubame's names); `Ok` fields are merged into
    /// the reply.
    fn handle(&self, cmd: &str, request: &Value) -> Result<Value, String>;

    /// The state events are made from; `None` while there is no VM.
    fn state(&self) -> Option<VmState> {
        None
    }
}
