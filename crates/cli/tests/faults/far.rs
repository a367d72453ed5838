//! Far-memory trials: a kv VM with most of its memory on two mirrored
//! memory hosts (`nbdkit memory`), one or both of which are killed while
//! the VM runs or while it migrates (pre-copy; the destination attaches
//! to the same hosts).
//!
//! One host of two dying loses nothing: one copy runs, its guest goes on
//! and sees no bad memory (kv checks every value it reads back, and each
//! far page is checked against its hash). Both dying leave the VM's far
//! pages nowhere: the copy that holds the VM must pause, say "far memory
//! lost" and never run on with wrong memory.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::common::{scratch, try_control as control, tsubame, wait_for_socket, MemoryHost, Proc};
use crate::{migration_end, read, Outcome, Rng};

/// Which hosts die, and when.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FarPoint {
    pub both: bool,
    pub migrating: bool,
}

impl FarPoint {
    pub fn in_turn(k: usize) -> FarPoint {
        FarPoint { both: k % 4 >= 2, migrating: k % 2 == 1 }
    }

    pub fn name(&self) -> String {
        let hosts = if self.both { "both memory hosts die" } else { "one memory host of two dies" };
        format!("{hosts}, {}", if self.migrating { "migrating" } else { "running" })
    }
}

fn far(stats: &Value, key: &str) -> u64 {
    stats["far_memory"][key].as_u64().unwrap_or(0)
}

/// Polls `stats` until `done` holds; the last reply either way.
fn wait(socket: &Path, seconds: u64, done: impl Fn(&Value) -> bool) -> Result<Value, Value> {
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut last = Value::Null;
    while Instant::now() < deadline {
        match control(socket, &json!({"cmd": "stats"})) {
            Some(s) if done(&s) => return Ok(s),
            Some(s) => last = s,
            None => return Err(last),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(last)
}

/// The copy at `socket` runs on: its guest does 1000 more operations
/// (eviction pauses it for milliseconds at a time) and saw no bad memory.
fn runs_on(socket: &Path) -> Result<(), String> {
    let ops = |s: &Value| s["guest"]["ops"].as_u64().unwrap_or(0);
    let first = control(socket, &json!({"cmd": "stats"})).ok_or("no stats")?;
    let later = wait(socket, 20, |s| {
        !s["guest"]["error"].is_null() || (s["status"] == "running" && ops(s) > ops(&first) + 1000)
    })
    .map_err(|s| format!("the guest does not go on: {s}"))?;
    if !later["guest"]["error"].is_null() || !later["far_memory"]["error"].is_null() {
        return Err(format!("the guest or far memory failed: {later}"));
    }
    Ok(())
}

/// The copy at `socket` lost its far memory: it says so, its guest makes
/// no progress and saw no bad memory.
fn paused_for_far_loss(socket: &Path) -> Result<(), String> {
    let said = wait(socket, 30, |s| s["far_memory"]["error"].as_str().is_some_and(|e| e.contains("far memory lost")))
        .map_err(|s| format!("never said far memory lost: {s}"))?;
    std::thread::sleep(Duration::from_millis(300));
    let ops = |s: Option<Value>| s.map(|s| (s["guest"]["ops"].as_u64(), s["guest"]["error"].is_null()));
    let before = ops(control(socket, &json!({"cmd": "stats"})));
    std::thread::sleep(Duration::from_millis(500));
    let after = ops(control(socket, &json!({"cmd": "stats"})));
    match (before, after) {
        (Some((a, true)), Some((b, true))) if a == b => Ok(()),
        _ => Err(format!("ran on or saw bad memory after the loss: {said} then {after:?}")),
    }
}

pub fn trial(index: usize, rng: &mut Rng, point: FarPoint) -> Outcome {
    let dir = scratch(&format!("faults-far-{index}"));
    let mut hosts = [MemoryHost::start(&dir, "first", "128M"), MemoryHost::start(&dir, "second", "128M")];
    let uris = format!("{},{}", hosts[0].uri(), hosts[1].uri());
    let (source_sock, dest_sock, incoming) = (dir.join("source.sock"), dir.join("dest.sock"), dir.join("in.sock"));
    let dest_log = dir.join("dest.log");
    let mut source = Proc(
        tsubame()
            .args(["run", "--quiet", "--control"])
            .arg(&source_sock)
            .args(["--memory", "128M", "--local-memory", "32M", "--workload", "kv", "--workload-arg", "wss=96M"])
            .args(["--far-memory", &uris])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut dest = crate::spawn_receive_with(&incoming, &dest_sock, &dest_log, &[]);
    wait_for_socket(&source_sock);
    wait_for_socket(&dest_sock);
    if let Err(s) = wait(&source_sock, 60, |s| far(s, "far_pages") > 4000 && far(s, "faults") > 500) {
        return Outcome::Broken(format!("pages never went far: {s}"));
    }
    let mut source_query = Value::Null;
    let victim = rng.below(2) as usize;
    if point.migrating {
        let request = json!({"cmd": "migrate", "to": format!("unix:{}", incoming.display()), "postcopy": "off"});
        if control(&source_sock, &request).is_none_or(|r| r["ok"] != true) {
            return Outcome::Broken("migrate request failed".into());
        }
        std::thread::sleep(Duration::from_millis(rng.below(600)));
    }
    hosts[victim].kill();
    if point.both {
        hosts[1 - victim].kill();
    }
    if point.migrating {
        source_query = migration_end(&mut source, &source_sock);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let log = read(&dest_log);
            if !dest.alive() || log.contains("the VM runs here now") || log.contains("incoming migration failed") {
                break;
            }
            if source_query["status"] == "failed" || Instant::now() > deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let status = |sock: &Path| control(sock, &json!({"cmd": "stats"})).map(|s| s["status"].as_str().map(String::from));
    let (source_status, dest_status) = (status(&source_sock).flatten(), status(&dest_sock).flatten());
    let describe = || {
        format!(
            "{point:?} (host {victim} first): source {source_status:?}, query {source_query}, destination \
             {dest_status:?}, log: {}",
            read(&dest_log).trim().replace('\n', " | ")
        )
    };
    // Far memory pauses a VM for moments (each eviction batch), so a copy
    // that holds the VM may be found paused; two running at once is a
    // duplicate.
    let running = |s: &Option<String>| s.as_deref() == Some("running");
    if running(&source_status) && running(&dest_status) {
        return Outcome::Duplicated(describe());
    }
    let holder = if source_query["status"] == "completed" {
        // The VM left: the source must not run it again.
        if running(&status(&source_sock).flatten()) {
            return Outcome::Duplicated(describe());
        }
        ("destination", &dest_sock)
    } else {
        // Not migrated (or the migration failed): the destination holds
        // nothing.
        if matches!(dest_status.as_deref(), Some("running" | "paused")) {
            return Outcome::Broken(format!("the destination holds a VM the source kept: {}", describe()));
        }
        ("source", &source_sock)
    };
    if !source.alive() && holder.0 == "source" {
        return Outcome::Lost(describe());
    }
    if point.both {
        // The copy pauses once it needs a far page; were every far page it
        // touched within the wait still resident, it would run on.
        return match paused_for_far_loss(holder.1) {
            Ok(()) => Outcome::GoneWithHost("both memory hosts (paused, says far memory lost)"),
            Err(e) => match runs_on(holder.1) {
                Ok(()) => Outcome::OneRunning(holder.0),
                Err(_) => Outcome::Broken(format!("{} copy: {e}: {}", holder.0, describe())),
            },
        };
    }
    match runs_on(holder.1) {
        Err(e) => Outcome::Broken(format!("{} copy: {e}: {}", holder.0, describe())),
        Ok(()) => Outcome::OneRunning(holder.0),
    }
}
