//! Load: eight VMs migrate at once, each from its own `tsubame run` to its
//! own `tsubame receive` (a receiver takes one VM), all on this machine.
//! Every migration must complete with its memory digest verified and every
//! guest must run on at the destination. Prints the wall time and the
//! CPU-seconds of both ends.

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{ask, control, kvm_or_skip, scratch, tsubame, wait_for_socket, Proc};
use serde_json::{json, Value};

const VMS: usize = 8;

#[test]
fn eight_vms_migrate_at_once() {
    if !kvm_or_skip() {
        return;
    }
    let dir = scratch("load");
    let mut procs = Vec::new();
    for i in 0..VMS {
        let seed = format!("seed={}", i + 1);
        procs.push(Proc(
            tsubame()
                .args(["run", "--quiet", "--memory", "64M", "--workload", "kv"])
                .args(["--workload-arg", "wss=16M", "--workload-arg", &seed, "--control"])
                .arg(dir.join(format!("source-{i}.sock")))
                .stdout(Stdio::null())
                .spawn()
                .unwrap(),
        ));
        procs.push(Proc(
            tsubame()
                .args(["receive", "--quiet", "--once", "--listen"])
                .arg(format!("unix:{}", dir.join(format!("in-{i}.sock")).display()))
                .arg("--control")
                .arg(dir.join(format!("dest-{i}.sock")))
                .stdout(Stdio::null())
                .spawn()
                .unwrap(),
        ));
    }
    for i in 0..VMS {
        wait_for_socket(&dir.join(format!("source-{i}.sock")));
        wait_for_socket(&dir.join(format!("dest-{i}.sock")));
    }
    std::thread::sleep(Duration::from_millis(500));
    let started = Instant::now();
    for i in 0..VMS {
        let to = format!("unix:{}", dir.join(format!("in-{i}.sock")).display());
        let reply = control(&dir.join(format!("source-{i}.sock")), &json!({"cmd": "migrate", "to": to}));
        assert_eq!(reply["ok"], true, "VM {i}: {reply}");
    }
    let mut stats: Vec<Option<Value>> = vec![None; VMS];
    let deadline = Instant::now() + Duration::from_secs(300);
    while stats.iter().any(Option::is_none) {
        assert!(Instant::now() < deadline, "migrations did not finish in 300 s");
        for (i, slot) in stats.iter_mut().enumerate().filter(|(_, s)| s.is_none()) {
            let q = control(&dir.join(format!("source-{i}.sock")), &json!({"cmd": "query-migrate"}));
            if q["status"] != "active" {
                *slot = Some(q["stats"].clone());
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let wall = started.elapsed().as_secs_f64();
    let (mut cpu_source, mut cpu_dest, mut bytes, mut longest) = (0.0, 0.0, 0.0, 0.0f64);
    for (i, s) in stats.iter().enumerate() {
        let s = s.as_ref().unwrap();
        assert_eq!(s["status"], "completed", "VM {i}: {s}");
        assert_eq!(s["digest_verified"], true, "VM {i}: {s}");
        cpu_source += s["cpu_seconds"]["source"].as_f64().unwrap();
        cpu_dest += s["cpu_seconds"]["destination"].as_f64().unwrap();
        bytes += s["bytes_on_wire"].as_f64().unwrap();
        longest = longest.max(s["total_time_ms"].as_f64().unwrap());
    }
    // Every guest runs on at its destination.
    for i in 0..VMS {
        let sock = dir.join(format!("dest-{i}.sock"));
        // A destination that stops answering is a defect to find: say what
        // its threads and khugepaged wait on. The one cause seen: its
        // control thread waiting on the mmap lock that khugepaged held
        // while collapsing the VM's 4 KiB pages under a running vCPU under
        // PVM, before destinations backed their memory with huge pages
        // themselves (tsubame_vmm::memory::back_dense_with_huge_pages).
        let mut stats = |which: &str| match ask(&sock, &json!({"cmd": "stats"})) {
            Ok(reply) => reply,
            Err(why) => {
                let dest = &mut procs[2 * i + 1].0;
                let (pid, status) = (dest.id(), dest.try_wait());
                panic!(
                    "VM {i}: {which} stats: {why}; destination {pid} ({status:?}):{}\nkhugepaged:{}",
                    threads_of(pid),
                    khugepaged()
                );
            }
        };
        let first = stats("first");
        std::thread::sleep(Duration::from_millis(300));
        let later = stats("second");
        assert_eq!(later["status"], "running", "VM {i} at destination: {later}");
        assert!(later["guest"]["ops"].as_u64() > first["guest"]["ops"].as_u64(), "VM {i}: {first} then {later}");
        assert!(later["guest"]["error"].is_null(), "VM {i}: {later}");
    }
    println!(
        "load: {VMS} VMs of 64 MiB migrated at once in {wall:.2} s (longest {:.0} ms), {:.1} MiB on the wire, \
         CPU-seconds: sources {cpu_source:.2}, destinations {cpu_dest:.2}; all digests verified",
        longest,
        bytes / (1 << 20) as f64
    );
}

/// Each thread of process `pid`: its name, state, wait channel and kernel stack.
fn threads_of(pid: u32) -> String {
    let mut threads = String::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten() {
        let read = |file: &str| std::fs::read_to_string(task.path().join(file)).unwrap_or_default();
        let stat = read("stat");
        let name_state = stat.split(' ').skip(1).take(2).collect::<Vec<_>>().join(" ");
        threads += &format!("\n  {name_state} waiting in {}\n{}", read("wchan"), read("stack"));
    }
    threads
}

/// khugepaged's state and kernel stack: it takes the mmap lock of the
/// processes whose pages it collapses.
fn khugepaged() -> String {
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let read = |file: &str| std::fs::read_to_string(entry.path().join(file)).unwrap_or_default();
        if read("comm").trim() == "khugepaged" {
            let state = read("stat").split(' ').nth(2).unwrap_or("?").to_string();
            return format!(" {state} waiting in {}\n{}", read("wchan"), read("stack"));
        }
    }
    " not found".into()
}
