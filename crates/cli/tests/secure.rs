//! Authenticated, encrypted migration with a pre-shared key or mutual
//! TLS: it works, a wrong key, a certificate from another CA or a peer of
//! another mode is refused on both sides with a clear error, and no guest
//! memory crosses a connection in the clear.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{control, kvm_or_skip, scratch, tsubame, wait_for_socket, Proc};
use serde_json::{json, Value};

/// A unique string the guest's memory holds (its multiboot command line).
const MARKER: &str = "seed=7391827364";

fn source(dir: &Path) -> Proc {
    let p = tsubame()
        .args(["run", "--quiet", "--memory", "64M", "--workload", "kv", "--workload-arg", "wss=8M"])
        .args(["--workload-arg", MARKER, "--control"])
        .arg(dir.join("source.sock"))
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_socket(&dir.join("source.sock"));
    Proc(p)
}

fn destination(dir: &Path, extra: &[&str]) -> Proc {
    let listen = format!("unix:{}", dir.join("in.sock").display());
    destination_on(dir, &listen, &[&["--once"], extra].concat())
}

/// A destination listening on `listen`, logging to dest.log.
fn destination_on(dir: &Path, listen: &str, extra: &[&str]) -> Proc {
    let p = tsubame()
        .args(["receive", "--quiet", "--listen", listen])
        .arg("--control")
        .arg(dir.join("dest.sock"))
        .args(extra)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("dest.log")).unwrap())
        .spawn()
        .unwrap();
    wait_for_socket(&dir.join("dest.sock"));
    Proc(p)
}

fn key(dir: &Path, name: &str, bytes: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

/// A connection the proxies relay (Unix or TCP).
trait Pipe: Read + Write + Send + Sized + 'static {
    fn dup(&self) -> Self;
    fn close(&self);
}

impl Pipe for UnixStream {
    fn dup(&self) -> Self {
        self.try_clone().unwrap()
    }
    fn close(&self) {
        let _ = self.shutdown(std::net::Shutdown::Both);
    }
}

impl Pipe for TcpStream {
    fn dup(&self) -> Self {
        self.try_clone().unwrap()
    }
    fn close(&self) {
        let _ = self.shutdown(std::net::Shutdown::Both);
    }
}

/// Relays `client` to `server` and back, recording what the client sends.
fn relay<P: Pipe>(client: P, server: P, record: Arc<Mutex<Vec<u8>>>) {
    let (mut c, mut s) = (client.dup(), server.dup());
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut s, &mut c);
        c.close();
    });
    std::thread::spawn(move || {
        let (mut from, mut to) = (client, server);
        let mut buf = vec![0u8; 1 << 16];
        while let Ok(n @ 1..) = from.read(&mut buf) {
            record.lock().unwrap().extend_from_slice(&buf[..n]);
            if to.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        to.close();
    });
}

/// Relays connections from `listen` to `target`, recording what the
/// source sends.
fn recording_proxy(listen: &Path, target: PathBuf) -> Arc<Mutex<Vec<u8>>> {
    let listener = UnixListener::bind(listen).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    std::thread::spawn(move || {
        for client in listener.incoming().flatten() {
            let Ok(server) = UnixStream::connect(&target) else { return };
            relay(client, server, record.clone());
        }
    });
    seen
}

/// As [`recording_proxy`], on TCP loopback; returns its port too.
fn tcp_recording_proxy(target: u16) -> (u16, Arc<Mutex<Vec<u8>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    std::thread::spawn(move || {
        for client in listener.incoming().flatten() {
            let Ok(server) = TcpStream::connect(("127.0.0.1", target)) else { return };
            relay(client, server, record.clone());
        }
    });
    (port, seen)
}

/// Migrates through the recording proxy; returns (exit code, output, stats, bytes seen).
fn migrate_recorded(dir: &Path, extra: &[&str]) -> (i32, String, Value, Vec<u8>) {
    let proxy = dir.join("proxy.sock");
    let _ = std::fs::remove_file(&proxy);
    let seen = recording_proxy(&proxy, dir.join("in.sock"));
    migrate_through(dir, &format!("unix:{}", proxy.display()), seen, extra)
}

/// Migrates to `to`, where a proxy records into `seen`.
fn migrate_through(dir: &Path, to: &str, seen: Arc<Mutex<Vec<u8>>>, extra: &[&str]) -> (i32, String, Value, Vec<u8>) {
    let json_path = dir.join("stats.json");
    let _ = std::fs::remove_file(&json_path);
    let out = tsubame()
        .args(["migrate", "--control"])
        .arg(dir.join("source.sock"))
        .arg("--to")
        .arg(to)
        .arg("--json")
        .arg(&json_path)
        .args(extra)
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let stats = std::fs::read_to_string(&json_path).map(|t| serde_json::from_str(&t).unwrap()).unwrap_or(Value::Null);
    std::thread::sleep(Duration::from_millis(200));
    let bytes = seen.lock().unwrap().clone();
    (out.status.code().unwrap_or(-1), text, stats, bytes)
}

fn contains(hay: &[u8], needle: &str) -> bool {
    hay.windows(needle.len()).any(|w| w == needle.as_bytes())
}

fn wait_log(dir: &Path, what: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let log = std::fs::read_to_string(dir.join("dest.log")).unwrap_or_default();
        if log.contains(what) || Instant::now() > deadline {
            return log;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// An encrypted migration completed, its memory verified, the destination
/// runs the VM, and the proxy saw neither guest memory nor the preamble.
fn assert_migrated_encrypted(dir: &Path, code: i32, text: &str, stats: &Value, bytes: &[u8]) {
    assert_eq!(code, 0, "{text}");
    assert_eq!(stats["digest_verified"], true);
    assert!(bytes.len() > 1 << 20, "only {} bytes went through the proxy", bytes.len());
    assert!(!contains(bytes, MARKER), "guest memory crossed the wire in the clear");
    assert!(!contains(bytes, "TSBMIGR"), "the migration preamble crossed the wire in the clear");
    let later = control(&dir.join("dest.sock"), &json!({"cmd": "stats"}));
    assert_eq!(later["status"], "running", "{later}");
}

#[test]
fn plain_stream_carries_guest_memory_in_the_clear() {
    // The control experiment: the marker is visible when nothing encrypts.
    if !kvm_or_skip() {
        return;
    }
    let dir = scratch("secure-plain");
    let _s = source(&dir);
    let _d = destination(&dir, &[]);
    let (code, text, _, bytes) = migrate_recorded(&dir, &[]);
    assert_eq!(code, 0, "{text}");
    assert!(contains(&bytes, MARKER), "the marker should travel in a plain stream");
}

#[test]
fn psk_migration_is_encrypted_and_completes() {
    if !kvm_or_skip() {
        return;
    }
    let dir = scratch("secure-psk");
    let k = key(&dir, "k", "a-shared-key-of-enough-bytes\n");
    let _s = source(&dir);
    let _d = destination(&dir, &["--psk-file", k.to_str().unwrap()]);
    let (code, text, stats, bytes) = migrate_recorded(&dir, &["--psk-file", k.to_str().unwrap(), "--channels", "2"]);
    assert_migrated_encrypted(&dir, code, &text, &stats, &bytes);
}

#[test]
fn wrong_key_is_refused_on_both_sides_and_nothing_leaks() {
    if !kvm_or_skip() {
        return;
    }
    let dir = scratch("secure-wrong");
    let ours = key(&dir, "ours", "the-source-key-0123456789");
    let theirs = key(&dir, "theirs", "the-destination-key-98765");
    let _s = source(&dir);
    let _d = destination(&dir, &["--psk-file", theirs.to_str().unwrap()]);
    let (code, text, stats, bytes) = migrate_recorded(&dir, &["--psk-file", ours.to_str().unwrap()]);
    assert_eq!(code, 1, "{text}");
    let error = stats["error"].as_str().unwrap_or_default();
    assert!(error.contains("the peer refused us: we do not hold its pre-shared key"), "{error}");
    assert!(error.contains("keeps running here"), "{error}");
    let log = wait_log(&dir, "refused");
    assert!(log.contains("the peer failed authentication: it does not hold our pre-shared key"), "{log}");
    assert!(bytes.len() < 200, "{} bytes went to an unauthenticated peer", bytes.len());
    assert!(!contains(&bytes, MARKER));
    let stats = control(&dir.join("source.sock"), &json!({"cmd": "stats"}));
    assert_eq!(stats["status"], "running");
}

#[test]
fn plain_peer_is_refused_by_a_psk_end() {
    if !kvm_or_skip() {
        return;
    }
    // A source with a key meets a plain destination, and the reverse.
    let dir = scratch("secure-mixed");
    let k = key(&dir, "k", "a-shared-key-of-enough-bytes");
    let _s = source(&dir);
    {
        let _d = destination(&dir, &[]);
        let (code, text, stats, bytes) = migrate_recorded(&dir, &["--psk-file", k.to_str().unwrap()]);
        assert_eq!(code, 1, "{text}");
        let error = stats["error"].as_str().unwrap_or_default();
        assert!(error.contains("did not start a secure handshake"), "{error}");
        assert!(!contains(&bytes, MARKER));
    }
    let _ = std::fs::remove_file(dir.join("proxy.sock"));
    let _ = std::fs::remove_file(dir.join("dest.sock"));
    let _d = destination(&dir, &["--psk-file", k.to_str().unwrap()]);
    let (code, text, _, _) = migrate_recorded(&dir, &[]);
    assert_eq!(code, 1, "{text}");
    let log = wait_log(&dir, "refused");
    assert!(log.contains("did not start a secure handshake (it sent a plain migration preamble)"), "{log}");
}

/// This host's address on its default route, if it has one that is not loopback.
fn outside_address() -> Option<std::net::IpAddr> {
    let s = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect("192.0.2.200:9").ok()?; // no packet is sent
    Some(s.local_addr().ok()?.ip()).filter(|ip| !ip.is_loopback() && !ip.is_unspecified())
}

#[test]
fn plain_tcp_to_another_host_needs_insecure() {
    if !kvm_or_skip() {
        return;
    }
    let Some(ip) = outside_address() else {
        panic!("this host has no non-loopback address to test with");
    };
    let dir = scratch("secure-insecure");
    let _s = source(&dir);
    let port = std::net::TcpListener::bind("0.0.0.0:0").unwrap().local_addr().unwrap().port();
    let _d = Proc(
        tsubame()
            .args(["receive", "--quiet", "--listen", &format!("tcp:0.0.0.0:{port}"), "--control"])
            .arg(dir.join("dest.sock"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("dest.log")).unwrap())
            .spawn()
            .unwrap(),
    );
    wait_for_socket(&dir.join("dest.sock"));
    let out = tsubame()
        .args(["migrate", "--control"])
        .arg(dir.join("source.sock"))
        .args(["--to", &format!("tcp:{ip}:{port}")])
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("refusing unencrypted TCP"), "{text}");
    // With --insecure the source goes ahead; the destination, without it,
    // refuses the connection from a non-loopback address.
    let out = tsubame()
        .args(["migrate", "--insecure", "--control"])
        .arg(dir.join("source.sock"))
        .args(["--to", &format!("tcp:{ip}:{port}")])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let log = wait_log(&dir, "refused");
    assert!(log.contains("refusing unencrypted TCP"), "{log}");
}

/// Certificates for the TLS tests, made with rcgen in the scratch dir:
/// `ca.pem` signs `server` and `client`; `other-ca.pem` signs `rogue-server`
/// and `rogue-client`. Every certificate names localhost and 127.0.0.1.
struct Pki(PathBuf);

impl Pki {
    fn new(dir: &Path) -> Pki {
        let ca = |name: &str| {
            let key = rcgen::KeyPair::generate().unwrap();
            let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
            params.distinguished_name.push(rcgen::DnType::CommonName, name);
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            let cert = params.self_signed(&key).unwrap();
            std::fs::write(dir.join(format!("{name}.pem")), cert.pem()).unwrap();
            (cert, key)
        };
        for (ca_name, leaves) in [("ca", ["server", "client"]), ("other-ca", ["rogue-server", "rogue-client"])] {
            let (ca_cert, ca_key) = ca(ca_name);
            for leaf in leaves {
                let key = rcgen::KeyPair::generate().unwrap();
                let mut params = rcgen::CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into()]).unwrap();
                params.distinguished_name.push(rcgen::DnType::CommonName, leaf);
                let cert = params.signed_by(&key, &ca_cert, &ca_key).unwrap();
                std::fs::write(dir.join(format!("{leaf}.pem")), cert.pem()).unwrap();
                std::fs::write(dir.join(format!("{leaf}.key")), key.serialize_pem()).unwrap();
            }
        }
        Pki(dir.to_path_buf())
    }

    /// `--tls-cert`, `--tls-key`, `--tls-ca` for the certificate `leaf`,
    /// trusting the CA `ca`.
    fn args(&self, leaf: &str, ca: &str) -> Vec<String> {
        let file = |name: String| self.0.join(name).display().to_string();
        vec![
            "--tls-cert".into(),
            file(format!("{leaf}.pem")),
            "--tls-key".into(),
            file(format!("{leaf}.key")),
            "--tls-ca".into(),
            file(format!("{ca}.pem")),
        ]
    }
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn tls_migration_is_encrypted_and_completes() {
    if !kvm_or_skip() {
        return;
    }
    // Over TCP loopback: the source checks the destination's certificate
    // against the IP address it dials.
    let dir = scratch("secure-tls");
    let pki = Pki::new(&dir);
    let _s = source(&dir);
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let _d = destination_on(&dir, &format!("tcp:127.0.0.1:{port}"), &strs(&pki.args("server", "ca")));
    let (proxy, seen) = tcp_recording_proxy(port);
    let client = pki.args("client", "ca");
    let extra = [strs(&client), vec!["--channels", "2"]].concat();
    let (code, text, stats, bytes) = migrate_through(&dir, &format!("tcp:127.0.0.1:{proxy}"), seen, &extra);
    assert_migrated_encrypted(&dir, code, &text, &stats, &bytes);
    assert_eq!(stats["pipeline"]["channels"], 2, "{stats}");
    // A TLS handshake record first, then nothing in the clear.
    assert_eq!(bytes[..3], [0x16, 0x03, 0x01], "the source did not start with a TLS ClientHello");
}

#[test]
fn certificates_from_another_ca_are_refused_on_both_sides_and_nothing_leaks() {
    if !kvm_or_skip() {
        return;
    }
    let dir = scratch("secure-tls-ca");
    let pki = Pki::new(&dir);
    let mut s = source(&dir);
    let listen = format!("unix:{}", dir.join("in.sock").display());
    let check_refused = |bytes: &[u8], stats: &Value, s: &mut Proc| {
        assert!(bytes.len() < 4096, "{} bytes went to an unauthenticated peer", bytes.len());
        assert!(!contains(bytes, MARKER));
        assert!(stats["error"].as_str().unwrap_or_default().contains("keeps running here"), "{stats}");
        assert!(s.alive());
        assert_eq!(control(&dir.join("source.sock"), &json!({"cmd": "stats"}))["status"], "running");
    };
    {
        // The source's certificate is signed by a CA the destination does
        // not trust; the destination refuses it and keeps listening.
        let mut d = destination_on(&dir, &listen, &strs(&pki.args("server", "ca")));
        let (code, text, stats, bytes) = migrate_recorded(&dir, &strs(&pki.args("rogue-client", "ca")));
        assert_eq!(code, 1, "{text}");
        let error = stats["error"].as_str().unwrap_or_default();
        assert!(
            error.contains(
                "the peer refused our certificate: it is not signed by the peer's --tls-ca (TLS alert unknown_ca)"
            ),
            "{error}"
        );
        let log = wait_log(&dir, "refused");
        assert!(log.contains("incoming migration refused"), "{log}");
        assert!(log.contains("the peer's certificate is not signed by --tls-ca"), "{log}");
        check_refused(&bytes, &stats, &mut s);
        // Still listening: the right certificate goes through.
        assert!(d.alive(), "the destination gave up after a refused peer");
        let (code, text, stats, _) = migrate_recorded(&dir, &strs(&pki.args("client", "ca")));
        assert_eq!(code, 0, "{text}");
        assert_eq!(stats["digest_verified"], true);
    }
    // The VM now runs at that destination: start again with a new source.
    drop(s);
    for f in ["source.sock", "dest.sock", "in.sock", "dest.log"] {
        let _ = std::fs::remove_file(dir.join(f));
    }
    let mut s = source(&dir);
    // The destination's certificate is signed by a CA the source does not trust.
    let mut d = destination_on(&dir, &listen, &strs(&pki.args("rogue-server", "ca")));
    let (code, text, stats, bytes) = migrate_recorded(&dir, &strs(&pki.args("client", "ca")));
    assert_eq!(code, 1, "{text}");
    let error = stats["error"].as_str().unwrap_or_default();
    assert!(error.contains("the peer's certificate is not signed by --tls-ca"), "{error}");
    let log = wait_log(&dir, "refused");
    assert!(
        log.contains(
            "the peer refused our certificate: it is not signed by the peer's --tls-ca (TLS alert unknown_ca)"
        ),
        "{log}"
    );
    check_refused(&bytes, &stats, &mut s);
    assert!(d.alive(), "the destination gave up after a refused peer");
}

#[test]
fn peers_of_another_mode_are_refused_by_a_tls_end() {
    if !kvm_or_skip() {
        return;
    }
    let dir = scratch("secure-tls-mixed");
    let pki = Pki::new(&dir);
    let k = key(&dir, "k", "a-shared-key-of-enough-bytes");
    let _s = source(&dir);
    let listen = format!("unix:{}", dir.join("in.sock").display());
    let server = pki.args("server", "ca");
    let client = pki.args("client", "ca");
    let psk = ["--psk-file", k.to_str().unwrap()];
    // (destination flags, source flags, the source's error, the destination's log)
    let cases: [(&[&str], &[&str], &str, &str); 4] = [
        (
            &strs(&server),
            &[],
            "the peer started a tsubame secure handshake, and this end is plain",
            "the peer did not start a secure handshake (it sent a plain migration preamble)",
        ),
        (
            &strs(&server),
            &psk,
            "the peer wants TLS certificates (--tls-cert, --tls-key, --tls-ca) and this end uses a pre-shared key",
            "the peer wants a pre-shared key (--psk-file) and this end uses TLS certificates",
        ),
        (
            &[],
            &strs(&client),
            "the peer did not start a secure handshake (it sent a plain migration preamble)",
            "the peer started a TLS handshake, and this end is plain",
        ),
        (
            &psk,
            &strs(&client),
            "the peer wants a pre-shared key (--psk-file) and this end uses TLS certificates",
            "the peer wants TLS certificates (--tls-cert, --tls-key, --tls-ca) and this end uses a pre-shared key",
        ),
    ];
    for (destination_flags, source_flags, source_error, destination_error) in cases {
        let _ = std::fs::remove_file(dir.join("dest.sock"));
        let _d = destination_on(&dir, &listen, destination_flags);
        let (code, text, stats, bytes) = migrate_recorded(&dir, source_flags);
        assert_eq!(code, 1, "{text}");
        let error = stats["error"].as_str().unwrap_or_default();
        assert!(error.contains(source_error), "{source_flags:?} → {destination_flags:?}: {error}");
        let log = wait_log(&dir, destination_error);
        assert!(log.contains(destination_error), "{source_flags:?} → {destination_flags:?}: {log}");
        assert!(!contains(&bytes, MARKER));
    }
    let stats = control(&dir.join("source.sock"), &json!({"cmd": "stats"}));
    assert_eq!(stats["status"], "running");
}

#[test]
fn tls_flags_go_together_and_bad_files_are_named() {
    let dir = scratch("secure-tls-flags");
    let pki = Pki::new(&dir);
    let run = |args: &[&str]| {
        let out = tsubame().args(["receive", "--listen", "unix:/nonexistent/in.sock"]).args(args).output().unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let server = pki.args("server", "ca");
    let (code, err) = run(&strs(&server[..2]));
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--tls-key") && err.contains("--tls-ca"), "{err}");
    let (code, err) = run(&[strs(&server), vec!["--psk-file", "k"]].concat());
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("cannot be used with"), "{err}");
    // The certificate given as the key: named by flag and path.
    let mut swapped = server.clone();
    swapped[3] = server[1].clone();
    let (code, err) = run(&strs(&swapped));
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains(&format!("--tls-key {}: no PRIVATE KEY in it", server[1])), "{err}");
    // A key of another certificate.
    let mut mismatched = server.clone();
    mismatched[3] = pki.args("client", "ca")[3].clone();
    let (code, err) = run(&strs(&mismatched));
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("does not match the certificate of --tls-cert"), "{err}");
}
