//! How a peer's first bytes tell the two secure modes (and plain
//! migration) apart, and the names the error messages use.

/// First bytes of the handshake (never a valid migration preamble).
pub use crate::protocol::SECURE_MAGIC as MAGIC;
/// Bytes of each side's handshake nonce.
pub const NONCE_LEN: usize = 32;
/// Handshake HELLO: magic, mode, nonce.
pub const HELLO_LEN: usize = 8 + 1 + NONCE_LEN;
/// Mode byte of the pre-shared-key handshake.
pub const MODE_PSK: u8 = 1;
/// Mode byte a TLS end answers a tsubame HELLO with, so that a
/// pre-shared-key or plain peer learns why it is refused (TLS itself
/// starts with a ClientHello, not with this HELLO).
pub const MODE_TLS: u8 = 2;
/// Shortest pre-shared key accepted.
pub const MIN_PSK: usize = 16;
/// The pre-shared-key mode, for messages.
pub const PSK_MODE: &str = "a pre-shared key (--psk-file)";

/// The TLS mode, for messages.
pub const MODE_NAME: &str = "TLS certificates (--tls-cert, --tls-key, --tls-ca)";
