//! Far memory against a real memory host (`nbdkit memory`; without it
//! these tests are skipped, or fail under TSUBAME_REQUIRE_TOOLS): every
//! workload runs with most of its memory far, a mirrored memory host may
//! die, losing every host pauses the VM with a clear error, and bad
//! exports are one-line errors before any VM runs. A VM with far memory
//! migrates: only its resident pages move, the destination attaches to
//! the same memory host, and the guest goes on there.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{control, kvm_or_skip, scratch, spawn_receive, tsubame, wait_for_socket, wait_stats, MemoryHost, Proc};
use serde_json::{json, Value};

/// `tsubame run` of a 128 MiB VM with 32 MiB local and the rest far.
fn run_far(control_sock: &Path, workload: &str, far: &[String]) -> Proc {
    Proc(
        tsubame()
            .args(["run", "--quiet", "--control"])
            .arg(control_sock)
            .args(["--memory", "128M", "--local-memory", "32M", "--workload", workload])
            .args(["--workload-arg", "wss=96M"])
            .arg("--far-memory")
            .arg(far.join(","))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    )
}

fn far(stats: &Value, key: &str) -> u64 {
    stats["far_memory"][key].as_u64().unwrap_or(0)
}

#[test]
fn every_workload_runs_with_most_of_its_memory_far() {
    if !kvm_or_skip() || !tsubame_testkit::program("nbdkit") {
        return;
    }
    let dir = scratch("far-workloads");
    let host = MemoryHost::start(&dir, "host", "128M");
    for workload in ["kv", "bwmem", "fill-random", "sparse", "zero-clear", "stream", "fill-zero", "idle"] {
        let sock = dir.join(format!("{workload}.sock"));
        let _vm = run_far(&sock, workload, &[host.uri()]);
        wait_for_socket(&sock);
        // Pages went far and came back, and the guest went on (kv checks
        // every value it reads, so a page that came back wrong fails it).
        let first = wait_stats(&sock, workload, 60, |s| far(s, "far_pages") > 1000 && far(s, "faults") > 1000);
        let ops = first["guest"]["ops"].as_u64().unwrap_or(0);
        let stats = wait_stats(&sock, workload, 60, |s| s["guest"]["ops"].as_u64().unwrap_or(0) > ops + 100);
        let limit = far(&stats, "local_limit_bytes") / 4096;
        assert!(far(&stats, "resident_max_pages") <= limit, "{workload}: over the limit: {stats}");
        assert_eq!(stats["far_memory"]["error"], Value::Null, "{stats}");
        let memory = control(&sock, &json!({"cmd": "query-memory"}));
        assert_eq!(memory["memory_bytes"], 128 << 20, "{memory}");
        assert!(far(&memory, "evicted_pages") > 0, "{memory}");
        control(&sock, &json!({"cmd": "quit"}));
    }
}

#[test]
fn a_mirrored_memory_host_may_die_and_the_vm_runs_on() {
    if !kvm_or_skip() || !tsubame_testkit::program("nbdkit") {
        return;
    }
    let dir = scratch("far-mirror");
    let mut first = MemoryHost::start(&dir, "first", "128M");
    let second = MemoryHost::start(&dir, "second", "128M");
    let sock = dir.join("vm.sock");
    let _vm = run_far(&sock, "kv", &[first.uri(), second.uri()]);
    wait_for_socket(&sock);
    wait_stats(&sock, "pages far", 60, |s| far(s, "far_pages") > 4000 && far(s, "bytes_read") > 0);
    first.kill();
    // kv reads its values back (checksummed) from the mirror.
    let read = far(&control(&sock, &json!({"cmd": "stats"})), "bytes_read");
    let stats = wait_stats(&sock, "reads from the mirror", 60, |s| far(s, "bytes_read") > read + (8 << 20));
    let stores = &stats["far_memory"]["stores"];
    assert_eq!(stores[0]["ok"], false, "{stats}");
    assert_eq!(stores[1]["ok"], true, "{stats}");
    assert_eq!(stats["far_memory"]["error"], Value::Null, "{stats}");
    // And the guest runs on (each eviction batch pauses it for a few
    // milliseconds, so one look may find it paused).
    let ops = stats["guest"]["ops"].as_u64().unwrap_or(0);
    wait_stats(&sock, "the guest running", 20, |s| {
        s["status"] == "running" && s["guest"]["ops"].as_u64().unwrap_or(0) > ops + 1000
    });
}

#[test]
fn a_memory_host_that_returns_other_bytes_is_dropped_for_its_mirror() {
    if !kvm_or_skip() || !tsubame_testkit::program("nbdkit") {
        return;
    }
    let dir = scratch("far-corrupt");
    let first = MemoryHost::start(&dir, "first", "128M");
    let second = MemoryHost::start(&dir, "second", "128M");
    let sock = dir.join("vm.sock");
    let _vm = run_far(&sock, "kv", &[first.uri(), second.uri()]);
    wait_for_socket(&sock);
    wait_stats(&sock, "pages far", 60, |s| far(s, "far_pages") > 4000);
    // Behind our back, the first host's memory is overwritten.
    let out = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0x55 0 128M", &first.uri()])
        .output()
        .unwrap_or_else(|e| panic!("cannot run qemu-io ({e}): apt-get install qemu-utils"));
    assert!(out.status.success(), "qemu-io: {}", String::from_utf8_lossy(&out.stderr));
    // A page read back from it does not hash to what went away: the host is
    // dropped, its mirror serves, and the guest never sees the bad bytes
    // (kv checks every value it reads).
    let stats = wait_stats(&sock, "the bad host noticed", 60, |s| s["far_memory"]["stores"][0]["ok"] == false);
    let stores = &stats["far_memory"]["stores"];
    assert!(stores[0]["error"].as_str().unwrap().contains("differs from what was written"), "{stats}");
    assert_eq!(stores[1]["ok"], true, "{stats}");
    let ops = stats["guest"]["ops"].as_u64().unwrap_or(0);
    let later = wait_stats(&sock, "the guest going on", 60, |s| s["guest"]["ops"].as_u64().unwrap_or(0) > ops + 1000);
    assert!(later["guest"]["error"].is_null(), "{later}");
    assert_eq!(later["far_memory"]["error"], Value::Null, "{later}");
}

#[test]
fn losing_every_memory_host_pauses_the_vm_with_a_clear_error() {
    if !kvm_or_skip() || !tsubame_testkit::program("nbdkit") {
        return;
    }
    let dir = scratch("far-lost");
    let mut host = MemoryHost::start(&dir, "host", "128M");
    let sock = dir.join("vm.sock");
    let mut vm = run_far(&sock, "kv", &[host.uri()]);
    wait_for_socket(&sock);
    wait_stats(&sock, "pages far", 60, |s| far(s, "far_pages") > 4000);
    host.kill();
    let stats = wait_stats(&sock, "the loss noticed", 30, |s| !s["far_memory"]["error"].is_null());
    assert!(stats["far_memory"]["error"].as_str().unwrap().contains("far memory lost"), "{stats}");
    // The guest makes no progress: it waits on pages that cannot come back
    // rather than reading them as zeros.
    std::thread::sleep(Duration::from_millis(300));
    let ops = control(&sock, &json!({"cmd": "stats"}))["guest"]["ops"].as_u64();
    std::thread::sleep(Duration::from_millis(700));
    let later = control(&sock, &json!({"cmd": "stats"}));
    assert_eq!(later["guest"]["ops"].as_u64(), ops, "the guest ran on: {later}");
    assert!(later["guest"]["error"].is_null(), "the guest saw bad memory: {later}");
    // It cannot migrate either, and the failed attempt does not resume it.
    let incoming = format!("unix:{}", dir.join("nobody.sock").display());
    let (code, text, _) = migrate(&dir, &sock, &incoming, &[]);
    assert_ne!(code, Some(0), "{text}");
    assert!(text.contains("far memory lost") && text.contains("stays paused"), "{text}");
    assert_eq!(control(&sock, &json!({"cmd": "stats"}))["status"], "paused");
    control(&sock, &json!({"cmd": "quit"}));
    let out = std::mem::replace(&mut vm.0, Command::new("true").spawn().unwrap()).wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let said: Vec<&str> = err.lines().filter(|l| l.contains("error: far memory lost")).collect();
    assert_eq!(said.len(), 2, "said once when lost, once at the end: {err}");
}

#[test]
fn bad_far_memory_options_are_one_line_errors() {
    if !kvm_or_skip() || !tsubame_testkit::program("nbdkit") {
        return;
    }
    let dir = scratch("far-bad");
    let small = MemoryHost::start(&dir, "small", "16M");
    let small_uri = small.uri();
    let cases: [(&[&str], i32, &str); 5] = [
        (&["--local-memory", "32M", "--far-memory", "nbd://127.0.0.1:1/x"], 1, "127.0.0.1:1"),
        (&["--local-memory", "32M", "--far-memory", &small_uri], 1, "holds 16777216 bytes"),
        (&["--local-memory", "64M", "--far-memory", &small_uri], 2, "--local-memory must be"),
        (&["--local-memory", "32M"], 2, "--far-memory"),
        (&["--local-memory", "lots", "--far-memory", &small_uri], 2, "--local-memory"),
    ];
    for (args, code, says) in cases {
        let out = tsubame().args(["run", "--memory", "64M", "--seconds", "1"]).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
    }
}

/// `tsubame migrate` of the VM at `source` to `incoming`: its exit code,
/// its output and the statistics JSON.
fn migrate(dir: &Path, source: &Path, incoming: &str, extra: &[&str]) -> (Option<i32>, String, Value) {
    common::migrate_via(source, incoming, &dir.join("stats.json"), extra)
}

/// Checks what a far-memory migration sent against what it could have,
/// from the run's own counters. How much that is depends on timing: the
/// source stops evicting, so what the guest touches meanwhile comes back
/// from the memory host, becomes resident and is sent (again whenever it
/// is dirtied again). Each bound below holds by construction, whatever
/// the timing; each fails if something went that could not have: a far
/// page that never came back, more pages in one pass than were resident,
/// bytes beyond what the records take.
fn only_what_was_resident_moved(case: &str, stats: &Value) {
    let f = &stats["far_memory"];
    let get = |key: &str| f[key].as_u64().unwrap_or_else(|| panic!("{case}: no far_memory.{key}: {stats}"));
    let at_start = get("far_pages_at_start");
    let (left, came_back) = (get("pages_left_far"), get("pages_came_back"));
    let (resident_start, resident_end) = (get("resident_pages_at_start"), get("resident_pages_at_end"));
    // The test saw thousands far before it asked, and until the hand-over
    // a fault waits for eviction to make room.
    assert!(at_start > 0, "{case}: the map named no far page: {stats}");
    // A far page is not resident, and only resident pages are sent: of
    // the far pages, at most those that came back went.
    assert!(left <= at_start && left + came_back >= at_start, "{case}: far pages sent wholesale: {stats}");
    // Nothing is evicted meanwhile, and a page becomes resident only by a
    // fault or a read-ahead.
    assert!(resident_start <= resident_end, "{case}: {stats}");
    assert!(resident_end - resident_start <= get("faults") + get("readahead_pages"), "{case}: {stats}");
    // An iteration sends each page at most once, and only resident ones.
    for it in stats["per_iteration"].as_array().unwrap() {
        assert!(it["pages_sent"].as_u64().unwrap() <= resident_end, "{case}: iteration {it}: {stats}");
    }
    // So does post-copy, over its whole phase (unless a cut link made it
    // send again what the destination had not acknowledged), but for the
    // asked-for pages a compressing push had sent already.
    let postcopy = &stats["postcopy"];
    if !postcopy.is_null() {
        let n = |key: &str| postcopy[key].as_u64().unwrap();
        assert!(n("pages_missing") <= resident_end, "{case}: {stats}");
        if n("resumes") == 0 {
            let sent = n("pages_pushed") + n("pages_sent_on_request") - n("pages_sent_again");
            assert!(sent <= n("pages_missing"), "{case}: {stats}");
        }
    }
    // The bytes are those records' (a page's data is at most 4104 bytes,
    // sub-pages with their mask, its record header 13, and at worst it
    // has a frame to itself: 24 bytes of headers), the far map (a 16-byte
    // hash per far page and a bitmap), post-copy's page sets (a bitmap
    // each at most: a few, as many as pages_total bytes allow) and the
    // rest within 1 MiB: handshake, state, digests (4 KiB each here),
    // iteration ends.
    let (pages_sent, pages_total) = (stats["pages_sent"].as_u64().unwrap(), stats["pages_total"].as_u64().unwrap());
    let most = pages_sent * (4104 + 13 + 24) + at_start * 16 + pages_total + (1 << 20);
    let sent = stats["bytes_on_wire"].as_u64().unwrap();
    assert!(sent <= most, "{case}: {sent} bytes on the wire, more than {pages_sent} records take: {stats}");
}

#[test]
fn a_vm_with_far_memory_migrates_without_its_far_pages() {
    if !kvm_or_skip() || !tsubame_testkit::program("nbdkit") {
        return;
    }
    let dir = scratch("far-migrate");
    let host = MemoryHost::start(&dir, "host", "128M");
    let cases: [(&str, &[&str]); 6] = [
        ("kv", &[]),
        ("bwmem", &[]),
        ("fill-random", &[]),
        ("zero-clear", &[]),
        // Post-copy: the far pages fault in from the memory host at the
        // destination, the rest from the source, then far memory takes over.
        ("kv", &["--postcopy", "after=0"]),
        ("bwmem", &["--postcopy", "after=0"]),
    ];
    for (i, (workload, extra)) in cases.into_iter().enumerate() {
        let (source, dest, incoming) =
            (dir.join(format!("{i}-s.sock")), dir.join(format!("{i}-d.sock")), dir.join(format!("{i}-in.sock")));
        let case = format!("{workload} {extra:?}");
        let _vm = run_far(&source, workload, &[host.uri()]);
        let _receiver = spawn_receive(&incoming, Some(&dest), Stdio::null());
        wait_for_socket(&source);
        wait_for_socket(&dest);
        wait_stats(&source, workload, 60, |s| far(s, "far_pages") > 8000 && far(s, "faults") > 1000);
        let (code, text, stats) = migrate(&dir, &source, &format!("unix:{}", incoming.display()), extra);
        assert_eq!(code, Some(0), "{case}: {text}");
        assert_eq!(stats["status"], "completed", "{case}: {stats}");
        assert_eq!(stats["digest_verified"], true, "{case}: {stats}");
        // Right the first time: the repair pass is a safety net, not the path.
        assert_eq!(stats["regions_repaired"], 0, "{case}: {stats}");
        if !extra.is_empty() {
            assert!(!stats["postcopy"].is_null(), "{case}: switched to post-copy: {stats}");
        }
        only_what_was_resident_moved(&case, &stats);
        // The destination serves far pages from the same host, and the
        // guest goes on (kv checks every value it reads back). Its far
        // pages are those left far, and those it evicts to get under the
        // limit: waited for, as the eviction takes a moment.
        let arrived = wait_stats(&dest, "far memory at the destination", 30, |s| far(s, "faults") > 0);
        let ops = arrived["guest"]["ops"].as_u64().unwrap_or(0);
        let later = wait_stats(&dest, "the guest going on", 60, |s| {
            s["guest"]["ops"].as_u64().unwrap_or(0) > ops + 100 && far(s, "far_pages") > 0
        });
        assert_eq!(later["far_memory"]["error"], Value::Null, "{case}: {later}");
        assert!(later["guest"]["error"].is_null(), "{case}: {later}");
        control(&dest, &json!({"cmd": "quit"}));
    }
}

#[test]
fn a_failed_far_memory_migration_leaves_the_vm_evicting_here() {
    if !kvm_or_skip() || !tsubame_testkit::program("nbdkit") {
        return;
    }
    let dir = scratch("far-migrate-fail");
    let host = MemoryHost::start(&dir, "host", "128M");
    let sock = dir.join("vm.sock");
    let _vm = run_far(&sock, "kv", &[host.uri()]);
    wait_for_socket(&sock);
    wait_stats(&sock, "pages far", 60, |s| far(s, "far_pages") > 8000);
    // Nobody listens there: the migration fails before it starts.
    let nowhere = format!("unix:{}", dir.join("nobody.sock").display());
    let (code, text, _) = migrate(&dir, &sock, &nowhere, &[]);
    assert_ne!(code, Some(0), "{text}");
    assert!(text.contains("the VM keeps running here"), "{text}");
    // Eviction goes on: pages go far again, and residency comes back under
    // the limit (it may exceed it while the map was handed over).
    let evicted = far(&control(&sock, &json!({"cmd": "stats"})), "evicted_pages");
    wait_stats(&sock, "eviction going on", 60, |s| {
        far(s, "evicted_pages") > evicted + 4096 && far(s, "resident_pages") <= far(s, "local_limit_bytes") / 4096
    });
    // And the guest runs (each batch pauses it for a few milliseconds, so
    // one look may find it paused).
    let ops = control(&sock, &json!({"cmd": "stats"}))["guest"]["ops"].as_u64().unwrap_or(0);
    wait_stats(&sock, "the guest running", 20, |s| {
        s["status"] == "running" && s["guest"]["ops"].as_u64().unwrap_or(0) > ops + 1000
    });
}
