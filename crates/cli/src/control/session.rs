//! One connection: the greeting, bounded request lines, and the form the
//! first request picks.

use std::io::{BufRead, BufReader, ErrorKind};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use serde_json::{json, Value};

use super::hub::{Hub, Session};
use super::qmp;

/// Longest request line accepted.
pub const MAX_REQUEST: usize = 64 * 1024;

/// A request, or what is left of one over the limit.
#[derive(Debug, PartialEq, Eq)]
pub enum Line {
    /// Up to [`MAX_REQUEST`] bytes: a JSON value, or a line that is none.
    Text(Vec<u8>),
    /// A longer request, skipped to its end: its length.
    TooLong(usize),
}

/// Where the reader is in a request.
enum Shape {
    /// Between requests: whitespace is skipped.
    Between,
    /// In an object or array: it ends where its brackets balance (QMP
    /// clients send values back to back, without newlines, as QEMU
    /// accepts), or at a newline where it can no longer be JSON.
    Value { depth: usize, in_string: bool, escape: bool },
    /// Anything else ends at the newline.
    Line,
}

/// Reads the next request of at most `max` bytes: a JSON object or
/// array (one per line in tsubame's form; back to back in QMP's), or a
/// line of something else (an error for the caller to report). A longer
/// one is read to its end (its brackets' balance or the newline, whichever
/// comes first) and dropped, so the next request starts where it should.
/// `None` at the end of the stream.
pub fn read_line(reader: &mut impl BufRead, max: usize) -> std::io::Result<Option<Line>> {
    let mut text = Vec::new();
    let mut length = 0usize;
    let mut shape = Shape::Between;
    let finish = |text: Vec<u8>, length: usize| if length > max { Line::TooLong(length) } else { Line::Text(text) };
    loop {
        let available = match reader.fill_buf() {
            Ok(available) => available,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if available.is_empty() {
            return Ok((length > 0).then(|| finish(text, length)));
        }
        let mut used = 0;
        let mut done = false;
        for &byte in available {
            used += 1;
            match &mut shape {
                Shape::Between if byte.is_ascii_whitespace() => continue,
                Shape::Between => {
                    shape = if matches!(byte, b'{' | b'[') {
                        Shape::Value { depth: 0, in_string: false, escape: false }
                    } else {
                        Shape::Line
                    }
                }
                _ => {}
            }
            if byte != b'\n' || !matches!(shape, Shape::Line) {
                length += 1;
                if length <= max {
                    text.push(byte);
                } else if !text.is_empty() {
                    text = Vec::new();
                }
            }
            done = match &mut shape {
                Shape::Line => byte == b'\n',
                Shape::Value { escape, in_string: true, .. } if *escape => {
                    *escape = false;
                    false
                }
                Shape::Value { escape, in_string: true, .. } if byte == b'\\' => {
                    *escape = true;
                    false
                }
                Shape::Value { in_string, .. } if byte == b'"' => {
                    *in_string = !*in_string;
                    false
                }
                Shape::Value { depth, in_string: false, .. } if matches!(byte, b'{' | b'[') => {
                    *depth += 1;
                    false
                }
                Shape::Value { depth, in_string: false, .. } if matches!(byte, b'}' | b']') => {
                    *depth -= 1;
                    *depth == 0
                }
                // A newline inside a value: go on while what came is the
                // start of some JSON (a value over several lines).
                Shape::Value { .. } if byte == b'\n' => {
                    length > max
                        || serde_json::from_slice::<serde::de::IgnoredAny>(&text)
                            .is_err_and(|e| e.classify() != serde_json::error::Category::Eof)
                }
                _ => false,
            };
            if done {
                break;
            }
        }
        reader.consume(used);
        if done {
            return Ok(Some(finish(text, length)));
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
        if matches!(form, Form::Qmp(true)) && !session.events.swap(true, Ordering::AcqRel) {
            // Events only after the reply that ends the negotiation.
            hub.watch();
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
