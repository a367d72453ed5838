//! One connection: the greeting, bounded request lines, and the form the
//! first request picks.

use std::io::{BufRead, BufReader, ErrorKind};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use serde_json::{json, Value};

use super::hub::{Hub, Session};
use super::{qmp, MAX_REQUEST};

/// A request line, or what is left of one over the limit.
#[derive(Debug, PartialEq, Eq)]
pub enum Line {
    /// Up to [`MAX_REQUEST`] bytes, without the newline.
    Text(Vec<u8>),
    /// A longer line, skipped up to its newline: its length.
    TooLong(usize),
}

/// Reads the next line of at most `max` bytes; a longer one is read to
/// its end and dropped, so the next line starts where it should. `None`
/// at the end of the stream.
pub fn read_line(reader: &mut impl BufRead, max: usize) -> std::io::Result<Option<Line>> {
    let mut text = Vec::new();
    let mut length = 0usize;
    loop {
        let available = match reader.fill_buf() {
            Ok(available) => available,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if available.is_empty() {
            return Ok(match length {
                0 => None,
                _ if length > max => Some(Line::TooLong(length)),
                _ => Some(Line::Text(text)),
            });
        }
        let (chunk, newline) = match available.iter().position(|&b| b == b'\n') {
            Some(i) => (&available[..i], true),
            None => (available, false),
        };
        length += chunk.len();
        if length <= max {
            text.extend_from_slice(chunk);
        } else if !text.is_empty() {
            text = Vec::new();
        }
        let used = chunk.len() + usize::from(newline);
        reader.consume(used);
        if newline {
            return Ok(Some(if length > max { Line::TooLong(length) } else { Line::Text(text) }));
        }
    }
}

/// The form a session speaks, picked by its first request.
enum Form {
    Undecided,
    /// `{"cmd":...}` → `{"ok":...}`.
    Tsubame,
    /// `{"execute":...}`; true once `qmp_capabilities` was sent.
    Qmp(bool),
}

/// Serves one connection until it closes.
pub fn serve(stream: UnixStream, hub: Arc<Hub>) {
    let Ok(writer) = stream.try_clone() else { return };
    let session = Arc::new(Session::new(writer));
    if !session.send(&qmp::greeting()) {
        return;
    }
    hub.add(session.clone());
    let mut reader = BufReader::new(stream);
    let mut form = Form::Undecided;
    while let Ok(Some(line)) = read_line(&mut reader, MAX_REQUEST) {
        if matches!(&line, Line::Text(text) if text.iter().all(u8::is_ascii_whitespace)) {
            continue;
        }
        hub.busy();
        let (reply, ended) = answer(&hub, &session, &mut form, line);
        let sent = session.send(&reply);
        if sent && ended {
            hub.told_end(&session);
        }
        if matches!(form, Form::Qmp(true)) {
            // Events only after the reply that ends the negotiation.
            session.events.store(true, Ordering::Release);
        }
        hub.done();
        if !sent {
            break;
        }
    }
    hub.remove(&session);
}

/// The reply to one line, and whether it says how a migration ended.
fn answer(hub: &Hub, session: &Session, form: &mut Form, line: Line) -> (Value, bool) {
    let qmp = matches!(form, Form::Qmp(_));
    let request = match line {
        Line::TooLong(length) => {
            let desc = format!("request line of {length} bytes is over the limit of {MAX_REQUEST}; skipped");
            return (if qmp { qmp::error("GenericError", desc) } else { tsubame_error(desc) }, false);
        }
        Line::Text(text) => match serde_json::from_slice::<Value>(&text) {
            Ok(request) => request,
            Err(e) if qmp => return (qmp::error("GenericError", format!("JSON parse error: {e}")), false),
            Err(e) => return (tsubame_error(format!("request is not JSON: {e}")), false),
        },
    };
    if matches!(form, Form::Undecided) {
        if request.get("execute").is_some() {
            *form = Form::Qmp(false);
        } else if request.get("cmd").is_some() {
            *form = Form::Tsubame;
        }
    }
    match form {
        Form::Qmp(negotiated) => qmp::execute(hub, session, negotiated, &request),
        Form::Tsubame | Form::Undecided => tsubame_request(hub, session, &request),
    }
}

/// `{"cmd":...}`: the handler's fields with `"ok":true`, or the error.
fn tsubame_request(hub: &Hub, session: &Session, request: &Value) -> (Value, bool) {
    let Some(cmd) = request.get("cmd").and_then(Value::as_str) else {
        return (tsubame_error("request has no \"cmd\" string".into()), false);
    };
    match hub.call(session, cmd, request) {
        Ok(mut fields) => {
            let ended = cmd == "query-migrate" && qmp::ended(&fields);
            if let Some(obj) = fields.as_object_mut() {
                obj.insert("ok".into(), Value::Bool(true));
                (fields, ended)
            } else {
                (json!({"ok": true, "return": fields}), ended)
            }
        }
        Err(error) => (tsubame_error(error), false),
    }
}

fn tsubame_error(error: String) -> Value {
    json!({"ok": false, "error": error})
}
