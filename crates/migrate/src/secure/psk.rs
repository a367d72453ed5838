//! The pre-shared-key handshake (see [`super`] for the exchange): both
//! ends prove they hold the key, and derive one traffic key per direction.

use std::io::{Read, Write};

use ring::hkdf;
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};

use super::error::SecureError;
use super::modes::{HELLO_LEN, MAGIC, MIN_PSK, MODE_NAME, MODE_PSK, MODE_TLS, NONCE_LEN, PSK_MODE};

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
        if crate::protocol::kind::is_tls_client_hello(&theirs_hello) {
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
        MODE_TLS => return Err(SecureError::ModeMismatch { ours: PSK_MODE, theirs: MODE_NAME }),
        _ => return Err(SecureError::NotSecure("it asks for an unknown mode")),
    }
    Ok(hello[9..].try_into().expect("32 bytes"))
}

fn check_magic(magic: &[u8]) -> Result<(), SecureError> {
    if magic == crate::protocol::MAGIC {
        return Err(SecureError::NotSecure("it sent a plain migration preamble"));
    }
    if crate::protocol::kind::is_tls_client_hello(magic) {
        return Err(SecureError::ModeMismatch { ours: PSK_MODE, theirs: MODE_NAME });
    }
    if magic != MAGIC {
        return Err(SecureError::NotSecure("unknown first bytes"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::secure::record::{Opener, Sealer};
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
