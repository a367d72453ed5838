//! What went wrong talking to an NBD server, and the server's error codes by name.

use std::fmt;

/// What went wrong talking to an NBD server. Wrapped in
/// [`crate::BlockError::Nbd`] with the export's URI.
#[derive(Debug, thiserror::Error)]
pub enum NbdError {
    /// The host name did not resolve.
    #[error("cannot resolve {host}")]
    Resolve {
        /// The host.
        host: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// No TCP connection could be made.
    #[error("cannot connect to {addr}")]
    Connect {
        /// `host:port`.
        addr: String,
        /// The last address's error.
        #[source]
        source: std::io::Error,
    },
    /// The server did not answer within the timeout.
    #[error("no answer from the server in time ({during})")]
    TimedOut {
        /// What we were doing.
        during: &'static str,
    },
    /// The connection failed or closed.
    #[error("connection lost ({during})")]
    Io {
        /// What we were doing.
        during: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The server does not have the export.
    #[error("export '{export}' not found on {host}")]
    ExportNotFound {
        /// The export name asked for.
        export: String,
        /// The server.
        host: String,
    },
    /// The server refused an option during negotiation.
    #[error("server refused {option}: {reply}{}", if message.is_empty() { String::new() } else { format!(" ({message})") })]
    OptionRefused {
        /// The option's name.
        option: &'static str,
        /// The error reply's name.
        reply: String,
        /// The server's message, if any.
        message: String,
    },
    /// The server sent something the protocol does not allow.
    #[error("server broke the NBD protocol: {0}")]
    Protocol(String),
    /// The server's export is not a whole number of 4 KiB blocks.
    #[error("export is {size} bytes: its size must be a multiple of 4 KiB")]
    BadSize {
        /// Its size.
        size: u64,
    },
    /// The server failed a request.
    #[error("server failed {command} of {len} bytes at offset {offset}: {}", Errno(*errno))]
    Server {
        /// read, write, flush, ...
        command: &'static str,
        /// Byte offset.
        offset: u64,
        /// Length.
        len: u32,
        /// The NBD error code (errno values).
        errno: u32,
    },
    /// A write to an export the server marked read-only.
    #[error("export is read-only")]
    ReadOnly,
    /// A handle this client never gave out (or one already waited on).
    #[error("handle {0} is not one of this connection's requests")]
    UnknownHandle(u64),
    /// An earlier error left the connection out of step.
    #[error("connection unusable after an earlier error; reconnect")]
    Broken,
}

/// An NBD error code, shown by name.
struct Errno(u32);

impl fmt::Display for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = match self.0 {
            1 => "EPERM, operation not permitted",
            5 => "EIO, input/output error",
            12 => "ENOMEM, out of memory",
            22 => "EINVAL, invalid argument",
            28 => "ENOSPC, no space left on device",
            75 => "EOVERFLOW, request too large",
            95 => "ENOTSUP, operation not supported",
            108 => "ESHUTDOWN, server is shutting down",
            other => return write!(f, "error code {other}"),
        };
        f.write_str(text)
    }
}

/// Maps an I/O error, telling timeouts apart (a socket read timeout shows
/// up as `WouldBlock`).
pub(super) fn io_error(during: &'static str) -> impl Fn(std::io::Error) -> NbdError {
    move |source| match source.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => NbdError::TimedOut { during },
        _ => NbdError::Io { during, source },
    }
}
