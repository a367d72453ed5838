//! An NBD client, written from the protocol document
//! (<https://github.com/NetworkBlockDevice/nbd/blob/master/doc/proto.md>):
//! fixed-newstyle negotiation with `NBD_OPT_GO` (falling back to
//! `NBD_OPT_EXPORT_NAME` on servers without it), then simple replies only.
//!
//! [`NbdClient`] is a [`crate::Backend`] for `--disk nbd://...`, and also a
//! client in its own right (far memory swaps pages to a remote export):
//! blocking calls ([`NbdClient::read_at`], ...) and a pipelined API that
//! keeps many requests in flight ([`NbdClient::submit_read`] +
//! [`NbdClient::wait`], [`NbdClient::read_many`]). It is generic over the
//! stream so tests and the fuzzer can play the server.
//!
//! Nothing the server sends is trusted: magics, reply handles, lengths and
//! the export size are checked, option payloads are capped at 64 KiB, and a
//! connection that broke the protocol or timed out mid-reply is refused
//! from then on ([`NbdError::Broken`]) since its byte stream is out of step.

mod client;
mod handshake;
mod uri;

use std::fmt;

pub use client::{Handle, NbdClient, DEFAULT_TIMEOUT, MAX_IN_FLIGHT, MAX_REQUEST};
pub use handshake::{Export, MAX_OPTION_REPLY};
pub use uri::{NbdUri, DEFAULT_PORT, MAX_NAME_LEN};

/// Transmission flags of an export (`NBD_FLAG_*`).
pub mod flags {
    /// The other flags are valid.
    pub const HAS_FLAGS: u16 = 1;
    /// Writes are refused.
    pub const READ_ONLY: u16 = 1 << 1;
    /// The server understands `NBD_CMD_FLUSH`.
    pub const SEND_FLUSH: u16 = 1 << 2;
    /// The server understands the FUA flag on writes.
    pub const SEND_FUA: u16 = 1 << 3;
    /// The server understands `NBD_CMD_TRIM`.
    pub const SEND_TRIM: u16 = 1 << 5;
    /// The server understands `NBD_CMD_CACHE`.
    pub const SEND_CACHE: u16 = 1 << 10;
}

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
fn io_error(during: &'static str) -> impl Fn(std::io::Error) -> NbdError {
    move |source| match source.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => NbdError::TimedOut { during },
        _ => NbdError::Io { during, source },
    }
}
