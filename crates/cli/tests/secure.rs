//! Authenticated, encrypted migration with a pre-shared key: it works,
//! a wrong key or a plain peer is refused on both sides with a clear
//! error, and no guest memory crosses a connection in the clear.

mod common;

use std::io::{Read, Write};
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
    let p = tsubame()
        .args(["receive", "--quiet", "--once", "--listen"])
        .arg(format!("unix:{}", dir.join("in.sock").display()))
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

/// Relays one connection at a time from `listen` to `target`, recording
/// what the source sends.
fn recording_proxy(listen: &Path, target: PathBuf) -> Arc<Mutex<Vec<u8>>> {
    let listener = UnixListener::bind(listen).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    std::thread::spawn(move || {
        for client in listener.incoming().flatten() {
            let Ok(server) = UnixStream::connect(&target) else { return };
            let (mut c, mut s) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut s, &mut c);
                let _ = c.shutdown(std::net::Shutdown::Both);
            });
            let record = record.clone();
            std::thread::spawn(move || {
                let (mut from, mut to) = (client, server);
                let mut buf = vec![0u8; 1 << 16];
                while let Ok(n @ 1..) = from.read(&mut buf) {
                    record.lock().unwrap().extend_from_slice(&buf[..n]);
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = to.shutdown(std::net::Shutdown::Both);
            });
        }
    });
    seen
}

/// Migrates through the recording proxy; returns (exit code, output, stats, bytes seen).
fn migrate_recorded(dir: &Path, extra: &[&str]) -> (i32, String, Value, Vec<u8>) {
    let proxy = dir.join("proxy.sock");
    let seen = recording_proxy(&proxy, dir.join("in.sock"));
    let json_path = dir.join("stats.json");
    let out = tsubame()
        .args(["migrate", "--control"])
        .arg(dir.join("source.sock"))
        .arg("--to")
        .arg(format!("unix:{}", proxy.display()))
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
    assert_eq!(code, 0, "{text}");
    assert_eq!(stats["digest_verified"], true);
    assert!(bytes.len() > 1 << 20, "only {} bytes went through the proxy", bytes.len());
    assert!(!contains(&bytes, MARKER), "guest memory crossed the wire in the clear");
    assert!(!contains(&bytes, "TSBMIGR"), "the migration preamble crossed the wire in the clear");
    let later = control(&dir.join("dest.sock"), &json!({"cmd": "stats"}));
    assert_eq!(later["status"], "running", "{later}");
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
