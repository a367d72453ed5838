//! Pre-copy trials: a kv guest (or a disk-writing guest on an image both
//! ends open), over a plain stream or an encrypted one (TLS, PSK), struck
//! at one point of the exchange.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::common::{scratch, spawn_run, try_control as control, wait_for_socket};
use crate::proxy::{Action, Point, Proxy};
use crate::{acked, guest_progresses, migration_end, read, Outcome, Rng};

/// How the two ends talk.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Channel {
    Plain,
    Tls,
    Psk,
}

const VM: &[&str] = &["--memory", "64M", "--workload", "kv", "--workload-arg", "wss=16M"];
const DISK_VM: &[&str] = &["--memory", "64M", "--workload", "disk-mixed", "--block-cache", "8M"];
/// Size of each disk trial's image.
const DISK_BYTES: u64 = 32 << 20;

/// One trial; with a disk, then checks the image against the last write
/// the surviving copy's guest saw acknowledged (`tsubame_block::records`):
/// every acknowledged write on it exactly once, intact, in its place.
pub fn trial(index: usize, rng: &mut Rng, action: Action, point: Point, disk: bool, channel: Channel) -> Outcome {
    let dir = scratch(&format!("faults-{index}"));
    let image = dir.join("disk.img");
    let mut vm: Vec<String> = (if disk { DISK_VM } else { VM }).iter().map(|s| s.to_string()).collect();
    if disk {
        std::fs::File::create(&image).unwrap().set_len(DISK_BYTES).unwrap();
        vm.extend(["--disk".to_string(), image.display().to_string()]);
    }
    let (outcome, acked) = trial_outcome(&dir, rng, action, point, &vm, channel);
    if !disk || !matches!(outcome, Outcome::OneRunning(_) | Outcome::GoneWithHost(_) | Outcome::SourcePausedSaysSo) {
        return outcome;
    }
    // Both processes are gone now (killed when the trial ended).
    let report = tsubame_block::records::check(&mut std::fs::File::open(&image).unwrap(), None, acked).unwrap();
    if report.run.is_none() || !report.ok() {
        return Outcome::Broken(format!("{outcome:?}, last acknowledged write {acked:?}: the image fails: {report:?}"));
    }
    outcome
}

/// The flags of `channel` for each end: (source, destination).
fn security(channel: Channel) -> (Vec<String>, Vec<String>) {
    let pki = crate::pki();
    match channel {
        Channel::Plain => (vec![], vec![]),
        Channel::Psk => {
            let psk = vec!["--psk-file".to_string(), pki.join("psk").display().to_string()];
            (psk.clone(), psk)
        }
        Channel::Tls => {
            let args = |leaf: &str| {
                let file = |name: String| pki.join(name).display().to_string();
                vec![
                    "--tls-cert".into(),
                    file(format!("{leaf}.pem")),
                    "--tls-key".into(),
                    file(format!("{leaf}.key")),
                    "--tls-ca".into(),
                    file("ca.pem".into()),
                ]
            };
            (args("client"), args("server"))
        }
    }
}

fn trial_outcome(
    dir: &Path,
    rng: &mut Rng,
    action: Action,
    point: Point,
    vm: &[String],
    channel: Channel,
) -> (Outcome, Option<u64>) {
    let vm: Vec<&str> = vm.iter().map(String::as_str).collect();
    let source_sock = dir.join("source.sock");
    let dest_sock = dir.join("dest.sock");
    let incoming = dir.join("incoming.sock");
    let dest_log = dir.join("dest.log");
    let (source_flags, dest_flags) = security(channel);
    let mut source = spawn_run(&source_sock, &vm, Stdio::null());
    let mut dest = crate::spawn_receive_with(&incoming, &dest_sock, &dest_log, &dest_flags);
    wait_for_socket(&source_sock);
    wait_for_socket(&dest_sock);
    std::thread::sleep(Duration::from_millis(200 + rng.below(200)));

    let proxy = Proxy::new(action, point, source.0.id(), dest.0.id(), false);
    let proxy_path = dir.join("proxy.sock");
    let relay = proxy.start(&proxy_path, incoming.clone());
    let channels = 1 + rng.below(2);
    let mut request = json!({
        "cmd": "migrate",
        "to": format!("unix:{}", proxy_path.display()),
        // Iterate a few times whatever the dirtying rate: later iterations exist.
        "downtime_limit_ms": 0,
        "max_iterations": 3 + rng.below(2),
        "channels": channels,
        "encode_threads": 2,
        // Post-copy's fault points are the post-copy modes'.
        "postcopy": "off",
    });
    // The request's keys for the files: psk_file, tls_cert, tls_key, tls_ca.
    for pair in source_flags.chunks(2) {
        request[pair[0].trim_start_matches("--").replace('-', "_")] = json!(pair[1]);
    }
    let reply = control(&source_sock, &request);
    if reply.as_ref().map(|r| r["ok"] != true).unwrap_or(true) {
        return (Outcome::Broken(format!("migrate request failed: {reply:?}")), None);
    }

    // Wait until the source's migration ended (or the source is gone).
    let source_query = migration_end(&mut source, &source_sock);
    proxy.stop.store(true, std::sync::atomic::Ordering::Release);
    // Wait until the destination settled: runs the VM, failed, or is gone.
    let deadline = Instant::now() + Duration::from_secs(45);
    loop {
        let log = read(&dest_log);
        let gave_up = log.contains("incoming migration failed") || log.contains("incoming migration refused");
        if !dest.alive() || log.contains("the VM runs here now") || gave_up {
            break;
        }
        if Instant::now() > deadline {
            return (Outcome::Broken(format!("destination never settled: {log}")), None);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = relay.join();
    let mut seen = std::mem::take(&mut *proxy.seen.lock().unwrap());
    if matches!(point, Point::Bytes { .. }) {
        // Frames are sealed: what COMMIT did, the ends' own words say.
        seen.commit_delivered = read(&dest_log).contains("committed");
        seen.commit_sent = true;
    }

    let source_status = control(&source_sock, &json!({"cmd": "stats"}));
    let dest_status = control(&dest_sock, &json!({"cmd": "stats"}));
    let source_running = source_status.as_ref().is_some_and(|s| s["status"] == "running");
    let source_paused = source_status.as_ref().is_some_and(|s| s["status"] == "paused");
    let dest_running = dest_status.as_ref().is_some_and(|s| s["status"] == "running");
    let dest_other = dest_status.as_ref().is_some_and(|s| s["status"] != "running" && s["status"] != "waiting");
    let describe = || {
        format!(
            "{action:?} at {point:?} ({channels} ch, {channel:?}), proxy {seen:?}: source {source_status:?}, query \
             {source_query}, destination {dest_status:?}, log: {}",
            read(&dest_log).trim().replace('\n', " | ")
        )
    };
    if dest_other {
        return (Outcome::Broken(format!("destination holds a VM that does not run: {}", describe())), None);
    }
    if source_running && dest_running {
        return (Outcome::Duplicated(describe()), None);
    }
    if source_running {
        if let Err(e) = guest_progresses(&source_sock) {
            return (Outcome::Broken(format!("{e}: {}", describe())), None);
        }
        if seen.commit_delivered {
            return (Outcome::Broken(format!("the source resumed after COMMIT: {}", describe())), None);
        }
        return (Outcome::OneRunning("source"), acked(&source_sock));
    }
    if dest_running {
        if let Err(e) = guest_progresses(&dest_sock) {
            return (Outcome::Broken(format!("{e}: {}", describe())), None);
        }
        if !read(&dest_log).contains("memory verified") {
            return (Outcome::Broken(format!("destination runs an unverified VM: {}", describe())), None);
        }
        if source_query["status"] == "completed" && source_query["stats"]["digest_verified"] != true {
            return (Outcome::Broken(format!("completed without digest_verified: {}", describe())), None);
        }
        return (Outcome::OneRunning("destination"), acked(&dest_sock));
    }
    let says_paused = source_query["stats"]["error"].as_str().is_some_and(|e| e.contains("stays paused here"));
    if source_paused && says_paused && seen.commit_sent {
        return (Outcome::SourcePausedSaysSo, acked(&source_sock));
    }
    if action == Action::KillSource && !seen.commit_delivered && !source.alive() {
        return (Outcome::GoneWithHost("the killed source, before COMMIT"), None);
    }
    (Outcome::Lost(describe()), None)
}
