//! A VM with a virtio-blk disk on shared storage, migrated: the guest
//! keeps reading and writing at the destination, a warm migration fills
//! the destination's block cache before the VM arrives (and drops the
//! blocks the guest wrote meanwhile), and bad disk options are one-line
//! errors.

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;

use common::{control, kvm_or_skip, scratch, spawn_receive, spawn_run, tsubame, wait_for_socket};
use serde_json::{json, Value};

/// A sparse image of `bytes`.
fn image(dir: &Path, bytes: u64) -> PathBuf {
    let path = dir.join("disk.img");
    std::fs::File::create(&path).unwrap().set_len(bytes).unwrap();
    path
}

/// Waits until the guest's latest progress line satisfies `done`.
fn wait_guest(socket: &Path, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    common::wait_stats(socket, what, 30, |stats| done(&stats["guest"]))
}

fn field(guest: &Value, key: &str) -> u64 {
    guest["fields"][key].as_u64().unwrap_or(0)
}

/// Migrates the VM at `source` to `incoming`; returns the statistics JSON.
fn migrate(dir: &Path, source: &Path, incoming: &Path, extra: &[&str]) -> Value {
    let json_path = dir.join("stats.json");
    let out = tsubame()
        .arg("migrate")
        .arg("--control")
        .arg(source)
        .arg("--to")
        .arg(format!("unix:{}", incoming.display()))
        .arg("--json")
        .arg(&json_path)
        .args(extra)
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "migrate failed: {text}");
    serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap()
}

/// Boots disk-seq over a 16 MiB region behind a 32 MiB cache, lets it read
/// the region twice (the source's cache holds it), migrates, and returns
/// the migration's statistics and the destination's disk statistics once
/// its guest read on.
fn migrate_disk_seq(name: &str, extra: &[&str]) -> (Value, Value) {
    let dir = scratch(name);
    let disk = image(&dir, 64 << 20);
    let (source_sock, dest_sock, incoming) = (dir.join("source.sock"), dir.join("dest.sock"), dir.join("in.sock"));
    let disk_arg = disk.display().to_string();
    let vm = [
        "--memory",
        "64M",
        "--workload",
        "disk-seq",
        "--workload-arg",
        "disk=16M",
        "--disk",
        &disk_arg,
        "--block-cache",
        "32M",
    ];
    let _source = spawn_run(&source_sock, &vm, Stdio::null());
    let _dest = spawn_receive(&incoming, Some(&dest_sock), Stdio::null());
    wait_for_socket(&source_sock);
    wait_for_socket(&dest_sock);
    let before = wait_guest(&source_sock, "two passes over the region", |g| g["pass"].as_u64() >= Some(2));
    let stats = migrate(&dir, &source_sock, &incoming, extra);
    assert_eq!(stats["status"], "completed", "{stats}");
    assert_eq!(stats["digest_verified"], true);
    assert!(field(&before["guest"], "rd") > 0, "{before}");
    // 8 MiB read by the guest here (its count in the progress line
    // includes what it read at the source during the migration).
    let after = common::wait_stats(&dest_sock, "reading on at the destination", 30, |stats| {
        stats["disk"]["bytes_read"].as_u64().unwrap_or(0) > 8 << 20
    });
    (stats, after["disk"].clone())
}

#[test]
fn a_warm_migration_fills_the_destination_cache() {
    if !kvm_or_skip() {
        return;
    }
    let (stats, disk) = migrate_disk_seq("disk-warm", &[]);
    let listed = stats["warm_cache"]["blocks_listed"].as_u64().unwrap_or(0);
    assert!(listed >= 4096, "the 16 MiB region's blocks are named ahead: {stats}");
    let cache = &disk["cache"];
    // Read ahead from storage (as far as it got before the VM arrived:
    // this one moves in a blink) or sent over the link.
    assert!(cache["warmed_blocks"].as_u64().unwrap() > 0, "the destination read them ahead: {disk}");
    // The guest's reads at the destination are hits: storage served little
    // more than the warm fill itself (none of it when the source's WARM_DATA
    // came first).
    let from_storage = cache["bytes_from_storage"].as_u64().unwrap();
    assert!(from_storage < (16 << 20) + (4 << 20), "cold reads at the destination: {disk}");
    let (hits, misses) = (cache["hits"].as_u64().unwrap(), cache["misses"].as_u64().unwrap());
    assert!(hits > 200 && misses * 10 < hits, "{disk}");
    // By default contents went until they were 2 s of the guest's reads
    // (at its recent rate) ahead of where it read when the list went.
    let warm = &stats["warm_cache"];
    let rate = warm["read_bytes_per_sec"].as_f64().unwrap();
    assert!(rate > 0.0, "the guest was reading: {stats}");
    let sent = warm["blocks_sent"].as_u64().unwrap();
    let ahead = rate * (stats["total_time_ms"].as_f64().unwrap() / 1e3 + 2.0);
    assert!(sent > 0 && (sent - sent.min(256)) as f64 * 4096.0 <= ahead, "{stats}");
    assert!(cache["warmed_blocks"].as_u64().unwrap() >= sent.min(4000), "{stats} {disk}");
}

#[test]
fn warm_data_sends_all_contents_or_none() {
    if !kvm_or_skip() {
        return;
    }
    let (stats, _) = migrate_disk_seq("disk-warm-all", &["--warm-data", "all"]);
    let warm = &stats["warm_cache"];
    assert_eq!(warm["blocks_sent"], warm["blocks_listed"], "every cached block's contents went: {stats}");
    // The list only: the destination reads every block from storage.
    let (stats, disk) = migrate_disk_seq("disk-warm-list", &["--warm-data", "none"]);
    // (as far as it got before the VM arrived: this one moves in a blink).
    assert_eq!(stats["warm_cache"]["blocks_sent"], 0, "{stats}");
    assert!(disk["cache"]["warmed_blocks"].as_u64().unwrap() > 0, "filled from storage: {disk}");
}

#[test]
fn a_post_copy_migration_warms_the_destination_cache_too() {
    if !kvm_or_skip() {
        return;
    }
    // Post-copy at once: the block list still goes first and the
    // destination fills its cache from storage until the VM's state
    // arrives (how far it gets depends on how long that takes; a block
    // not reached is read on first access), so the VM lands on a cache
    // that is not cold.
    let (stats, disk) = migrate_disk_seq("disk-warm-postcopy", &["--postcopy", "after=0"]);
    assert!(!stats["postcopy"].is_null(), "the migration switched to post-copy: {stats}");
    assert!(stats["warm_cache"]["blocks_listed"].as_u64().unwrap_or(0) >= 4096, "{stats}");
    let cache = &disk["cache"];
    assert!(cache["warmed_blocks"].as_u64().unwrap() > 0, "{disk}");
}

#[test]
fn without_warm_migration_the_destination_starts_cold() {
    if !kvm_or_skip() {
        return;
    }
    let (stats, disk) = migrate_disk_seq("disk-cold", &["--no-warm-cache"]);
    assert!(stats["warm_cache"].is_null(), "{stats}");
    let cache = &disk["cache"];
    assert_eq!(cache["warmed_blocks"], 0, "{disk}");
    // Every block the guest read here came from storage (read-ahead may
    // have fetched more) the first time: a guest that went on past its
    // 16 MiB region before the stats were taken reads it again from the
    // cache.
    let (from_storage, read) = (cache["bytes_from_storage"].as_u64().unwrap(), disk["bytes_read"].as_u64().unwrap());
    assert!(read > 1 << 20 && from_storage >= read.min(16 << 20), "the guest's reads went to storage: {disk}");
}

#[test]
fn disk_mixed_writes_survive_a_migration_exactly_once() {
    if !kvm_or_skip() {
        return;
    }
    let dir = scratch("disk-mixed");
    let disk = image(&dir, 32 << 20);
    let (source_sock, dest_sock, incoming) = (dir.join("source.sock"), dir.join("dest.sock"), dir.join("in.sock"));
    let disk_arg = disk.display().to_string();
    let vm = ["--memory", "64M", "--workload", "disk-mixed", "--disk", &disk_arg, "--block-cache", "8M"];
    let _source = spawn_run(&source_sock, &vm, Stdio::null());
    let dest = spawn_receive(&incoming, Some(&dest_sock), Stdio::null());
    wait_for_socket(&source_sock);
    wait_for_socket(&dest_sock);
    let before = wait_guest(&source_sock, "writes", |g| field(g, "ack") > 200);
    let stats = migrate(&dir, &source_sock, &incoming, &[]);
    assert_eq!(stats["status"], "completed", "{stats}");
    let acked_before = field(&before["guest"], "ack");
    let after = wait_guest(&dest_sock, "writes at the destination", |g| field(g, "ack") > acked_before + 200);
    control(&dest_sock, &json!({"cmd": "pause"}));
    let acked =
        field(&control(&dest_sock, &json!({"cmd": "stats"}))["guest"], "ack").max(field(&after["guest"], "ack"));
    drop(dest);
    let report = tsubame_block::records::check(&mut std::fs::File::open(&disk).unwrap(), None, Some(acked)).unwrap();
    assert!(report.ok() && report.run.is_some(), "acknowledged up to {acked}: {report:?}");
    // The command-line checker agrees.
    let out = tsubame().arg("disk-check").arg(&disk).arg("--acked").arg(acked.to_string()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn bad_disk_options_are_one_line_errors() {
    let dir = scratch("disk-bad");
    let cases: [(&[&str], i32, &str); 4] = [
        (&["--workload", "disk-seq"], 2, "needs a disk"),
        (&["--workload", "kv", "--disk", "http://host/x"], 2, "unknown scheme"),
        (&["--workload", "kv", "--disk", "x.img", "--block-cache", "lots"], 2, "--block-cache"),
        (&["--workload", "kv", "--disk", "/nonexistent/disk.img"], 1, "cannot open disk image"),
    ];
    for (args, code, says) in cases {
        if code == 1 && !kvm_or_skip() {
            continue;
        }
        let out = tsubame().args(["run", "--memory", "16M", "--seconds", "1"]).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
    }
    let out = tsubame().arg("disk-check").arg(dir.join("none.img")).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let out = tsubame().args(["disk-create", "--size", "1000"]).arg(dir.join("new.img")).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn a_destination_that_sees_another_disk_fails_the_migration_and_the_source_runs_on() {
    if !kvm_or_skip() {
        return;
    }
    // The same relative path names a 64 MiB image at the source and a
    // 32 MiB one at the destination: as two hosts whose mounts differ.
    let dir = scratch("disk-mismatch");
    let (src_dir, dst_dir) = (dir.join("src"), dir.join("dst"));
    for (d, bytes) in [(&src_dir, 64u64 << 20), (&dst_dir, 32 << 20)] {
        std::fs::create_dir_all(d).unwrap();
        image(d, bytes);
    }
    let (source_sock, incoming) = (dir.join("source.sock"), dir.join("in.sock"));
    let _source = common::Proc(
        tsubame()
            .current_dir(&src_dir)
            .args(["run", "--quiet", "--control"])
            .arg(&source_sock)
            .args(["--memory", "64M", "--workload", "disk-mixed", "--disk", "disk.img", "--block-cache", "8M"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let _dest = common::Proc(
        tsubame()
            .current_dir(&dst_dir)
            .args(["receive", "--quiet", "--listen"])
            .arg(format!("unix:{}", incoming.display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for_socket(&source_sock);
    let before = wait_guest(&source_sock, "writes", |g| field(g, "ack") > 50);
    let out = tsubame()
        .arg("migrate")
        .arg("--control")
        .arg(&source_sock)
        .arg("--to")
        .arg(format!("unix:{}", incoming.display()))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("bytes here") && err.contains("at the source"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    // The source's guest writes on, and its disk holds every acknowledged
    // write.
    let acked = field(&before["guest"], "ack");
    let after = wait_guest(&source_sock, "writes after the failed migration", |g| field(g, "ack") > acked + 100);
    assert_eq!(after["status"], "running", "{after}");
}

#[test]
fn an_unreachable_nbd_server_is_a_one_line_error() {
    if !kvm_or_skip() {
        return;
    }
    // Port 1 on loopback: nothing listens, the connection is refused.
    let out = tsubame()
        .args(["run", "--memory", "16M", "--seconds", "1", "--workload", "kv", "--disk", "nbd://127.0.0.1:1/x"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("127.0.0.1:1"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}
