//! QMP, as QEMU speaks it, mapped onto tsubame's commands.
//!
//! `{"execute": NAME, "arguments": {...}, "id": X}` is answered with
//! `{"return": ..., "id": X}` or `{"error": {"class", "desc"}, "id": X}`.
//! Until `qmp_capabilities` every command is refused (CommandNotFound),
//! as QEMU does. QEMU's names map onto ours:
//!
//! | QMP | tsubame |
//! |---|---|
//! | `query-status` | `query-status` |
//! | `stop`, `cont`, `quit` | `pause`, `resume`, `quit` |
//! | `migrate` (`uri`, any `migrate` key of ours, `resume`) | `migrate` (`to`), `migrate-resume` |
//! | `query-migrate` | `query-migrate`, in QEMU's shape |
//! | `migrate-set-parameters` (`downtime-limit`, `max-bandwidth`) | defaults of later `migrate`s |
//! | `stats`, `query-memory`, `trace`, `pmemsave` | the same, `arguments` as the request's keys |

use serde_json::{json, Map, Value};
use tsubame_migrate::protocol::SourceState;

use super::hub::{Hub, Session};

/// QEMU's longest downtime limit, in milliseconds.
const MAX_DOWNTIME_LIMIT_MS: u64 = 2_000_000;

/// The commands a negotiated session may send.
const COMMANDS: &[&str] = &[
    "qmp_capabilities",
    "query-version",
    "query-commands",
    "query-status",
    "stop",
    "cont",
    "quit",
    "migrate",
    "query-migrate",
    "migrate-set-parameters",
    "query-migrate-parameters",
    "stats",
    "query-memory",
    "trace",
    "pmemsave",
];

/// The line every connection starts with.
pub fn greeting() -> Value {
    json!({"QMP": {"version": version(), "capabilities": []}})
}

fn version() -> Value {
    json!({
        "qemu": {"micro": 0, "minor": 0, "major": 0},
        "package": concat!("tsubame ", env!("CARGO_PKG_VERSION")),
    })
}

/// A QMP error reply (without its id).
pub fn error(class: &str, desc: impl Into<String>) -> Value {
    json!({"error": {"class": class, "desc": desc.into()}})
}

/// The QEMU status of a migration in `phase`.
pub fn migration_status(phase: SourceState) -> &'static str {
    match phase {
        SourceState::Setup => "setup",
        SourceState::Postcopy => "postcopy-active",
        SourceState::PostcopyPaused => "postcopy-paused",
        SourceState::Completed => "completed",
        SourceState::Failed => "failed",
        _ => "active",
    }
}

/// True when a `query-migrate` reply (tsubame's) says how a migration ended.
pub fn ended(reply: &Value) -> bool {
    matches!(reply.get("status").and_then(Value::as_str), Some("completed" | "failed"))
}

/// A refused request: the QMP error class and what was wrong.
struct Refusal(&'static str, String);

fn generic(desc: impl Into<String>) -> Refusal {
    Refusal("GenericError", desc.into())
}

fn unexpected(key: &str) -> Refusal {
    generic(format!("Parameter '{key}' is unexpected"))
}

fn wrong_type(key: &str, expected: &str) -> Refusal {
    generic(format!("Invalid parameter type for '{key}', expected: {expected}"))
}

/// Answers one QMP request (any JSON value), and says whether the reply
/// tells how a migration ended.
pub fn execute(hub: &Hub, session: &Session, negotiated: &mut bool, request: &Value) -> (Value, bool) {
    let outcome = parse(request).and_then(|(name, arguments)| {
        if !*negotiated && name != "qmp_capabilities" {
            return Err(Refusal(
                "CommandNotFound",
                "Expecting capabilities negotiation with 'qmp_capabilities'".into(),
            ));
        }
        run(hub, session, negotiated, name, arguments)
    });
    let (mut reply, ended) = match outcome {
        Ok((value, ended)) => (json!({"return": value}), ended),
        Err(Refusal(class, desc)) => (error(class, desc), false),
    };
    if let Some(id) = request.get("id") {
        reply["id"] = id.clone();
    }
    (reply, ended)
}

/// The command's name and arguments, checked as QEMU checks them.
fn parse(request: &Value) -> Result<(&str, Map<String, Value>), Refusal> {
    let Some(object) = request.as_object() else {
        return Err(generic("QMP input must be a JSON object"));
    };
    if let Some(key) = object.keys().find(|k| !matches!(k.as_str(), "execute" | "arguments" | "id")) {
        return Err(generic(format!("QMP input member '{key}' is unexpected")));
    }
    let name = match object.get("execute") {
        Some(Value::String(name)) => name.as_str(),
        Some(_) => return Err(generic("QMP input member 'execute' must be a string")),
        None => return Err(generic("QMP input lacks member 'execute'")),
    };
    let arguments = match object.get("arguments") {
        None => Map::new(),
        Some(Value::Object(arguments)) => arguments.clone(),
        Some(_) => return Err(generic("QMP input member 'arguments' must be an object")),
    };
    Ok((name, arguments))
}

fn no_arguments(arguments: &Map<String, Value>) -> Result<(), Refusal> {
    match arguments.keys().next() {
        Some(key) => Err(unexpected(key)),
        None => Ok(()),
    }
}

/// Calls tsubame's `cmd` with `request`'s keys.
fn call(hub: &Hub, session: &Session, cmd: &str, mut request: Map<String, Value>) -> Result<Value, Refusal> {
    request.insert("cmd".into(), Value::String(cmd.into()));
    hub.call(session, cmd, &Value::Object(request)).map_err(generic)
}

fn run(
    hub: &Hub,
    session: &Session,
    negotiated: &mut bool,
    name: &str,
    mut arguments: Map<String, Value>,
) -> Result<(Value, bool), Refusal> {
    let value = match name {
        "qmp_capabilities" => {
            if *negotiated {
                return Err(Refusal(
                    "CommandNotFound",
                    "Capabilities negotiation is already complete, command ignored".into(),
                ));
            }
            match arguments.remove("enable") {
                None => {}
                Some(Value::Array(wanted)) => {
                    if let Some(capability) = wanted.first() {
                        return Err(generic(format!("Capability {capability} not available")));
                    }
                }
                Some(_) => return Err(wrong_type("enable", "array")),
            }
            no_arguments(&arguments)?;
            *negotiated = true;
            json!({})
        }
        "query-version" => {
            no_arguments(&arguments)?;
            version()
        }
        "query-commands" => {
            no_arguments(&arguments)?;
            COMMANDS.iter().map(|name| json!({"name": name})).collect()
        }
        "query-status" | "stop" | "cont" | "quit" => {
            no_arguments(&arguments)?;
            let cmd = match name {
                "stop" => "pause",
                "cont" => "resume",
                other => other,
            };
            call(hub, session, cmd, Map::new())?
        }
        "query-migrate" => {
            no_arguments(&arguments)?;
            let reply = call(hub, session, "query-migrate", Map::new())?;
            return Ok((query_migrate(&reply), ended(&reply)));
        }
        "migrate" => migrate(hub, session, arguments)?,
        "migrate-set-parameters" => {
            set_parameters(hub, &arguments)?;
            json!({})
        }
        "query-migrate-parameters" => {
            no_arguments(&arguments)?;
            let parameters = hub.parameters.lock().unwrap();
            let default = tsubame_migrate::MigrateOptions::default().downtime_limit.as_millis() as u64;
            json!({
                "downtime-limit": parameters.get("downtime_limit_ms").and_then(Value::as_u64).unwrap_or(default),
                "max-bandwidth": parameters.get("max_bandwidth").and_then(Value::as_u64).unwrap_or(0),
            })
        }
        "stats" | "query-memory" | "trace" | "pmemsave" => {
            if arguments.contains_key("cmd") {
                return Err(unexpected("cmd"));
            }
            call(hub, session, name, arguments)?
        }
        other => return Err(Refusal("CommandNotFound", format!("The command {other} has not been found"))),
    };
    Ok((value, false))
}

/// `migrate`: `uri` is the destination; `resume: true` resumes a paused
/// post-copy (to `uri`); any other argument is a key of tsubame's own
/// migrate request, over the `migrate-set-parameters` defaults.
fn migrate(hub: &Hub, session: &Session, mut arguments: Map<String, Value>) -> Result<Value, Refusal> {
    let uri = match arguments.remove("uri") {
        Some(Value::String(uri)) => uri,
        Some(_) => return Err(wrong_type("uri", "string")),
        None => return Err(generic("Parameter 'uri' is missing")),
    };
    let mut flag = |key: &str| match arguments.remove(key) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(b),
        Some(_) => Err(wrong_type(key, "boolean")),
    };
    flag("detach")?; // a migration always runs detached here
    if flag("resume")? {
        no_arguments(&arguments)?;
        let request = Map::from_iter([("to".to_string(), Value::String(uri))]);
        call(hub, session, "migrate-resume", request)?;
        return Ok(json!({}));
    }
    for key in ["cmd", "to"] {
        if arguments.contains_key(key) {
            return Err(generic(format!("Parameter '{key}' is unexpected (the destination is 'uri')")));
        }
    }
    let mut request = hub.parameters.lock().unwrap().clone();
    request.extend(arguments);
    request.insert("to".into(), Value::String(uri));
    call(hub, session, "migrate", request)?;
    Ok(json!({}))
}

/// `migrate-set-parameters`: all checked before any is kept.
fn set_parameters(hub: &Hub, arguments: &Map<String, Value>) -> Result<(), Refusal> {
    let mut set = Map::new();
    for (key, value) in arguments {
        let number = value.as_u64().ok_or_else(|| wrong_type(key, "integer"));
        match key.as_str() {
            "downtime-limit" => {
                let ms = number?;
                if ms > MAX_DOWNTIME_LIMIT_MS {
                    return Err(generic(format!(
                        "Parameter 'downtime-limit' expects an integer in the range of 0 to {MAX_DOWNTIME_LIMIT_MS} milliseconds"
                    )));
                }
                set.insert("downtime_limit_ms".into(), ms.into());
            }
            "max-bandwidth" => {
                let rate = number?;
                set.insert("max_bandwidth".into(), if rate == 0 { Value::Null } else { rate.into() });
            }
            other => return Err(unexpected(other)),
        }
    }
    hub.parameters.lock().unwrap().extend(set);
    Ok(())
}

/// tsubame's `query-migrate` reply in QEMU's shape; all of ours rides
/// along as `x-tsubame-progress` or `x-tsubame-stats`.
pub fn query_migrate(reply: &Value) -> Value {
    let number = |v: &Value, key: &str| v.get(key).and_then(Value::as_f64).unwrap_or(0.0);
    match reply.get("status").and_then(Value::as_str) {
        Some("active") => {
            let progress = &reply["progress"];
            let phase = serde_json::from_value(progress["phase"].clone()).unwrap_or(SourceState::Iterating);
            json!({
                "status": migration_status(phase),
                "total-time": number(reply, "total_time_ms") as u64,
                "ram": {
                    "transferred": number(progress, "bytes_on_wire") as u64,
                    "remaining": number(progress, "remaining_pages") as u64 * tsubame_vmm::PAGE_SIZE as u64,
                    "total": number(progress, "memory_bytes") as u64,
                    "dirty-sync-count": number(progress, "iteration") as u64,
                    "mbps": number(progress, "bandwidth") * 8.0 / 1e6,
                },
                "x-tsubame-progress": progress,
            })
        }
        Some(status @ ("completed" | "failed")) => {
            let stats = &reply["stats"];
            let total_ms = number(stats, "total_time_ms");
            let bytes = number(stats, "bytes_on_wire");
            let (sent, zero) = (number(stats, "pages_sent") as u64, number(stats, "pages_zero") as u64);
            let mut out = json!({
                "status": status,
                "total-time": total_ms as u64,
                "downtime": number(stats, "downtime_ms") as u64,
                "setup-time": number(stats, "setup_time_ms") as u64,
                "expected-downtime": number(stats, "expected_downtime_ms") as u64,
                "ram": {
                    "transferred": bytes as u64,
                    "remaining": 0,
                    "total": number(stats, "memory_bytes") as u64,
                    "duplicate": zero,
                    "normal": sent.saturating_sub(zero),
                    "normal-bytes": sent.saturating_sub(zero) * tsubame_vmm::PAGE_SIZE as u64,
                    "dirty-sync-count": number(stats, "iterations") as u64,
                    "mbps": if total_ms > 0.0 { bytes * 8.0 / (total_ms / 1e3) / 1e6 } else { 0.0 },
                },
                "x-tsubame-stats": stats,
            });
            if let Some(error) = stats.get("error").and_then(Value::as_str) {
                out["error-desc"] = error.into();
            }
            out
        }
        // No migration yet: QEMU's reply is empty.
        _ => json!({}),
    }
}
