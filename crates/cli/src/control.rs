//! The control socket: JSON lines over a Unix socket, one request, one
//! reply, in the manner of QEMU's QMP.
//!
//! Request: `{"cmd":"stats"}`. Reply: `{"ok":true, ...}` or
//! `{"ok":false,"error":"..."}`.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

/// Longest request line accepted.
const MAX_REQUEST: usize = 64 * 1024;

/// Answers control requests.
pub trait ControlHandler: Send + Sync + 'static {
    /// Handles one command; `Ok` fields are merged into the reply.
    fn handle(&self, cmd: &str, request: &Value) -> Result<Value, String>;
}

/// A listening control socket; the file is removed on drop.
pub struct ControlServer {
    path: PathBuf,
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
        std::thread::Builder::new().name("control".into()).spawn(move || {
            for stream in listener.incoming().flatten() {
                let handler = handler.clone();
                let _ = std::thread::Builder::new().name("control-conn".into()).spawn(move || serve(stream, handler));
            }
        })?;
        Ok(ControlServer { path: path.to_path_buf() })
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn serve(stream: UnixStream, handler: Arc<dyn ControlHandler>) {
    let Ok(mut writer) = stream.try_clone() else { return };
    let mut reader = BufReader::new(stream).take(u64::MAX);
    loop {
        let mut line = String::new();
        reader.set_limit(MAX_REQUEST as u64);
        match reader.read_line(&mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let reply = match serde_json::from_str::<Value>(&line) {
            Err(e) => json!({"ok": false, "error": format!("request is not JSON: {e}")}),
            Ok(request) => match request.get("cmd").and_then(Value::as_str) {
                None => json!({"ok": false, "error": "request has no \"cmd\" string"}),
                Some(cmd) => match handler.handle(cmd, &request) {
                    Ok(mut fields) => {
                        if let Some(obj) = fields.as_object_mut() {
                            obj.insert("ok".into(), Value::Bool(true));
                            fields
                        } else {
                            json!({"ok": true, "return": fields})
                        }
                    }
                    Err(error) => json!({"ok": false, "error": error}),
                },
            },
        };
        let mut text = reply.to_string();
        text.push('\n');
        if writer.write_all(text.as_bytes()).is_err() {
            return;
        }
    }
}

/// A client connection to a control socket.
pub struct ControlClient {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl ControlClient {
    /// Connects to the socket at `path`.
    pub fn connect(path: &Path) -> anyhow::Result<ControlClient> {
        let stream = UnixStream::connect(path).map_err(|e| {
            anyhow::anyhow!(
                "cannot connect to control socket {}: {e} — is `tsubame run --control` running?",
                path.display()
            )
        })?;
        stream.set_read_timeout(Some(Duration::from_secs(60)))?;
        Ok(ControlClient { writer: stream.try_clone()?, reader: BufReader::new(stream) })
    }

    /// How long to wait for a reply (default 60 s).
    pub fn set_timeout(&mut self, timeout: Duration) -> anyhow::Result<()> {
        self.reader.get_ref().set_read_timeout(Some(timeout))?;
        Ok(())
    }

    /// Sends one request and returns the reply; `ok:false` becomes an error.
    pub fn request(&mut self, request: &Value) -> anyhow::Result<Value> {
        let mut text = request.to_string();
        text.push('\n');
        self.writer.write_all(text.as_bytes())?;
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            anyhow::bail!("control socket closed before replying");
        }
        let reply: Value = serde_json::from_str(&line)?;
        if reply.get("ok") != Some(&Value::Bool(true)) {
            let error = reply.get("error").and_then(Value::as_str).unwrap_or("unknown error");
            anyhow::bail!("{error}");
        }
        Ok(reply)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Echo;
    impl ControlHandler for Echo {
        fn handle(&self, cmd: &str, _: &Value) -> Result<Value, String> {
            match cmd {
                "stats" => Ok(json!({"ops": 7})),
                other => Err(format!("unknown command '{other}'")),
            }
        }
    }

    #[test]
    fn request_reply() {
        let dir = std::env::temp_dir().join(format!("tsubame-ctl-{}", std::process::id()));
        let _server = ControlServer::start(&dir, Arc::new(Echo)).unwrap();
        let mut client = ControlClient::connect(&dir).unwrap();
        assert_eq!(client.request(&json!({"cmd": "stats"})).unwrap()["ops"], 7);
        let err = client.request(&json!({"cmd": "nope"})).unwrap_err();
        assert!(err.to_string().contains("unknown command 'nope'"));
        let err = client.request(&json!({"nocmd": 1})).unwrap_err();
        assert!(err.to_string().contains("no \"cmd\""));
    }
}
