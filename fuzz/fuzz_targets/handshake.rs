//! The connection setup a destination runs before any memory moves: the
//! pre-shared-key handshake (HELLO, proofs, status bytes), the TLS 1.3
//! handshake (our record reader in front of rustls), the first encrypted
//! records of both formats, then the migration preamble, HELLO and CHANNEL
//! frames, on bytes from a peer that holds no key.
#![no_main]

use std::io::{Read, Write};

use libfuzzer_sys::fuzz_target;
use tsubame_migrate::secure::{self, Opener, Psk, RecordFormat, Role, TlsConfig};
use tsubame_migrate::protocol::{self as wire, ChannelOpen};

/// The peer: reads come from the fuzzer's bytes, writes vanish.
struct Peer<'a>(&'a [u8]);

impl Read for Peer<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.read(buf)
    }
}

impl Write for Peer<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// One certificate, signed by one CA, for both roles (made once).
fn tls() -> &'static TlsConfig {
    static TLS: std::sync::OnceLock<TlsConfig> = std::sync::OnceLock::new();
    TLS.get_or_init(|| {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = ca.self_signed(&ca_key).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".into()]).unwrap().signed_by(&key, &ca, &ca_key).unwrap();
        TlsConfig::from_pem(cert.pem().as_bytes(), key.serialize_pem().as_bytes(), ca.pem().as_bytes()).unwrap()
    })
}

fuzz_target!(|data: &[u8]| {
    let psk = Psk::new(b"fuzzing-pre-shared-key".to_vec()).unwrap();
    for role in [Role::Server, Role::Client] {
        let _ = secure::psk_handshake(&mut Peer(data), &psk, role);
        let _ = secure::tls_handshake(&mut Peer(data), tls(), role, "localhost");
    }
    // Records under a key the peer does not know: none may open, none may
    // allocate past the record cap.
    for format in [RecordFormat::Tsubame, RecordFormat::Tls13 { iv: [9u8; 12] }] {
        let mut opener = Opener::with_format(&[7u8; 32], format, 0);
        let mut input = data;
        let mut buf = [0u8; 4096];
        for _ in 0..4 {
            if opener.read(&mut input, &mut buf).map_or(true, |n| n == 0) {
                break;
            }
        }
    }
    // What follows the handshake in the clear of the record layer.
    let mut input = data;
    let _ = wire::read_preamble(&mut input);
    let mut frame = Vec::new();
    for _ in 0..2 {
        match wire::read_frame(&mut input, &mut frame) {
            Ok(wire::FrameKind::Hello) => drop(wire::Hello::decode(&frame)),
            Ok(wire::FrameKind::Channel) => drop(ChannelOpen::decode(&frame)),
            Ok(_) => {}
            Err(_) => break,
        }
    }
    let _ = wire::Hello::decode(data);
    let _ = ChannelOpen::decode(data);
});
