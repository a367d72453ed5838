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

use std::io::{Read, Write};
use std::sync::Mutex;

use ring::hkdf;
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};

pub mod record;
pub mod tls;

pub use record::{Opener, RecordFormat, Sealer, MAX_RECORD};
pub use tls::{tls_handshake, TlsConfig};

/// First bytes of the handshake (never a valid migration preamble).
pub use crate::protocol::SECURE_MAGIC as MAGIC;
const NONCE_LEN: usize = 32;
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
const PSK_MODE: &str = "a pre-shared key (--psk-file)";

/// Why a secure connection could not be set up or used.
#[derive(Debug, thiserror::Error)]
pub enum SecureError {
    /// The connection failed during the handshake.
    #[error("handshake: {0}")]
    Io(#[from] std::io::Error),
    /// The peer speaks plain migration or another protocol.
    #[error("the peer did not start a secure handshake ({0}); give both ends the same --psk-file or --tls-* flags, or --insecure on both for plain TCP")]
    NotSecure(&'static str),
    /// The peer authenticates another way.
    #[error("the peer wants {theirs} and this end uses {ours}: give both ends the same --psk-file, or each its --tls-cert, --tls-key and --tls-ca")]
    ModeMismatch {
        /// This end's mode.
        ours: &'static str,
        /// The peer's.
        theirs: &'static str,
    },
    /// The peer's proof did not verify: it holds another key.
    #[error("the peer failed authentication: it does not hold our pre-shared key")]
    PeerNotAuthenticated,
    /// The peer said our proof did not verify.
    #[error("the peer refused us: we do not hold its pre-shared key")]
    RefusedByPeer,
    /// A pre-shared-key file is unusable.
    #[error("pre-shared key {path}: {reason}")]
    BadKey {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// A certificate, key or CA file is unusable.
    #[error("{flag} {path}: {reason}")]
    BadTlsFile {
        /// The flag that named it.
        flag: &'static str,
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// The peer's certificate does not chain to our CA.
    #[error("the peer's certificate is not signed by --tls-ca")]
    UntrustedCertificate,
    /// The peer sent no certificate.
    #[error("the peer sent no certificate")]
    NoCertificate,
    /// The peer's certificate is unacceptable for another reason.
    #[error("the peer's certificate is not acceptable: {0}")]
    BadPeerCertificate(String),
    /// The peer refused our certificate.
    #[error("the peer refused our certificate{why} (TLS alert {alert})")]
    CertificateRefused {
        /// The alert it sent.
        alert: &'static str,
        /// What the alert means, when it says.
        why: &'static str,
    },
    /// The peer ended the handshake with an alert.
    #[error("the peer ended the TLS handshake with alert {0}")]
    TlsAlert(&'static str),
    /// The peer hung up during the TLS handshake.
    #[error("the peer closed the connection during the TLS handshake")]
    TlsClosed,
    /// Both a pre-shared key and TLS certificates were given.
    #[error("--psk-file and --tls-* exclude each other: choose one")]
    BothModes,
    /// Anything else rustls refused.
    #[error("TLS handshake: {0}")]
    Tls(rustls::Error),
}

/// A pre-shared key (at least [`MIN_PSK`] bytes).
#[derive(Clone)]
pub struct Psk(Vec<u8>);

impl std::fmt::Debug for Psk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Psk(..)")
    }
}

impl Psk {
    /// Reads a key file: its bytes, with one trailing newline dropped.
    pub fn read(path: &std::path::Path) -> Result<Psk, SecureError> {
        let bad = |reason: String| SecureError::BadKey { path: path.display().to_string(), reason };
        let mut bytes = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
        if bytes.last() == Some(&b'\n') {
            bytes.pop();
        }
        Psk::new(bytes).map_err(|e| match e {
            SecureError::BadKey { reason, .. } => bad(reason),
            other => other,
        })
    }

    /// A key from bytes.
    pub fn new(bytes: Vec<u8>) -> Result<Psk, SecureError> {
        if bytes.len() < MIN_PSK {
            return Err(SecureError::BadKey {
                path: "(key)".into(),
                reason: format!("{} bytes; use at least {MIN_PSK} random bytes", bytes.len()),
            });
        }
        Ok(Psk(bytes))
    }
}

/// Which end of the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The connecting side (the source).
    Client,
    /// The accepting side (the destination).
    Server,
}

struct Label;
impl hkdf::KeyType for Label {
    fn len(&self) -> usize {
        32
    }
}

fn expand(prk: &hkdf::Prk, label: &'static [u8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    let info = [label];
    prk.expand(&info, Label).and_then(|okm| okm.fill(&mut out)).expect("32 bytes is a valid HKDF length");
    out
}

/// Traffic keys of one session.
pub struct Keys {
    /// Key for what this end sends.
    pub send: [u8; 32],
    /// Key for what this end receives.
    pub receive: [u8; 32],
}

/// Runs the pre-shared-key handshake over `io`; returns the traffic keys.
pub fn psk_handshake(io: &mut (impl Read + Write), psk: &Psk, role: Role) -> Result<Keys, SecureError> {
    let mut ours = [0u8; NONCE_LEN];
    SystemRandom::new().fill(&mut ours).map_err(|_| std::io::Error::other("no system randomness"))?;
    let mut hello = Vec::with_capacity(HELLO_LEN);
    hello.extend_from_slice(&MAGIC);
    hello.push(MODE_PSK);
    hello.extend_from_slice(&ours);
    io.write_all(&hello)?;
    io.flush()?;
    // The magic first: a plain peer sends only its 16-byte preamble.
    let mut theirs_hello = [0u8; HELLO_LEN];
    io.read_exact(&mut theirs_hello[..8])?;
    if let Err(e) = check_magic(&theirs_hello[..8]) {
        if tls::is_client_hello(&theirs_hello) {
            // Take the rest of the ClientHello record, so that closing does
            // not reset the connection before the TLS peer reads our HELLO.
            let rest = u16::from_be_bytes([theirs_hello[3], theirs_hello[4]]) as usize;
            let _ = io.read_exact(&mut vec![0u8; rest.saturating_sub(3)]);
        }
        return Err(e);
    }
    io.read_exact(&mut theirs_hello[8..])?;
    let theirs = check_hello(&theirs_hello)?;
    let (nc, ns) = match role {
        Role::Client => (ours, theirs),
        Role::Server => (theirs, ours),
    };
    let mut salt = [0u8; 2 * NONCE_LEN];
    salt[..NONCE_LEN].copy_from_slice(&nc);
    salt[NONCE_LEN..].copy_from_slice(&ns);
    let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, &salt).extract(&psk.0);
    let auth_c = hmac::Key::new(hmac::HMAC_SHA256, &expand(&prk, b"tsubame psk v1 client proof"));
    let auth_s = hmac::Key::new(hmac::HMAC_SHA256, &expand(&prk, b"tsubame psk v1 server proof"));
    let c2s = expand(&prk, b"tsubame psk v1 client to server");
    let s2c = expand(&prk, b"tsubame psk v1 server to client");
    let transcript = |who: &[u8]| [b"tsubame psk v1 ".as_slice(), who, &salt].concat();
    match role {
        Role::Client => {
            io.write_all(hmac::sign(&auth_c, &transcript(b"client")).as_ref())?;
            io.flush()?;
            let mut status = [0u8; 1];
            io.read_exact(&mut status)?;
            if status[0] != 0 {
                return Err(SecureError::RefusedByPeer);
            }
            let mut proof = [0u8; 32];
            io.read_exact(&mut proof)?;
            let ok = hmac::verify(&auth_s, &transcript(b"server"), &proof).is_ok();
            io.write_all(&[u8::from(!ok)])?;
            io.flush()?;
            if !ok {
                return Err(SecureError::PeerNotAuthenticated);
            }
            Ok(Keys { send: c2s, receive: s2c })
        }
        Role::Server => {
            let mut proof = [0u8; 32];
            io.read_exact(&mut proof)?;
            if hmac::verify(&auth_c, &transcript(b"client"), &proof).is_err() {
                let _ = io.write_all(&[1]).and_then(|_| io.flush());
                return Err(SecureError::PeerNotAuthenticated);
            }
            io.write_all(&[0])?;
            io.write_all(hmac::sign(&auth_s, &transcript(b"server")).as_ref())?;
            io.flush()?;
            let mut status = [0u8; 1];
            io.read_exact(&mut status)?;
            if status[0] != 0 {
                return Err(SecureError::RefusedByPeer);
            }
            Ok(Keys { send: s2c, receive: c2s })
        }
    }
}

/// Checks a peer's handshake HELLO; returns its nonce.
pub fn check_hello(hello: &[u8; HELLO_LEN]) -> Result<[u8; NONCE_LEN], SecureError> {
    check_magic(&hello[..8])?;
    match hello[8] {
        MODE_PSK => {}
        MODE_TLS => return Err(SecureError::ModeMismatch { ours: PSK_MODE, theirs: tls::MODE_NAME }),
        _ => return Err(SecureError::NotSecure("it asks for an unknown mode")),
    }
    Ok(hello[9..].try_into().expect("32 bytes"))
}

fn check_magic(magic: &[u8]) -> Result<(), SecureError> {
    if magic == crate::protocol::MAGIC {
        return Err(SecureError::NotSecure("it sent a plain migration preamble"));
    }
    if tls::is_client_hello(magic) {
        return Err(SecureError::ModeMismatch { ours: PSK_MODE, theirs: tls::MODE_NAME });
    }
    if magic != MAGIC {
        return Err(SecureError::NotSecure("unknown first bytes"));
    }
    Ok(())
}

/// Both directions of a secured connection; shared by its handles, each
/// direction under its own lock (one thread reads, another writes).
pub struct RecordLayer {
    /// Receiving side.
    pub rx: Mutex<Opener>,
    /// Sending side.
    pub tx: Mutex<Sealer>,
}

impl std::fmt::Debug for RecordLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RecordLayer(..)")
    }
}

impl RecordLayer {
    /// A channel for a pre-shared-key session's keys.
    pub fn new(keys: &Keys) -> RecordLayer {
        RecordLayer::from_halves(Opener::new(&keys.receive), Sealer::new(&keys.send))
    }

    /// A channel of two directions' states.
    pub fn from_halves(rx: Opener, tx: Sealer) -> RecordLayer {
        RecordLayer { rx: Mutex::new(rx), tx: Mutex::new(tx) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    fn pair(a: &[u8], b: &[u8]) -> (Result<Keys, SecureError>, Result<Keys, SecureError>) {
        let (mut x, mut y) = UnixStream::pair().unwrap();
        let (a, b) = (Psk::new(a.to_vec()).unwrap(), Psk::new(b.to_vec()).unwrap());
        let t = std::thread::spawn(move || psk_handshake(&mut y, &b, Role::Server));
        let c = psk_handshake(&mut x, &a, Role::Client);
        drop(x);
        (c, t.join().unwrap())
    }

    #[test]
    fn same_key_agrees_and_records_round_trip() {
        let (c, s) = pair(b"0123456789abcdef-key", b"0123456789abcdef-key");
        let (c, s) = (c.unwrap(), s.unwrap());
        assert_eq!(c.send, s.receive);
        assert_eq!(c.receive, s.send);
        assert_ne!(c.send, c.receive);
        let mut wire = Vec::new();
        let data: Vec<u8> = (0..600_000u32).map(|i| i as u8).collect();
        Sealer::new(&c.send).write_all(&mut wire, &data).unwrap();
        assert!(!wire.windows(64).any(|w| w == &data[1000..1064]), "plaintext visible on the wire");
        assert_eq!(Opener::new(&s.receive).read_to_end(&mut &wire[..]).unwrap(), data);
        // One flipped bit: the record does not open.
        wire[100] ^= 1;
        assert!(Opener::new(&s.receive).read_to_end(&mut &wire[..]).is_err());
    }

    #[test]
    fn wrong_key_is_refused_on_both_sides() {
        let (c, s) = pair(b"0123456789abcdef-key", b"0123456789abcdef-KEY");
        assert!(matches!(c, Err(SecureError::RefusedByPeer)), "{:?}", c.err());
        assert!(matches!(s, Err(SecureError::PeerNotAuthenticated)), "{:?}", s.err());
    }

    #[test]
    fn plain_peer_and_short_keys_are_refused() {
        let mut hello = [0u8; HELLO_LEN];
        hello[..8].copy_from_slice(&crate::protocol::MAGIC);
        assert!(matches!(check_hello(&hello), Err(SecureError::NotSecure(_))));
        // A TLS end: its ClientHello, or the HELLO it answers a tsubame peer with.
        assert!(matches!(check_magic(&[0x16, 3, 1, 2, 0, 1, 0, 1]), Err(SecureError::ModeMismatch { .. })));
        hello[..8].copy_from_slice(&MAGIC);
        hello[8] = MODE_TLS;
        assert!(matches!(check_hello(&hello), Err(SecureError::ModeMismatch { .. })));
        assert!(Psk::new(b"short".to_vec()).is_err());
    }
}
