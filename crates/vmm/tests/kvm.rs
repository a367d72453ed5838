//! Tests that boot the guest under real KVM. They run whenever /dev/kvm
//! exists; with TSUBAME_REQUIRE_KVM=1 (set by .ci/run) a missing /dev/kvm
//! fails them instead of skipping.

use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use tsubame_vmm::{guest_elf::GUEST_ELF, memory, ConsoleLine, DirtyBitmap, VcpuStatus, Vm, VmConfig};

fn kvm_or_skip() -> bool {
    tsubame_testkit::kvm()
}

fn boot(memory_bytes: u64, args: &str) -> (Vm, Receiver<ConsoleLine>) {
    let mut vm = Vm::create(&VmConfig { memory_bytes, hugepages: false }).expect("create VM");
    let cmdline = format!("{args} tsc_khz={}", vm.tsc_khz());
    vm.load_guest(GUEST_ELF, &cmdline).expect("load guest");
    let console = vm.take_console().unwrap();
    vm.start(false).expect("start");
    (vm, console)
}

fn ops_of(line: &str) -> Option<u64> {
    tsubame_vmm::guest_elf::parse_progress(line).map(|p| p.ops)
}

/// Collects console lines, with their arrival times, for `span`; panics
/// on guest errors.
fn collect_timed(console: &Receiver<ConsoleLine>, span: Duration) -> Vec<ConsoleLine> {
    let end = Instant::now() + span;
    let mut lines = Vec::new();
    while let Ok(l) = console.recv_deadline(end) {
        assert!(!l.text.starts_with("tsubame-guest: error") && !l.text.contains("exception"), "guest: {}", l.text);
        lines.push(l);
    }
    lines
}

/// Collects console lines for `span`; panics on guest errors.
fn collect(console: &Receiver<ConsoleLine>, span: Duration) -> Vec<String> {
    collect_timed(console, span).into_iter().map(|l| l.text).collect()
}

fn ops(lines: &[String]) -> Vec<u64> {
    lines.iter().filter_map(|l| ops_of(l)).collect()
}

/// The ops counters printed within `span`, and after it until there are
/// at least `lines` (or a minute ran out): how many lines a fixed span
/// holds depends on how much CPU a loaded host gave the guest.
fn ops_at_least(console: &Receiver<ConsoleLine>, lines: usize, span: Duration) -> Vec<u64> {
    let mut found = ops(&collect(console, span));
    let end = Instant::now() + Duration::from_secs(60);
    while found.len() < lines && Instant::now() < end {
        found.extend(ops(&collect(console, Duration::from_millis(100))));
    }
    found
}

#[test]
fn every_workload_makes_progress() {
    if !kvm_or_skip() {
        return;
    }
    for workload in ["idle", "fill-zero", "fill-random", "kv", "bwmem", "sparse", "zero-clear", "stream"] {
        let wss = if workload.starts_with("fill") { "" } else { "wss=32M" };
        let (_vm, console) = boot(128 << 20, &format!("workload={workload} {wss}"));
        let ops = ops_at_least(&console, 10, Duration::from_secs(2));
        assert!(ops.len() >= 10, "{workload}: only {} progress lines", ops.len());
        assert!(ops.windows(2).all(|w| w[0] <= w[1]), "{workload}: ops went backwards: {ops:?}");
        assert!(ops.last() > ops.first(), "{workload}: ops did not rise: {ops:?}");
    }
}

#[test]
fn bad_workload_is_reported_and_halts() {
    if !kvm_or_skip() {
        return;
    }
    let (vm, console) = boot(64 << 20, "workload=nope");
    let line = console.recv_timeout(Duration::from_secs(5)).expect("an error line");
    assert!(line.text.starts_with("tsubame-guest: error: unknown workload 'nope' (known: idle"), "{}", line.text);
    assert_eq!(vm.wait_stopped(Duration::from_secs(5)), VcpuStatus::Halted);
}

#[test]
fn guest_exception_reports_vector_and_rip() {
    if !kvm_or_skip() {
        return;
    }
    let (vm, console) = boot(64 << 20, "workload=crash");
    let end = Instant::now() + Duration::from_secs(10);
    let mut found = None;
    while let Ok(l) = console.recv_deadline(end) {
        if l.text.contains("exception") {
            found = Some(l.text);
            break;
        }
    }
    let line = found.expect("an exception line");
    assert!(line.contains("vector=14") && line.contains("rip=0x"), "{line}");
    assert_eq!(vm.wait_stopped(Duration::from_secs(5)), VcpuStatus::Halted);
}

#[test]
fn pause_stops_progress_and_resume_restarts_it() {
    if !kvm_or_skip() {
        return;
    }
    let (vm, console) = boot(64 << 20, "workload=sparse wss=16M");
    let before = ops(&collect(&console, Duration::from_millis(500)));
    vm.pause().unwrap();
    let while_paused = collect(&console, Duration::from_millis(500));
    assert!(while_paused.len() <= 1, "guest printed while paused: {while_paused:?}");
    vm.resume().unwrap();
    let after = ops(&collect(&console, Duration::from_millis(500)));
    assert!(after.first() > before.last(), "{before:?} then {after:?}");
}

/// The state read by the vCPU thread as it stops is the state a later
/// read finds; the vCPU runs again afterwards and stops again.
#[test]
fn state_read_at_the_pause_is_the_vcpus_state() {
    if !kvm_or_skip() {
        return;
    }
    let (mut vm, console) = boot(64 << 20, "workload=kv wss=8M");
    collect(&console, Duration::from_millis(200));
    vm.pause_for_state().unwrap();
    let at_pause = vm.save_state().unwrap();
    // A restore forgets the snapshot: the next read asks the vCPU thread.
    vm.restore_state(&at_pause).unwrap();
    let asked = vm.save_state().unwrap();
    // The registers (the TSC MSR moves on while paused).
    let regs = |s: &tsubame_vmm::VmState| {
        let r = &s.vcpus[0].regs;
        [r.rip, r.rsp, r.rax, r.rbx, r.rcx, r.rdx, r.rsi, r.rdi, r.r8, r.r9, r.r10, r.r11, r.r12, r.r13, r.r14, r.r15]
    };
    assert!(regs(&at_pause) == regs(&asked), "the snapshot differs from the vCPU's registers");
    vm.resume().unwrap();
    let after = ops(&collect(&console, Duration::from_millis(300)));
    assert!(after.len() >= 2 && after.last() > after.first(), "the guest did not go on: {after:?}");
    vm.pause_for_state().unwrap();
    let later = vm.save_state().unwrap();
    assert!(regs(&later) != regs(&at_pause), "a stale snapshot after the guest ran");
}

/// Guest ops per second over `span`, from the first progress line to the last.
fn ops_rate(console: &Receiver<ConsoleLine>, span: Duration) -> f64 {
    let seen: Vec<_> =
        collect_timed(console, span).into_iter().filter_map(|l| Some((l.at, ops_of(&l.text)?))).collect();
    let (Some(first), Some(last)) = (seen.first(), seen.last()) else { return 0.0 };
    (last.1 - first.1) as f64 / last.0.duration_since(first.0).as_secs_f64().max(1e-3)
}

#[test]
fn a_throttled_vcpu_runs_slower_and_recovers() {
    if !kvm_or_skip() {
        return;
    }
    let (vm, console) = boot(64 << 20, "workload=sparse wss=16M");
    collect(&console, Duration::from_millis(300));
    // Wall-clock rates: a host whose load changes within the 4.5 s of one
    // try (10 runnable threads per CPU once) can make a free stretch as
    // slow as the throttled one; the throttle shows in one of three tries.
    let mut tries = 3;
    loop {
        tries -= 1;
        match throttle_try(&vm, &console) {
            Ok(()) => break,
            Err(why) if tries == 0 => panic!("{why}"),
            Err(why) => eprintln!("again: {why}"),
        }
    }
}

/// One measurement of [`a_throttled_vcpu_runs_slower_and_recovers`].
fn throttle_try(vm: &Vm, console: &Receiver<ConsoleLine>) -> Result<(), String> {
    let free = ops_rate(console, Duration::from_millis(1500));
    vm.set_throttle(0.8);
    assert_eq!(vm.throttle(), 0.8);
    collect(console, Duration::from_millis(100));
    let throttled = ops_rate(console, Duration::from_millis(1500));
    assert!(throttled > 0.0, "a throttled guest still runs");
    // A pause is not held up by a throttle sleep.
    let asked = Instant::now();
    vm.pause().unwrap();
    assert!(asked.elapsed() < Duration::from_millis(200), "pause took {:?}", asked.elapsed());
    vm.resume().unwrap();
    vm.set_throttle(0.0);
    collect(console, Duration::from_millis(100));
    let again = ops_rate(console, Duration::from_millis(1500));
    // 80 % asleep: about a fifth of the speed. Against the faster of the
    // free stretches before and after: on a loaded host one of them may
    // itself run at half speed (a 0.504 ratio failed a fixed 0.5 to the
    // one before).
    let free = free.max(again);
    if throttled < free * 0.5 && again > throttled * 2.0 {
        Ok(())
    } else {
        Err(format!("free {free:.0} ops/s, throttled {throttled:.0}, then {again:.0}"))
    }
}

#[test]
fn saved_state_continues_in_a_fresh_vm() {
    if !kvm_or_skip() {
        return;
    }
    let memory_bytes = 128 << 20;
    let (source, console) = boot(memory_bytes, "workload=kv wss=32M");
    let before = ops(&collect(&console, Duration::from_secs(1)));
    source.pause().unwrap();
    // Lines printed just before the pause still count.
    let last = *ops(&collect(&console, Duration::from_millis(100))).last().or(before.last()).unwrap();
    let state = source.save_state().unwrap();

    let mut dest = Vm::create(&VmConfig { memory_bytes, hugepages: false }).unwrap();
    let mut page = [0u8; memory::PAGE_SIZE];
    for index in 0..memory::page_count(source.memory()) {
        memory::read_page(source.memory(), index, &mut page).unwrap();
        if page.iter().any(|&b| b != 0) {
            memory::write(dest.memory(), index * memory::PAGE_SIZE as u64, &page).unwrap();
        }
    }
    dest.restore_state(&state).unwrap();
    let dest_console = dest.take_console().unwrap();
    dest.start(false).unwrap();
    let after = ops_at_least(&dest_console, 10, Duration::from_secs(1));
    assert!(after.len() >= 10, "restored guest printed {} progress lines", after.len());
    assert!(*after.first().unwrap() >= last, "restored ops {after:?} restarted below {last}");
    assert!(after.last() > after.first());
    // The source stays paused: only one copy runs.
    assert!(source.status().is_stopped());
}

#[test]
fn sixteen_gib_guest_boots() {
    if !kvm_or_skip() {
        return;
    }
    let (_vm, console) = boot(16 << 30, "workload=sparse wss=1G");
    let lines = collect(&console, Duration::from_secs(2));
    assert!(lines[0].contains("arena="), "{}", lines[0]);
    assert!(ops(&lines).len() >= 10);
}

#[test]
fn dirty_log_sees_guest_writes_and_clears() {
    if !kvm_or_skip() {
        return;
    }
    let (vm, console) = boot(64 << 20, "workload=sparse wss=8M");
    collect(&console, Duration::from_millis(300));
    vm.set_dirty_logging(true).unwrap();
    let mut bitmap = vm.dirty_bitmap();
    let count = |b: &DirtyBitmap| b.count();
    let clear_all = |b: &DirtyBitmap| vm.clear_dirty_log(0, b.words()).unwrap();

    vm.dirty_log(&mut bitmap).unwrap();
    clear_all(&bitmap);
    // Two progress lines: at least ~50 ms of the guest's own work, however
    // slowly a loaded host runs it (200 ms of wall time once held none).
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut lines = 0;
    while lines < 2 {
        let line = console.recv_deadline(deadline).expect("the guest prints progress");
        lines += usize::from(ops_of(&line.text).is_some());
    }
    vm.dirty_log(&mut bitmap).unwrap();
    let dirty = count(&bitmap);
    // sparse writes ~8 bytes at random over 8 MiB = 2048 pages: most get dirty.
    assert!(dirty > 500, "only {dirty} dirty pages after two progress lines of sparse writes");

    vm.pause().unwrap();
    vm.dirty_log(&mut bitmap).unwrap();
    clear_all(&bitmap);
    vm.dirty_log(&mut bitmap).unwrap();
    if vm.manual_dirty_protect() {
        assert_eq!(count(&bitmap), 0, "pages dirty while the guest was paused");
    }
    // What the VMM itself writes into guest memory (a device, say) is in
    // the dirty set too, though KVM never sees it.
    memory::write(vm.memory(), 40 << 20, &[1, 2, 3]).unwrap();
    vm.dirty_log(&mut bitmap).unwrap();
    assert!(bitmap.get((40 << 20) / 4096), "a page the VMM wrote is missing from the dirty set");
    clear_all(&bitmap);
    vm.dirty_log(&mut bitmap).unwrap();
    assert!(!bitmap.get((40 << 20) / 4096), "the VMM's mark was not taken");
    vm.resume().unwrap();
    collect(&console, Duration::from_millis(100));
    vm.dirty_log(&mut bitmap).unwrap();
    assert!(count(&bitmap) > 0, "writes after clearing were not logged again");
}

/// A paused VM's memory and state moved into a second VM whose memory
/// starts empty and is filled on demand through userfaultfd (post-copy on
/// one host): the vCPU's faults inside KVM and a VMM thread's reads are
/// served, half from a request thread and half pushed in the background,
/// and the guest goes on with its memory intact.
#[test]
fn a_vm_runs_while_its_memory_arrives_on_demand() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use tsubame_vmm::uffd::PageFaults;

    if !kvm_or_skip() {
        return;
    }
    for workload in ["workload=kv wss=24M", "workload=sparse wss=24M"] {
        let (vm, console) = boot(64 << 20, workload);
        let before = ops(&collect(&console, Duration::from_millis(800)));
        vm.pause().unwrap();
        let state = vm.save_state().unwrap();
        let pages = memory::page_count(vm.memory());
        let mut snapshot = vec![0u8; pages as usize * 4096];
        memory::read(vm.memory(), 0, &mut snapshot).unwrap();
        drop(vm);

        let mut target = Vm::create(&VmConfig { memory_bytes: 64 << 20, hugepages: false }).unwrap();
        let console = target.take_console().unwrap();
        let faults = Arc::new(PageFaults::register(target.memory()).unwrap());
        let snapshot = Arc::new(snapshot);
        let page =
            |snapshot: &[u8], p: u64| -> [u8; 4096] { snapshot[p as usize * 4096..][..4096].try_into().unwrap() };
        let done = Arc::new(AtomicBool::new(false));
        // Faults: the odd pages are served at once; the even ones wait for
        // the background push, which installs every even page, slowly.
        let server = {
            let (faults, snapshot, done) = (faults.clone(), snapshot.clone(), done.clone());
            std::thread::spawn(move || {
                let mut seen = Vec::new();
                while !done.load(Ordering::Acquire) {
                    faults.wait_faults(Duration::from_millis(20), &mut seen).unwrap();
                    for f in seen.drain(..) {
                        if f.page % 2 == 1 {
                            faults.install(f.page, &page(&snapshot, f.page)).unwrap();
                        }
                    }
                }
            })
        };
        let pusher = {
            let (faults, snapshot) = (faults.clone(), snapshot.clone());
            std::thread::spawn(move || {
                for p in (0..pages).step_by(2) {
                    faults.install(p, &page(&snapshot, p)).unwrap();
                    if p % 256 == 0 {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
            })
        };
        target.restore_state(&state).unwrap();
        // The dirty log tells which pages the guest wrote after it resumed.
        target.set_dirty_logging(true).unwrap();
        let mut written = target.dirty_bitmap();
        written.set_all();
        target.clear_dirty_log(0, written.words()).unwrap();
        target.start(false).unwrap();
        let after = ops_at_least(&console, 3, Duration::from_millis(1500));
        pusher.join().unwrap();
        assert!(after.len() >= 3, "{workload}: {} progress lines while pages arrived", after.len());
        assert!(after[0] >= *before.last().unwrap(), "{workload}: ops restarted");
        assert!(after.last() > after.first(), "{workload}: the guest did not go on");
        // Every odd page was faulted on or is still missing: install the rest.
        for p in (1..pages).step_by(2) {
            faults.install(p, &page(&snapshot, p)).unwrap();
        }
        target.pause().unwrap();
        done.store(true, Ordering::Release);
        server.join().unwrap();
        let stats = faults.stats();
        assert!(stats.faults > 0 && stats.served > 0, "{workload}: no faults served: {stats:?}");
        assert_eq!(stats.installed, pages, "{workload}: pages installed");
        eprintln!("{workload}: {stats:?}");
        // Every page the guest did not write since is as it was.
        target.dirty_log(&mut written).unwrap();
        let mut now = vec![0u8; pages as usize * 4096];
        memory::read(target.memory(), 0, &mut now).unwrap();
        let differ: Vec<u64> =
            (0..pages).filter(|&p| !written.get(p) && now[p as usize * 4096..][..4096] != page(&snapshot, p)).collect();
        assert!(differ.is_empty(), "{workload}: {} unwritten pages differ, first {:?}", differ.len(), differ.first());
        assert!(written.count() < pages, "{workload}: every page written?");
    }
}

#[test]
fn a_guest_handing_the_disk_bad_requests_gets_errors_and_runs_on() {
    if !kvm_or_skip() {
        return;
    }
    let image = std::env::temp_dir().join(format!("tsubame-disk-bad-{}.img", std::process::id()));
    std::fs::File::create(&image).unwrap().set_len(8 << 20).unwrap();
    let mut vm = Vm::create(&VmConfig { memory_bytes: 32 << 20, hugepages: false }).expect("create VM");
    let cmdline = format!("workload=disk-bad tsc_khz={}", vm.tsc_khz());
    vm.load_guest(GUEST_ELF, &cmdline).expect("load guest");
    vm.attach_disk(&tsubame_block::DiskSpec::File(image.clone()), 1 << 20).unwrap();
    let console = vm.take_console().unwrap();
    vm.start(false).expect("start");
    let lines = collect(&console, Duration::from_secs(2));
    assert!(lines.iter().any(|l| l.starts_with("tsubame-guest: disk-bad: refused [read past the end]")), "{lines:?}");
    let reads: Vec<u64> =
        lines.iter().filter_map(|l| l.split_whitespace().find_map(|t| t.strip_prefix("rd=")?.parse().ok())).collect();
    assert!(reads.len() >= 10 && reads.last() > reads.first(), "the guest reads on: {lines:?}");
    let stats = vm.disk_stats().unwrap();
    assert_eq!(stats.errors, 6, "{stats:?}");
    assert_eq!(vm.status(), VcpuStatus::Running);
    let _ = std::fs::remove_file(&image);
}
