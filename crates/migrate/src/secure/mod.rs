//! Authenticated, encrypted connections: a pre-shared-key handshake and an
//! AEAD record layer under the migration stream (docs/security.md).
//!
//! Handshake, per connection, before any byte of the migration stream:
//!
//! ```text
//! client (source)                          server (destination)
//!   | HELLO: magic, mode, nonce_c (32)  --->  |
//!   |       <---  HELLO: magic, mode, nonce_s |
//!   | proof_c = HMAC(k_auth_c, transcript) -> |  checks it
//!   |       <---  status (0 ok | 1 refused), proof_s
//!   | status (0 ok | 1 refused)         --->  |  (client checked proof_s)
//! ```
//!
//! `prk = HKDF-SHA256-Extract(salt = nonce_c || nonce_s, ikm = PSK)`; the
//! two proof keys and the two traffic keys (one per direction) are
//! expanded from it under distinct labels. Fresh nonces on both sides make
//! every session's keys new, so a recorded session cannot be replayed, and
//! a proof never opens the other direction's check.
//!
//! Mutual TLS 1.3 (`--tls-cert`, `--tls-key`, `--tls-ca`) is the other
//! mode: [`tls`] runs rustls's handshake and hands its traffic keys to the
//! same record layer ([`record`]), in the TLS 1.3 record format.
//!
//! Records, each direction independent: see [`record`]. A record that
//! fails to open ends the connection.

pub mod error;
pub mod layer;
pub mod modes;
pub mod psk;
pub mod record;
pub mod record_format;
pub mod tls;

pub use error::SecureError;
pub use layer::RecordLayer;
pub use modes::{HELLO_LEN, MAGIC, MIN_PSK, MODE_PSK, MODE_TLS};
pub use psk::{check_hello, psk_handshake, Keys, Psk, Role};
pub use record::{Opener, Sealer};
pub use record_format::{RecordFormat, MAX_RECORD};
pub use tls::{tls_handshake, TlsConfig};
