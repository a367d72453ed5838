//! The `{"cmd":...}` client: one request, one reply line (the server's
//! QMP greeting line is skipped).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde_json::Value;

/// The server closed the connection (or went silent past the timeout)
/// before a reply came: whatever was asked may or may not have happened.
#[derive(Debug, thiserror::Error)]
#[error("control socket {0} before replying")]
pub struct SocketClosed(pub &'static str);

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

    /// Sends one request and returns the reply; `ok:false` becomes an
    /// error, and a connection that ends first a [`SocketClosed`].
    pub fn request(&mut self, request: &Value) -> anyhow::Result<Value> {
        let mut text = request.to_string();
        text.push('\n');
        if self.writer.write_all(text.as_bytes()).is_err() {
            return Err(SocketClosed("closed").into());
        }
        let reply = loop {
            let mut line = String::new();
            match self.reader.read_line(&mut line) {
                Ok(0) => return Err(SocketClosed("closed").into()),
                Ok(_) if line.starts_with("{\"QMP\"") => continue, // the greeting
                Ok(_) => break serde_json::from_str::<Value>(&line)?,
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    return Err(SocketClosed("went silent").into())
                }
                Err(_) => return Err(SocketClosed("failed").into()),
            }
        };
        if reply.get("ok") != Some(&Value::Bool(true)) {
            let error = reply.get("error").and_then(Value::as_str).unwrap_or("unknown error");
            anyhow::bail!("{error}");
        }
        Ok(reply)
    }
}
