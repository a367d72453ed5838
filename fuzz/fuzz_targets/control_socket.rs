//! The control socket as a client meets it: the fuzzer's bytes go down a
//! real connection to a real `ControlServer` (crates/cli/src/control,
//! compiled in as it stands through `#[path]`: crates/cli has no library),
//! which reads them as requests (bounded lines, JSON values back to back),
//! picks the session's form, negotiates QMP, maps QEMU's commands onto the
//! handler's, keeps `migrate-set-parameters`, and sends replies and
//! events. The handler stands in for a running VM: `migrate` runs the real
//! request parser (`request.rs`: `MigrateRequest::parse` and `options`)
//! and migrates nothing; `stop`/`cont` change the state the events are made
//! from; `query-migrate` hands the last migrate request back as a finished
//! migration's statistics, so that QMP's reply shaping reads odd JSON too.
//! Every reply is read to the end of the connection. A panic on any of
//! the server's threads aborts the process (libfuzzer-sys's panic hook).
#![no_main]

#[allow(dead_code, unused_imports)]
#[path = "../../crates/cli/src/control/mod.rs"]
mod control;
#[allow(dead_code)]
#[path = "../../crates/cli/src/request.rs"]
mod request;

use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use libfuzzer_sys::fuzz_target;
use serde_json::{json, Value};

use control::{ControlHandler, ControlServer, VmState};

#[derive(Default)]
struct FakeVm {
    running: Mutex<bool>,
    last_migrate: Mutex<Option<Value>>,
}

impl ControlHandler for FakeVm {
    fn handle(&self, cmd: &str, request: &Value) -> Result<Value, String> {
        match cmd {
            "migrate" => {
                let mut request = request.clone();
                if let Some(object) = request.as_object_mut() {
                    // Reading files the fuzzer names is not the parser's work.
                    for key in ["psk_file", "tls_cert", "tls_key", "tls_ca"] {
                        object.remove(key);
                    }
                }
                let (to, _options) = request::MigrateRequest::parse(&request)?.options()?;
                *self.last_migrate.lock().unwrap() = Some(request);
                Ok(json!({"to": to.to_string()}))
            }
            "query-migrate" => Ok(match self.last_migrate.lock().unwrap().clone() {
                Some(stats) => json!({"status": "completed", "stats": stats}),
                None => json!({}),
            }),
            "pause" | "resume" => {
                *self.running.lock().unwrap() = cmd == "resume";
                Ok(json!({}))
            }
            "query-status" | "stats" | "query-memory" | "quit" => {
                Ok(json!({"status": "running", "running": *self.running.lock().unwrap()}))
            }
            other => Err(format!("unknown command {other:?}")),
        }
    }

    fn state(&self) -> Option<VmState> {
        let migration = self.last_migrate.lock().unwrap().as_ref().map(|_| (1, "completed"));
        Some(VmState { running: *self.running.lock().unwrap(), migration })
    }
}

/// One server for the whole run (its threads serve each connection).
fn socket() -> &'static PathBuf {
    static SERVER: OnceLock<(PathBuf, ControlServer)> = OnceLock::new();
    &SERVER
        .get_or_init(|| {
            let path = std::env::temp_dir().join(format!("tsubame-fuzz-control-{}.sock", std::process::id()));
            let vm = FakeVm { running: Mutex::new(true), ..Default::default() };
            let server = ControlServer::start(&path, Arc::new(vm)).expect("control socket");
            (path, server)
        })
        .0
}

fuzz_target!(|data: &[u8]| {
    let mut client = UnixStream::connect(socket()).expect("connect");
    let mut reader = client.try_clone().expect("clone");
    // Replies are read while the requests go, so neither side's buffer
    // fills up and stops the other.
    let replies = std::thread::spawn(move || {
        let mut all = Vec::new();
        let _ = reader.read_to_end(&mut all);
        all
    });
    let _ = client.write_all(data);
    let _ = client.shutdown(Shutdown::Write);
    let all = replies.join().expect("reader");
    // The greeting always comes first.
    assert!(all.starts_with(b"{\"QMP\""), "no greeting: {:?}", String::from_utf8_lossy(&all));
});
