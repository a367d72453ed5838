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
mod error;
pub mod flags;
mod handshake;
mod uri;

pub use client::{Handle, NbdClient, DEFAULT_TIMEOUT, MAX_IN_FLIGHT, MAX_REQUEST};
pub use error::NbdError;
pub use handshake::{Export, MAX_OPTION_REPLY};
pub use uri::{NbdUri, DEFAULT_PORT, MAX_NAME_LEN};
