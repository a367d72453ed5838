//! Mutual TLS 1.3: rustls runs the handshake, then its traffic keys move
//! to our record layer ([`super::record`], TLS 1.3 format), so the two
//! directions of a connection can be used by two threads without a
//! shared lock — the same move kTLS makes with the kernel.
//!
//! ```text
//! client (source)                              server (destination)
//!   | ClientHello                          --->  |
//!   |   <---  ServerHello .. CertificateRequest, Certificate, Finished
//!   | Certificate, CertificateVerify, Finished -> | verifies against --tls-ca
//!   |   <---  one byte of application data (or an alert: refused)
//!   both: dangerous_extract_secrets(); records are ours from here on
//! ```
//!
//! Only TLS 1.3 and TLS_AES_256_GCM_SHA384; the server asks for a client
//! certificate chaining to its --tls-ca, the client checks the server's
//! against its --tls-ca and the host name it dialled (for `unix:`
//! addresses, `localhost`). The confirmation byte makes a refused client
//! certificate reach the client as the server's alert, before it sends
//! anything of the migration. Handshake records are read one at a time, so
//! rustls never holds bytes that belong to the record layer when the keys
//! are extracted.

use std::io::{Read, Write};
use std::path::Path;
use std::sync::Arc;

use rustls::client::Resumption;
use rustls::crypto::{ring as provider, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{
    AlertDescription, CertificateError, ClientConfig, ClientConnection, Connection, ConnectionTrafficSecrets,
    RootCertStore, ServerConfig, ServerConnection,
};

use super::error::SecureError;
use super::layer::RecordLayer;
use super::psk::Role;
use super::record::{Opener, Sealer};
use super::record_format::{alert_name, RecordFormat, TLS_MAX_CIPHERTEXT};

pub use super::modes::MODE_NAME;
/// What the server sends once it has accepted the client's certificate.
const CONFIRM: u8 = 0x01;

/// Certificates and keys of one end, ready for either role.
#[derive(Clone)]
pub struct TlsConfig {
    client: Arc<ClientConfig>,
    server: Arc<ServerConfig>,
}

impl std::fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsConfig(..)")
    }
}

impl TlsConfig {
    /// Reads this end's certificate chain and private key and the CA that
    /// signs its peers' certificates (PEM files).
    pub fn load(cert: &Path, key: &Path, ca: &Path) -> Result<TlsConfig, SecureError> {
        let read = |flag: &'static str, path: &Path| {
            std::fs::read(path).map_err(|e| SecureError::BadTlsFile {
                flag,
                path: path.display().to_string(),
                reason: e.to_string(),
            })
        };
        let (cert_pem, key_pem, ca_pem) = (read("--tls-cert", cert)?, read("--tls-key", key)?, read("--tls-ca", ca)?);
        TlsConfig::from_pem(&cert_pem, &key_pem, &ca_pem).map_err(|e| match e {
            SecureError::BadTlsFile { flag, reason, .. } => {
                let path = match flag {
                    "--tls-cert" => cert,
                    "--tls-key" => key,
                    _ => ca,
                };
                SecureError::BadTlsFile { flag, path: path.display().to_string(), reason }
            }
            other => other,
        })
    }

    /// As [`TlsConfig::load`], from the files' contents.
    pub fn from_pem(cert: &[u8], key: &[u8], ca: &[u8]) -> Result<TlsConfig, SecureError> {
        let bad = |flag: &'static str, reason: String| SecureError::BadTlsFile { flag, path: "(PEM)".into(), reason };
        let certs = |flag: &'static str, pem: &[u8]| {
            let certs = CertificateDer::pem_slice_iter(pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| bad(flag, format!("not PEM: {e}")))?;
            if certs.is_empty() {
                return Err(bad(flag, "no CERTIFICATE in it".into()));
            }
            Ok(certs)
        };
        let chain = certs("--tls-cert", cert)?;
        let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| {
            bad(
                "--tls-key",
                match e {
                    rustls::pki_types::pem::Error::NoItemsFound => "no PRIVATE KEY in it".into(),
                    e => format!("not PEM: {e}"),
                },
            )
        })?;
        let mut roots = RootCertStore::empty();
        for c in certs("--tls-ca", ca)? {
            roots.add(c).map_err(|e| bad("--tls-ca", format!("not a usable CA certificate: {e}")))?;
        }
        let roots = Arc::new(roots);
        let provider = Arc::new(CryptoProvider {
            cipher_suites: vec![provider::cipher_suite::TLS13_AES_256_GCM_SHA384],
            ..provider::default_provider()
        });
        let config = |e: rustls::Error| match e {
            rustls::Error::InconsistentKeys(_) => {
                bad("--tls-key", "does not match the certificate of --tls-cert".into())
            }
            rustls::Error::General(m) if m.contains("private key") => bad("--tls-key", m),
            e => SecureError::Tls(e),
        };
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| bad("--tls-ca", e.to_string()))?;
        let mut server = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(config)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(config)?;
        server.send_tls13_tickets = 0;
        server.enable_secret_extraction = true;
        let mut client = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(config)?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(config)?;
        client.enable_secret_extraction = true;
        client.resumption = Resumption::disabled();
        Ok(TlsConfig { client: Arc::new(client), server: Arc::new(server) })
    }
}

pub use crate::protocol::kind::is_tls_client_hello as is_client_hello;

/// Runs the TLS 1.3 handshake over `io` as `role` (a client checks the
/// server's certificate against `server_name`); returns the channel that
/// carries the rest of the connection.
pub fn tls_handshake(
    io: &mut (impl Read + Write),
    config: &TlsConfig,
    role: Role,
    server_name: &str,
) -> Result<RecordLayer, SecureError> {
    let mut conn: Connection = match role {
        Role::Client => {
            let name = ServerName::try_from(server_name.to_string()).map_err(|_| {
                SecureError::BadPeerCertificate(format!("'{server_name}' is neither a host name nor an IP address"))
            })?;
            ClientConnection::new(config.client.clone(), name).map_err(SecureError::Tls)?.into()
        }
        Role::Server => ServerConnection::new(config.server.clone()).map_err(SecureError::Tls)?.into(),
    };
    let mut first = true;
    while conn.is_handshaking() {
        send(&mut conn, io)?;
        read_record(&mut conn, io, role, first)?;
        first = false;
        process(&mut conn, io)?;
    }
    send(&mut conn, io)?;
    match role {
        Role::Server => {
            conn.writer().write_all(&[CONFIRM])?;
            send(&mut conn, io)?;
        }
        Role::Client => {
            let mut byte = [0u8; 1];
            loop {
                match conn.reader().read(&mut byte) {
                    Ok(1) if byte[0] == CONFIRM => break,
                    Ok(1) => return Err(tls_general("the peer is not a tsubame destination (no confirmation)")),
                    Ok(_) => return Err(SecureError::TlsClosed),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        read_record(&mut conn, io, role, false)?;
                        process(&mut conn, io)?;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        }
    }
    let secrets = conn.dangerous_extract_secrets().map_err(SecureError::Tls)?;
    let half = |(seq, secrets): (u64, ConnectionTrafficSecrets)| match secrets {
        ConnectionTrafficSecrets::Aes256Gcm { key, iv } => {
            let key: [u8; 32] = key.as_ref().try_into().map_err(|_| tls_general("AES-256 key of another size"))?;
            let iv: [u8; 12] = iv.as_ref().try_into().map_err(|_| tls_general("IV of another size"))?;
            Ok((key, RecordFormat::Tls13 { iv }, seq))
        }
        _ => Err(tls_general("the handshake agreed on a cipher other than AES-256-GCM")),
    };
    let (tx_key, tx_format, tx_seq) = half(secrets.tx)?;
    let (rx_key, rx_format, rx_seq) = half(secrets.rx)?;
    Ok(RecordLayer::from_halves(
        Opener::with_format(&rx_key, rx_format, rx_seq),
        Sealer::with_format(&tx_key, tx_format, tx_seq),
    ))
}

fn tls_general(what: &str) -> SecureError {
    SecureError::Tls(rustls::Error::General(what.into()))
}

/// Writes what rustls has to send.
fn send(conn: &mut Connection, io: &mut impl Write) -> std::io::Result<()> {
    while conn.wants_write() {
        conn.write_tls(io)?;
    }
    io.flush()
}

/// Lets rustls process what it read; on failure sends its alert (if the
/// peer still listens) and says why in our terms.
fn process(conn: &mut Connection, io: &mut impl Write) -> Result<(), SecureError> {
    match conn.process_new_packets() {
        Ok(_) => Ok(()),
        Err(e) => {
            let _ = send(conn, io);
            Err(refusal(e))
        }
    }
}

/// Reads exactly one record and hands it to rustls (never more: what
/// follows the handshake is the record layer's).
fn read_record(
    conn: &mut Connection,
    io: &mut (impl Read + Write),
    role: Role,
    first: bool,
) -> Result<(), SecureError> {
    let mut record = vec![0u8; 5];
    io.read_exact(&mut record).map_err(closed)?;
    if record[..5] == crate::protocol::MAGIC[..5] || record[..5] == super::modes::MAGIC[..5] {
        let plain = record[..5] == crate::protocol::MAGIC[..5];
        if role == Role::Server {
            // Take the rest of its greeting (so closing does not reset the
            // connection under our answer), then tell the tsubame peer why
            // in the greeting it understands.
            let rest = if plain { crate::protocol::PREAMBLE_LEN } else { super::modes::HELLO_LEN } - 5;
            let _ = io.read_exact(&mut vec![0u8; rest]);
            let mut hello = [0u8; super::modes::HELLO_LEN];
            hello[..8].copy_from_slice(&super::modes::MAGIC);
            hello[8] = super::modes::MODE_TLS;
            let _ = io.write_all(&hello).and_then(|_| io.flush());
        }
        return Err(if plain {
            SecureError::NotSecure("it sent a plain migration preamble")
        } else {
            SecureError::ModeMismatch { ours: MODE_NAME, theirs: super::modes::PSK_MODE }
        });
    }
    let valid = (0x14..=0x17).contains(&record[0]) && record[1] == 0x03;
    if first && !(valid && (role == Role::Client || is_client_hello(&record))) {
        return Err(SecureError::NotSecure("unknown first bytes"));
    }
    let len = u16::from_be_bytes([record[3], record[4]]) as usize;
    if !valid || len > TLS_MAX_CIPHERTEXT {
        return Err(tls_general("malformed TLS record"));
    }
    record.resize(5 + len, 0);
    io.read_exact(&mut record[5..]).map_err(closed)?;
    let mut rest = &record[..];
    while !rest.is_empty() {
        conn.read_tls(&mut rest)?;
    }
    Ok(())
}

fn closed(e: std::io::Error) -> SecureError {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof => SecureError::TlsClosed,
        _ => SecureError::Io(e),
    }
}

/// A rustls error in our terms.
fn refusal(e: rustls::Error) -> SecureError {
    match e {
        rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer) => SecureError::UntrustedCertificate,
        rustls::Error::InvalidCertificate(CertificateError::NotValidForNameContext { expected, presented }) => {
            SecureError::BadPeerCertificate(format!(
                "it is not valid for {} (it names {})",
                expected.to_str(),
                presented.join(", ")
            ))
        }
        rustls::Error::InvalidCertificate(CertificateError::ExpiredContext { .. } | CertificateError::Expired) => {
            SecureError::BadPeerCertificate("it has expired".into())
        }
        rustls::Error::InvalidCertificate(
            CertificateError::NotValidYetContext { .. } | CertificateError::NotValidYet,
        ) => SecureError::BadPeerCertificate("it is not valid yet".into()),
        e @ rustls::Error::InvalidCertificate(_) => SecureError::BadPeerCertificate(e.to_string()),
        rustls::Error::NoCertificatesPresented => SecureError::NoCertificate,
        rustls::Error::AlertReceived(alert) => {
            let name = alert_name(u8::from(alert));
            match alert {
                AlertDescription::UnknownCA => {
                    SecureError::CertificateRefused { alert: name, why: ": it is not signed by the peer's --tls-ca" }
                }
                AlertDescription::CertificateExpired => {
                    SecureError::CertificateRefused { alert: name, why: ": it has expired" }
                }
                AlertDescription::BadCertificate
                | AlertDescription::UnsupportedCertificate
                | AlertDescription::CertificateRevoked
                | AlertDescription::CertificateUnknown
                | AlertDescription::CertificateRequired
                | AlertDescription::AccessDenied => SecureError::CertificateRefused { alert: name, why: "" },
                _ => SecureError::TlsAlert(name),
            }
        }
        e => SecureError::Tls(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    /// A CA and the PEM of a certificate it signs for `names`, with key.
    struct Ca {
        cert: rcgen::Certificate,
        key: rcgen::KeyPair,
    }

    impl Ca {
        fn new(name: &str) -> Ca {
            let key = rcgen::KeyPair::generate().unwrap();
            let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
            params.distinguished_name.push(rcgen::DnType::CommonName, name);
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            Ca { cert: params.self_signed(&key).unwrap(), key }
        }

        fn issue(&self, names: &[&str]) -> (String, String) {
            let key = rcgen::KeyPair::generate().unwrap();
            let params =
                rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
            let cert = params.signed_by(&key, &self.cert, &self.key).unwrap();
            (cert.pem(), key.serialize_pem())
        }

        fn config(&self, trusts: &Ca) -> TlsConfig {
            let (cert, key) = self.issue(&["localhost", "127.0.0.1"]);
            TlsConfig::from_pem(cert.as_bytes(), key.as_bytes(), trusts.cert.pem().as_bytes()).unwrap()
        }
    }

    /// Handshakes a client and a server over a socket pair; on success each
    /// sends a message through its channel that the other reads.
    fn pair(client: TlsConfig, server: TlsConfig, name: &str) -> (Result<Vec<u8>, String>, Result<Vec<u8>, String>) {
        let (x, y) = UnixStream::pair().unwrap();
        let run = move |mut io: UnixStream, config: TlsConfig, role: Role, name: String| {
            let channel = tls_handshake(&mut io, &config, role, &name).map_err(|e| e.to_string())?;
            // The peer writes right away: nothing of it may be lost.
            channel.tx.lock().unwrap().write_all(&mut io, format!("hello from {role:?}").as_bytes()).unwrap();
            let mut got = vec![0u8; 17];
            let mut at = 0;
            while at < got.len() {
                let n = channel.rx.lock().unwrap().read(&mut io, &mut got[at..]).map_err(|e| e.to_string())?;
                if n == 0 {
                    break;
                }
                at += n;
            }
            Ok(got)
        };
        let name = name.to_string();
        let server = std::thread::spawn(move || run(y, server, Role::Server, String::new()));
        let client = run(x, client, Role::Client, name);
        (client, server.join().unwrap())
    }

    #[test]
    fn mutual_tls_agrees_and_carries_data_both_ways() {
        let ca = Ca::new("tsubame test CA");
        for name in ["localhost", "127.0.0.1"] {
            let (c, s) = pair(ca.config(&ca), ca.config(&ca), name);
            assert_eq!(c.unwrap(), b"hello from Server");
            assert_eq!(s.unwrap(), b"hello from Client");
        }
    }

    #[test]
    fn a_client_certificate_from_another_ca_is_refused_on_both_sides() {
        let (ca, other) = (Ca::new("ours"), Ca::new("another"));
        let (c, s) = pair(other.config(&ca), ca.config(&ca), "localhost");
        assert_eq!(s.unwrap_err(), "the peer's certificate is not signed by --tls-ca");
        assert_eq!(
            c.unwrap_err(),
            "the peer refused our certificate: it is not signed by the peer's --tls-ca (TLS alert unknown_ca)"
        );
    }

    #[test]
    fn a_server_certificate_from_another_ca_or_name_is_refused_on_both_sides() {
        let (ca, other) = (Ca::new("ours"), Ca::new("another"));
        let (c, s) = pair(ca.config(&ca), other.config(&ca), "localhost");
        assert_eq!(c.unwrap_err(), "the peer's certificate is not signed by --tls-ca");
        assert!(s.unwrap_err().contains("TLS alert unknown_ca"));
        let (c, s) = pair(ca.config(&ca), ca.config(&ca), "dest.example");
        let c = c.unwrap_err();
        assert!(c.starts_with("the peer's certificate is not acceptable: it is not valid for dest.example"), "{c}");
        assert!(s.unwrap_err().contains("the peer refused our certificate (TLS alert bad_certificate)"));
    }

    #[test]
    fn records_are_genuine_tls_that_rustls_reads() {
        // Our client and its records against a rustls server that keeps
        // rustls's own record layer: each reads what the other wrote.
        let ca = Ca::new("ca");
        let (mut x, mut y) = UnixStream::pair().unwrap();
        let server_config = ca.config(&ca).server;
        let server = std::thread::spawn(move || {
            let mut conn = ServerConnection::new(server_config).unwrap();
            while conn.is_handshaking() {
                conn.complete_io(&mut y).unwrap();
            }
            let mut tls = rustls::Stream::new(&mut conn, &mut y);
            tls.write_all(&[CONFIRM]).unwrap();
            let mut got = vec![0u8; 40_000];
            tls.read_exact(&mut got).unwrap();
            tls.write_all(b"and back through rustls").unwrap();
            got
        });
        let channel = tls_handshake(&mut x, &ca.config(&ca), Role::Client, "localhost").unwrap();
        let data: Vec<u8> = (0..40_000u32).map(|i| (i * 7) as u8).collect();
        channel.tx.lock().unwrap().write_all(&mut x, &data).unwrap();
        let mut back = [0u8; 23];
        let mut at = 0;
        while at < back.len() {
            at += channel.rx.lock().unwrap().read(&mut x, &mut back[at..]).unwrap();
        }
        assert_eq!(&back, b"and back through rustls");
        assert_eq!(server.join().unwrap(), data);
    }

    #[test]
    fn bad_files_are_named() {
        let ca = Ca::new("ca");
        let (cert, key) = ca.issue(&["localhost"]);
        let other_key = rcgen::KeyPair::generate().unwrap().serialize_pem();
        let ca_pem = ca.cert.pem();
        let err = |c: &str, k: &str, a: &str| {
            TlsConfig::from_pem(c.as_bytes(), k.as_bytes(), a.as_bytes()).unwrap_err().to_string()
        };
        assert_eq!(err(&key, &key, &ca_pem), "--tls-cert (PEM): no CERTIFICATE in it");
        assert_eq!(err(&cert, &cert, &ca_pem), "--tls-key (PEM): no PRIVATE KEY in it");
        assert_eq!(err(&cert, &key, "junk"), "--tls-ca (PEM): no CERTIFICATE in it");
        assert_eq!(err(&cert, &other_key, &ca_pem), "--tls-key (PEM): does not match the certificate of --tls-cert");
        let dir = std::env::temp_dir().join(format!("tsubame-tls-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("cert.pem"), &cert).unwrap();
        std::fs::write(dir.join("key.pem"), &cert).unwrap();
        let e = TlsConfig::load(&dir.join("cert.pem"), &dir.join("key.pem"), &dir.join("missing.pem")).unwrap_err();
        assert!(e.to_string().starts_with(&format!("--tls-ca {}: ", dir.join("missing.pem").display())), "{e}");
        std::fs::write(dir.join("ca.pem"), &ca_pem).unwrap();
        let e = TlsConfig::load(&dir.join("cert.pem"), &dir.join("key.pem"), &dir.join("ca.pem")).unwrap_err();
        assert_eq!(e.to_string(), format!("--tls-key {}: no PRIVATE KEY in it", dir.join("key.pem").display()));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn tsubame_peers_are_told_apart() {
        let ca = Ca::new("ca");
        let config = ca.config(&ca);
        // A plain source and a pre-shared-key source at a TLS destination.
        for (greeting, expected) in [
            (
                &crate::protocol::MAGIC[..],
                "the peer did not start a secure handshake (it sent a plain migration preamble)",
            ),
            (&super::super::modes::MAGIC[..], "the peer wants a pre-shared key (--psk-file) and this end uses TLS"),
        ] {
            let (mut x, mut y) = UnixStream::pair().unwrap();
            x.write_all(greeting).unwrap();
            x.write_all(&[0u8; 33]).unwrap();
            let e = tls_handshake(&mut y, &config, Role::Server, "").unwrap_err().to_string();
            assert!(e.starts_with(expected), "{e}");
            // The destination answers with a HELLO naming TLS.
            let mut hello = [0u8; super::super::modes::HELLO_LEN];
            x.read_exact(&mut hello).unwrap();
            let e = super::super::check_hello(&hello).unwrap_err().to_string();
            assert!(e.starts_with("the peer wants TLS certificates"), "{e}");
        }
        // Not TLS, not tsubame.
        let (mut x, mut y) = UnixStream::pair().unwrap();
        x.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let e = tls_handshake(&mut y, &config, Role::Server, "").unwrap_err();
        assert!(matches!(e, SecureError::NotSecure("unknown first bytes")), "{e}");
    }
}
