//! The control socket's sessions, both forms, without a VM.

use std::io::{BufRead, BufReader, Cursor, Write};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};

use super::hub::transitions;
use super::session::{read_line, Line, MAX_REQUEST};
use super::*;

/// A handler with a pretend VM: `pause`/`resume` flip `running`,
/// `migrate` starts migration 1 in `setup`.
struct Fake {
    state: Mutex<VmState>,
    asked: Mutex<Value>,
}

impl ControlHandler for Fake {
    fn handle(&self, cmd: &str, request: &Value) -> Result<Value, String> {
        let mut state = self.state.lock().unwrap();
        match cmd {
            "stats" => Ok(json!({"ops": 7})),
            "query-status" => Ok(json!({"running": state.running, "status": "running"})),
            "pause" => {
                state.running = false;
                Ok(json!({}))
            }
            "resume" => {
                state.running = true;
                Ok(json!({}))
            }
            "migrate" => {
                let to = request.get("to").and_then(Value::as_str).ok_or("migrate needs \"to\"")?;
                state.migration = Some((1, "setup"));
                *self.asked.lock().unwrap() = request.clone();
                Ok(json!({"to": to, "request": request}))
            }
            "query-migrate" => Ok(match state.migration {
                Some((_, "completed")) => json!({"status": "completed", "stats": {"total_time_ms": 12.0}}),
                Some(_) => json!({"status": "active", "progress": {"phase": "iterating"}}),
                None => json!({"status": "none"}),
            }),
            other => Err(format!("unknown command '{other}'")),
        }
    }

    fn state(&self) -> Option<VmState> {
        Some(self.state.lock().unwrap().clone())
    }
}

struct Conn {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Conn {
    fn open(path: &std::path::Path) -> Conn {
        let stream = UnixStream::connect(path).unwrap();
        stream.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
        let mut conn = Conn { writer: stream.try_clone().unwrap(), reader: BufReader::new(stream) };
        assert_eq!(conn.read()["QMP"]["version"]["package"], concat!("tsubame ", env!("CARGO_PKG_VERSION")));
        conn
    }

    fn send(&mut self, text: &str) {
        self.writer.write_all(text.as_bytes()).unwrap();
        self.writer.write_all(b"\n").unwrap();
    }

    fn read(&mut self) -> Value {
        let mut line = String::new();
        self.reader.read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"))
    }

    fn ask(&mut self, text: &str) -> Value {
        self.send(text);
        self.read()
    }
}

fn server(name: &str) -> (ControlServer, Arc<Fake>, std::path::PathBuf) {
    let path = std::env::temp_dir().join(format!("tsubame-ctl-{name}-{}", std::process::id()));
    let fake = Arc::new(Fake {
        state: Mutex::new(VmState { running: true, migration: None }),
        asked: Mutex::new(Value::Null),
    });
    (ControlServer::start(&path, fake.clone()).unwrap(), fake, path)
}

#[test]
fn the_cmd_form_still_works_after_the_greeting() {
    let (_server, _, path) = server("cmd");
    let mut client = ControlClient::connect(&path).unwrap();
    assert_eq!(client.request(&json!({"cmd": "stats"})).unwrap()["ops"], 7);
    let err = client.request(&json!({"cmd": "nope"})).unwrap_err();
    assert!(err.to_string().contains("unknown command 'nope'"));
    let err = client.request(&json!({"nocmd": 1})).unwrap_err();
    assert!(err.to_string().contains("no \"cmd\""));
    // An "execute" line in a {"cmd"} session is not QMP.
    let err = client.request(&json!({"execute": "stop"})).unwrap_err();
    assert!(err.to_string().contains("no \"cmd\""));
}

#[test]
fn bad_lines_get_one_error_each_and_the_session_goes_on() {
    let (_server, _, path) = server("bad");
    for qmp in [false, true] {
        let mut conn = Conn::open(&path);
        let good = if qmp { r#"{"execute":"query-status","id":"g"}"# } else { r#"{"cmd":"stats"}"# };
        if qmp {
            assert_eq!(conn.ask(r#"{"execute":"qmp_capabilities"}"#), json!({"return": {}}));
        } else {
            assert_eq!(conn.ask(good)["ops"], 7);
        }
        let long = format!("{{\"cmd\":\"stats\",\"pad\":\"{}\"}}", "x".repeat(MAX_REQUEST + 10));
        for bad in [long.as_str(), "{not json", r#"{"execute":"no-such"}"#, r#"{"cmd":"no-such"}"#, "[1,2]"] {
            let reply = conn.ask(bad);
            if qmp {
                assert!(reply["error"]["desc"].is_string(), "{bad:.40}: {reply}");
            } else {
                assert_eq!(reply["ok"], false, "{bad:.40}: {reply}");
            }
            // Exactly one reply: the next good request gets the next line.
            let next = conn.ask(good);
            if qmp {
                assert_eq!(next, json!({"return": {"running": true, "status": "running"}, "id": "g"}));
            } else {
                assert_eq!(next["ops"], 7, "after {bad:.40}: {next}");
            }
        }
    }
}

#[test]
fn qmp_negotiates_first_and_maps_qemu_names() {
    let (_server, fake, path) = server("qmp");
    let mut conn = Conn::open(&path);
    let before = conn.ask(r#"{"execute":"query-status","id":1}"#);
    assert_eq!(before["error"]["class"], "CommandNotFound", "{before}");
    assert_eq!(before["id"], 1);
    assert_eq!(conn.ask(r#"{"execute":"qmp_capabilities"}"#), json!({"return": {}}));
    let again = conn.ask(r#"{"execute":"qmp_capabilities"}"#);
    assert_eq!(again["error"]["class"], "CommandNotFound");
    assert_eq!(conn.ask(r#"{"execute":"no-such","id":2}"#)["error"]["class"], "CommandNotFound");
    let missing = conn.ask(r#"{"execute":"migrate","arguments":{}}"#);
    assert_eq!(missing["error"], json!({"class": "GenericError", "desc": "Parameter 'uri' is missing"}));
    let typed = conn.ask(r#"{"execute":"migrate","arguments":{"uri":5}}"#);
    assert!(typed["error"]["desc"].as_str().unwrap().contains("'uri'"), "{typed}");
    let extra = conn.ask(r#"{"execute":"stop","arguments":{"now":true}}"#);
    assert!(extra["error"]["desc"].as_str().unwrap().contains("'now'"), "{extra}");
    let bad = conn.ask(r#"{"execute":"migrate-set-parameters","arguments":{"downtime-limit":"x"}}"#);
    assert!(bad["error"]["desc"].as_str().unwrap().contains("integer"), "{bad}");
    let set = r#"{"execute":"migrate-set-parameters","arguments":{"downtime-limit":50,"max-bandwidth":1000}}"#;
    assert_eq!(conn.ask(set), json!({"return": {}}));
    let params = conn.ask(r#"{"execute":"query-migrate-parameters"}"#);
    assert_eq!(params["return"], json!({"downtime-limit": 50, "max-bandwidth": 1000}));
    assert_eq!(conn.ask(r#"{"execute":"query-migrate"}"#), json!({"return": {}}));

    // stop: a STOP event follows its reply.
    assert_eq!(conn.ask(r#"{"execute":"stop","id":"s"}"#), json!({"return": {}, "id": "s"}));
    let stop = conn.read();
    assert_eq!(stop["event"], "STOP", "{stop}");
    assert!(stop["timestamp"]["seconds"].as_u64().unwrap() > 0);
    assert_eq!(conn.ask(r#"{"execute":"cont"}"#), json!({"return": {}}));
    assert_eq!(conn.read()["event"], "RESUME");

    // migrate: uri is "to", the parameters are defaults, extras pass.
    let migrate = r#"{"execute":"migrate","arguments":{"uri":"unix:/x","channels":2},"id":3}"#;
    assert_eq!(conn.ask(migrate), json!({"return": {}, "id": 3}));
    let setup = conn.read();
    assert_eq!((setup["event"].as_str(), setup["data"]["status"].as_str()), (Some("MIGRATION"), Some("setup")));
    let asked = fake.asked.lock().unwrap().clone();
    assert_eq!(
        asked,
        json!({"cmd": "migrate", "to": "unix:/x", "channels": 2, "downtime_limit_ms": 50, "max_bandwidth": 1000})
    );
    fake.state.lock().unwrap().migration = Some((1, "completed"));
    for status in ["active", "completed"] {
        let event = conn.read();
        assert_eq!((event["event"].as_str(), event["data"]["status"].as_str()), (Some("MIGRATION"), Some(status)));
    }
    let done = conn.ask(r#"{"execute":"query-migrate"}"#);
    assert_eq!(done["return"]["status"], "completed");
    assert_eq!(done["return"]["total-time"], 12);
}

#[test]
fn requests_end_where_their_json_or_their_line_ends() {
    let text = format!(
        "{{\"a\":\"{}\"}}\nshort\n{{\"x\":1}}{{\"y\":\"}}\\\"\"}} \r\n{{\"z\":\n[2]}}\n{{not json\n{{\"w\":3}}\n[\"{}\n{}",
        "a".repeat(20),
        "b".repeat(20),
        "c".repeat(7)
    );
    let mut reader = BufReader::with_capacity(4, Cursor::new(text));
    let mut next = || read_line(&mut reader, 12).unwrap();
    assert_eq!(next(), Some(Line::TooLong(28)));
    assert_eq!(next(), Some(Line::Text(b"short".to_vec())));
    assert_eq!(next(), Some(Line::Text(br#"{"x":1}"#.to_vec())), "back to back, no newline");
    assert_eq!(next(), Some(Line::Text(br#"{"y":"}\""}"#.to_vec())), "brackets in strings");
    assert_eq!(next(), Some(Line::Text(b"{\"z\":\n[2]}".to_vec())), "over two lines");
    assert_eq!(next(), Some(Line::Text(b"{not json\n".to_vec())), "bad JSON ends at its newline");
    assert_eq!(next(), Some(Line::Text(br#"{"w":3}"#.to_vec())));
    assert_eq!(next(), Some(Line::TooLong(23)), "too long, unbalanced: up to the newline");
    assert_eq!(next(), Some(Line::Text(b"ccccccc".to_vec())));
    assert_eq!(next(), None);
}

#[test]
fn short_migration_states_are_filled_in_in_order() {
    let state = |running, migration| Some(VmState { running, migration });
    let names = |before, after| -> Vec<String> {
        transitions(Option::as_ref(&before), Option::as_ref(&after))
            .into_iter()
            .map(|(name, data)| match data["status"].as_str() {
                Some(status) => format!("{name} {status}"),
                None => name.to_string(),
            })
            .collect()
    };
    let none: Option<VmState> = None;
    assert!(names(none.clone(), state(true, None)) == ["RESUME"]);
    assert!(
        names(state(true, None), state(false, Some((1, "completed"))))
            == ["STOP", "MIGRATION setup", "MIGRATION active", "MIGRATION completed"]
    );
    assert!(names(state(true, Some((1, "active"))), state(true, Some((1, "failed")))) == ["MIGRATION failed"]);
    assert!(names(state(true, None), state(true, Some((1, "failed")))) == ["MIGRATION setup", "MIGRATION failed"]);
    // A second migration that fails like the first is news.
    assert!(
        names(state(true, Some((1, "failed"))), state(true, Some((2, "failed"))))
            == ["MIGRATION setup", "MIGRATION failed"]
    );
    assert!(
        names(state(false, Some((1, "active"))), state(false, Some((1, "postcopy-active"))))
            == ["MIGRATION postcopy-active"]
    );
}
