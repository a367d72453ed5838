//! What the sessions share: the handler, the list of sessions, the
//! events made from the VM's state, and the wait before the process ends.
//!
//! Events come from polling: every [`TICK`] the handler's [`VmState`] is
//! compared with the last one, and each change becomes QMP events for the
//! sessions that negotiated QMP. A migration state shorter than a tick
//! is still reported: the steps QEMU would have reported on the way
//! (`setup`, `active`) are filled in, in order.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Map, Value};

use super::handler::{ControlHandler, VmState};

/// How often the VM's state is looked at for events.
pub const TICK: Duration = Duration::from_millis(10);

/// A client that does not read its events for this long is dropped.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// One connection.
pub struct Session {
    writer: Mutex<UnixStream>,
    /// QMP negotiated: events go to it.
    pub events: AtomicBool,
    /// It started (or resumed, or asked about) the current migration.
    pub follows: AtomicBool,
    /// It has been sent how that migration ended.
    pub told_end: AtomicBool,
    closed: AtomicBool,
}

impl Session {
    /// A session writing to `writer`.
    pub fn new(writer: UnixStream) -> Session {
        let _ = writer.set_write_timeout(Some(WRITE_TIMEOUT));
        Session {
            writer: Mutex::new(writer),
            events: AtomicBool::new(false),
            follows: AtomicBool::new(false),
            told_end: AtomicBool::new(false),
            closed: AtomicBool::new(false),
        }
    }

    /// Writes one line (a reply or an event, never interleaved); false
    /// once the connection is gone.
    pub fn send(&self, value: &Value) -> bool {
        if self.closed.load(Ordering::Acquire) {
            return false;
        }
        let mut text = value.to_string();
        text.push('\n');
        let mut writer = self.writer.lock().unwrap();
        if writer.write_all(text.as_bytes()).and_then(|()| writer.flush()).is_err() {
            self.close();
            return false;
        }
        true
    }

    /// Marks it gone (and wakes its reader).
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        if let Ok(writer) = self.writer.try_lock() {
            let _ = writer.shutdown(std::net::Shutdown::Both);
        }
    }

    fn waiting_for_end(&self) -> bool {
        !self.closed.load(Ordering::Acquire)
            && self.follows.load(Ordering::Acquire)
            && !self.told_end.load(Ordering::Acquire)
    }
}

/// The shared part of a control server.
pub struct Hub {
    /// What answers the commands.
    pub handler: Arc<dyn ControlHandler>,
    sessions: Mutex<Vec<Arc<Session>>>,
    /// The state the last events were made from (also the tick's lock);
    /// the outer None while no session takes events (nothing is looked at
    /// then: the VM's state is read under the migration's lock, and in a
    /// stop every wake-up on this host's two CPUs counts).
    last: Mutex<Option<Option<VmState>>>,
    in_flight: AtomicUsize,
    /// Some client has been sent how the latest migration ended.
    end_told: AtomicBool,
    /// `migrate-set-parameters`, as migrate request keys.
    pub parameters: Mutex<Map<String, Value>>,
}

impl Hub {
    /// A hub for `handler`; the state it starts from makes no events.
    pub fn new(handler: Arc<dyn ControlHandler>) -> Hub {
        Hub {
            handler,
            sessions: Mutex::new(Vec::new()),
            last: Mutex::new(None),
            in_flight: AtomicUsize::new(0),
            end_told: AtomicBool::new(false),
            parameters: Mutex::new(Map::new()),
        }
    }

    /// Adds a connection.
    pub fn add(&self, session: Arc<Session>) {
        self.sessions.lock().unwrap().push(session);
    }

    /// Removes a connection that ended.
    pub fn remove(&self, session: &Arc<Session>) {
        session.closed.store(true, Ordering::Release);
        self.sessions.lock().unwrap().retain(|s| !Arc::ptr_eq(s, session));
    }

    /// A request is being answered (until [`Hub::done`]).
    pub fn busy(&self) {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
    }

    /// Its reply is written (or the connection is gone).
    pub fn done(&self) {
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
    }

    /// Calls the handler for `session`, keeping track of who follows a
    /// migration: `migrate` and `migrate-resume` make the session a
    /// follower, and a new migration has not ended for anyone yet.
    pub fn call(&self, session: &Session, cmd: &str, request: &Value) -> Result<Value, String> {
        let result = self.handler.handle(cmd, request);
        if result.is_ok() && matches!(cmd, "migrate" | "migrate-resume") {
            if cmd == "migrate" {
                self.end_told.store(false, Ordering::Release);
            }
            session.told_end.store(false, Ordering::Release);
            session.follows.store(true, Ordering::Release);
        }
        result
    }

    /// After `session` was sent a reply or event saying how the migration
    /// ended.
    pub fn told_end(&self, session: &Session) {
        session.told_end.store(true, Ordering::Release);
        self.end_told.store(true, Ordering::Release);
    }

    /// A session now takes events: changes from here on are sent.
    pub fn watch(&self) {
        let mut last = self.last.lock().unwrap();
        if last.is_none() {
            *last = Some(self.handler.state());
        }
    }

    /// Compares the VM's state with the last one and sends the events.
    /// While no session takes events the state is not read; [`Hub::watch`]
    /// takes the state a session's events start from.
    pub fn tick(&self) {
        let mut last = self.last.lock().unwrap();
        let sessions: Vec<Arc<Session>> =
            self.sessions.lock().unwrap().iter().filter(|s| s.events.load(Ordering::Acquire)).cloned().collect();
        if sessions.is_empty() {
            *last = None;
            return;
        }
        let now = self.handler.state();
        let Some(before) = last.replace(now.clone()) else { return };
        if before == now {
            return;
        }
        let events = transitions(before.as_ref(), now.as_ref());
        for (name, data) in events {
            let ended = name == "MIGRATION" && matches!(data["status"].as_str(), Some("completed" | "failed"));
            let event = event(name, data);
            for session in &sessions {
                if session.send(&event) && ended {
                    self.told_end(session);
                }
            }
        }
    }

    /// See [`super::ControlServer::drain`].
    pub fn drain(&self, migrated: bool, linger: Duration) {
        let deadline = Instant::now() + linger;
        loop {
            self.tick();
            let replies_out = self.in_flight.load(Ordering::Acquire) == 0;
            let told = !migrated
                || (self.end_told.load(Ordering::Acquire)
                    && !self.sessions.lock().unwrap().iter().any(|s| s.waiting_for_end()));
            if (replies_out && told) || Instant::now() >= deadline {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// A QMP event with the time now.
pub fn event(name: &str, data: Value) -> Value {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    json!({
        "event": name,
        "data": data,
        "timestamp": {"seconds": now.as_secs(), "microseconds": now.subsec_micros()},
    })
}

/// The events between two states, in the order QEMU sends them: STOP
/// before the migration's news, RESUME after.
pub fn transitions(before: Option<&VmState>, after: Option<&VmState>) -> Vec<(&'static str, Value)> {
    let mut events = Vec::new();
    let Some(after) = after else { return events };
    let was_running = before.is_some_and(|b| b.running);
    if was_running && !after.running {
        events.push(("STOP", json!({})));
    }
    let previous = before.and_then(|b| b.migration);
    if let Some((id, status)) = after.migration {
        if previous != Some((id, status)) {
            // Where this migration was seen last: nowhere if it is new.
            let from = previous.filter(|(p, _)| *p == id).map(|(_, s)| step(s));
            let to = step(status);
            let mut missed = Vec::new();
            if from.is_none() && status != "setup" {
                missed.push("setup");
            }
            if from.unwrap_or(0) < 1 && to >= 2 && status != "failed" {
                missed.push("active");
            }
            for s in missed.into_iter().chain([status]) {
                events.push(("MIGRATION", json!({"status": s})));
            }
        }
    }
    if !was_running && after.running {
        events.push(("RESUME", json!({})));
    }
    events
}

/// A migration status's place on QEMU's way through them.
fn step(status: &str) -> u8 {
    match status {
        "setup" => 0,
        "active" => 1,
        "postcopy-active" | "postcopy-paused" => 2,
        _ => 3, // completed, failed
    }
}
