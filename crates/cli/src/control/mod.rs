//! The control socket: JSON lines over a Unix socket, in two forms.
//!
//! On connect the server sends QMP's greeting line, `{"QMP": {...}}`.
//! The first request line decides the session's form:
//!
//! ```text
//! client                              server
//!   |            <-- {"QMP": {"version": ..., "capabilities": []}}
//!   |                                     (sent to every client)
//!   |-- {"cmd":"stats"} -->               tsubame's own form: one request,
//!   |            <-- {"ok":true, ...}     one reply; no events
//! or
//!   |-- {"execute":"qmp_capabilities"} -> QMP, as QEMU speaks it
//!   |            <-- {"return": {}}
//!   |-- {"execute":"query-status","id":1} -->
//!   |            <-- {"return": {"running": true, ...}, "id": 1}
//!   |            <-- {"event":"MIGRATION","data":{...},"timestamp":{...}}
//! ```
//!
//! `session.rs` reads lines (at most [`session::MAX_REQUEST`] bytes each; a longer
//! one is skipped to its newline and answered with one error) and picks
//! the form; `qmp.rs` maps QEMU's commands onto the handler's; `hub.rs`
//! knows the sessions, sends events, and lets the process end only once
//! its last replies are out ([`ControlServer::drain`]); `client.rs` is
//! the `{"cmd":...}` client `tsubame migrate` and `trace` use.

mod client;
mod handler;
mod hub;
pub(crate) mod qmp;
mod session;

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub use client::{ControlClient, SocketClosed};
pub use handler::{ControlHandler, VmState};
use hub::Hub;

/// How long the process waits, at most, after its VM migrated away (or
/// it was asked to quit) for its last replies and events to go out.
pub const LINGER: Duration = Duration::from_secs(5);

/// A listening control socket; the file is removed on drop.
pub struct ControlServer {
    path: PathBuf,
    hub: Arc<Hub>,
}

impl ControlServer {
    /// Binds `path` and serves it on background threads.
    pub fn start(path: &Path, handler: Arc<dyn ControlHandler>) -> anyhow::Result<ControlServer> {
        if path.exists() {
            if UnixStream::connect(path).is_ok() {
                anyhow::bail!("control socket {} is in use by another process", path.display());
            }
            std::fs::remove_file(path)?;
        }
        let listener = UnixListener::bind(path)
            .map_err(|e| anyhow::anyhow!("cannot listen on control socket {}: {e}", path.display()))?;
        let hub = Arc::new(Hub::new(handler));
        let serving = hub.clone();
        std::thread::Builder::new().name("control".into()).spawn(move || {
            for stream in listener.incoming().flatten() {
                let hub = serving.clone();
                let _ =
                    std::thread::Builder::new().name("control-conn".into()).spawn(move || session::serve(stream, hub));
            }
        })?;
        let watching = hub.clone();
        std::thread::Builder::new().name("control-events".into()).spawn(move || loop {
            watching.tick();
            std::thread::sleep(hub::TICK);
        })?;
        Ok(ControlServer { path: path.to_path_buf(), hub })
    }

    /// Before the process ends: waits (at most [`LINGER`]) until no reply
    /// is half done and the events of the VM's last changes are sent; after
    /// a migration (`migrated`), also until every session that started or
    /// followed it has been told how it ended, and at least one client
    /// has (so that one can still ask after the fact).
    pub fn drain(&self, migrated: bool) {
        self.hub.drain(migrated, LINGER);
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests;
