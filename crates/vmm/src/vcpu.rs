//! A vCPU on its own thread: the KVM_RUN loop with port I/O, pause/resume
//! from other threads (immediate_exit + a signal kick), and the full vCPU
//! state for save/restore.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{Receiver, Sender};
use kvm_bindings::{
    kvm_debugregs, kvm_mp_state, kvm_msr_entry, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave, Msrs,
};
use kvm_ioctls::{VcpuExit, VcpuFd};
use serde::{Deserialize, Serialize};
use vmm_sys_util::signal::{register_signal_handler, Killable, SIGRTMIN};

use crate::devices::{ConsoleLine, DebugConsole, UnknownPorts, DEBUG_CONSOLE_PORT};
use crate::pci::PciBus;

/// A failed vCPU ioctl, named.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    /// An ioctl on the vCPU failed.
    #[error("{0} failed")]
    Ioctl(&'static str, #[source] std::io::Error),
    /// The vCPU thread is gone.
    #[error("the vCPU thread has stopped")]
    Gone,
    /// The signal used to kick vCPUs could not be installed.
    #[error("cannot install the vCPU kick signal handler")]
    Signal(#[source] std::io::Error),
    /// A state blob disagrees with this vCPU.
    #[error("vCPU state does not fit this vCPU: {0}")]
    BadState(&'static str),
}

fn ioctl_err(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VcpuError {
    move |e| VcpuError::Ioctl(what, std::io::Error::from_raw_os_error(e.errno()))
}

/// Everything KVM holds for one vCPU of our VMs (no in-kernel irqchip, so
/// no LAPIC). Field order is the restore order.
#[derive(Serialize, Deserialize)]
pub struct VcpuState {
    /// MSRs that KVM could read, TSC included.
    pub msrs: Vec<kvm_msr_entry>,
    /// General-purpose registers.
    pub regs: kvm_regs,
    /// Segment, control and descriptor-table registers.
    pub sregs: kvm_sregs,
    /// FPU/SSE/AVX state.
    pub xsave: kvm_xsave,
    /// Extended control registers (XCR0).
    pub xcrs: kvm_xcrs,
    /// Debug registers.
    pub debugregs: kvm_debugregs,
    /// Multiprocessing state (runnable or halted).
    pub mp_state: kvm_mp_state,
    /// Pending exceptions, interrupts, NMIs.
    pub events: kvm_vcpu_events,
}

impl Clone for VcpuState {
    fn clone(&self) -> Self {
        VcpuState {
            msrs: self.msrs.clone(),
            regs: self.regs,
            sregs: self.sregs,
            // kvm_xsave is not Clone (it ends in a flexible array, unused
            // for the legacy 4 KiB area we save).
            xsave: kvm_xsave { region: self.xsave.region, ..Default::default() },
            xcrs: self.xcrs,
            debugregs: self.debugregs,
            mp_state: self.mp_state,
            events: self.events,
        }
    }
}

impl VcpuState {
    /// Value of an MSR in the saved state.
    pub fn msr(&self, index: u32) -> Option<u64> {
        self.msrs.iter().find(|m| m.index == index).map(|m| m.data)
    }
}

/// MSR_IA32_TSC.
pub const MSR_IA32_TSC: u32 = 0x10;

/// Reads the whole state of a vCPU that is not running.
pub(crate) fn save_state(fd: &VcpuFd, msr_indices: &[u32]) -> Result<VcpuState, VcpuError> {
    let entries: Vec<kvm_msr_entry> =
        msr_indices.iter().map(|&index| kvm_msr_entry { index, ..Default::default() }).collect();
    let mut msrs = Msrs::from_entries(&entries).map_err(|_| VcpuError::BadState("too many MSRs"))?;
    let read = fd.get_msrs(&mut msrs).map_err(ioctl_err("KVM_GET_MSRS"))?;
    if read != entries.len() {
        return Err(VcpuError::BadState("KVM_GET_MSRS read fewer MSRs than probed"));
    }
    Ok(VcpuState {
        msrs: msrs.as_slice().to_vec(),
        regs: fd.get_regs().map_err(ioctl_err("KVM_GET_REGS"))?,
        sregs: fd.get_sregs().map_err(ioctl_err("KVM_GET_SREGS"))?,
        xsave: fd.get_xsave().map_err(ioctl_err("KVM_GET_XSAVE"))?,
        xcrs: fd.get_xcrs().map_err(ioctl_err("KVM_GET_XCRS"))?,
        debugregs: fd.get_debug_regs().map_err(ioctl_err("KVM_GET_DEBUGREGS"))?,
        mp_state: fd.get_mp_state().map_err(ioctl_err("KVM_GET_MP_STATE"))?,
        events: fd.get_vcpu_events().map_err(ioctl_err("KVM_GET_VCPU_EVENTS"))?,
    })
}

/// Writes a saved state into a vCPU that is not running.
pub(crate) fn restore_state(fd: &VcpuFd, state: &VcpuState) -> Result<(), VcpuError> {
    let msrs = Msrs::from_entries(&state.msrs).map_err(|_| VcpuError::BadState("too many MSRs"))?;
    let written = fd.set_msrs(&msrs).map_err(ioctl_err("KVM_SET_MSRS"))?;
    if written != state.msrs.len() {
        return Err(VcpuError::BadState("an MSR was refused by KVM_SET_MSRS"));
    }
    fd.set_regs(&state.regs).map_err(ioctl_err("KVM_SET_REGS"))?;
    fd.set_sregs(&state.sregs).map_err(ioctl_err("KVM_SET_SREGS"))?;
    // SAFETY: `kvm_xsave` is the legacy 4 KiB area that KVM_SET_XSAVE reads;
    // it was filled by KVM_GET_XSAVE of the same size.
    unsafe { fd.set_xsave(&state.xsave) }.map_err(ioctl_err("KVM_SET_XSAVE"))?;
    fd.set_xcrs(&state.xcrs).map_err(ioctl_err("KVM_SET_XCRS"))?;
    fd.set_debug_regs(&state.debugregs).map_err(ioctl_err("KVM_SET_DEBUGREGS"))?;
    fd.set_mp_state(state.mp_state).map_err(ioctl_err("KVM_SET_MP_STATE"))?;
    fd.set_vcpu_events(&state.events).map_err(ioctl_err("KVM_SET_VCPU_EVENTS"))?;
    Ok(())
}

/// Where a vCPU thread is, as its owner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VcpuStatus {
    /// Created, never run.
    Created,
    /// In or around KVM_RUN.
    Running,
    /// Stopped on request; serves state requests.
    Paused,
    /// The guest halted (it finished, failed, or took an exception).
    Halted,
    /// KVM reported an error the guest cannot continue from.
    Failed(String),
    /// The thread has ended.
    Stopped,
}

impl VcpuStatus {
    /// True when the vCPU is not executing guest code.
    pub fn is_stopped(&self) -> bool {
        !matches!(self, VcpuStatus::Running)
    }
}

/// What the owner and the vCPU thread share.
pub(crate) struct VcpuShared {
    pub status: Mutex<VcpuStatus>,
    pub changed: Condvar,
    pub wants_pause: AtomicBool,
    /// Share of time the vCPU sleeps, in thousandths (auto-converge).
    pub throttle_per_mille: AtomicU32,
    /// Set with a pause whose caller wants the vCPU's state next: the
    /// vCPU thread reads it as it stops, so the caller need not wake it
    /// again (on this host a second wake-up of a parked thread took 2-4 ms
    /// of a migration's downtime).
    pub snapshot_wanted: AtomicBool,
    /// The state read as the vCPU last stopped, while nothing has changed
    /// it since (cleared when it runs or is restored).
    pub snapshot: Mutex<Option<VcpuState>>,
    /// The vCPU thread's kernel id once it runs (0 before).
    pub thread_id: std::sync::atomic::AtomicI32,
    /// When the vCPU last stopped on request and was last let run.
    switched: [AtomicU64; 2],
}

/// When the vCPU last stopped on request (it left KVM_RUN and told its
/// pause) and when it was last let run (its resume or release), in µs of
/// the host's CLOCK_REALTIME since the Unix epoch; 0 for never. One clock
/// for every process on the host, as QEMU's QMP event timestamps: a
/// migration's stop→resume is the destination's `resumed_at_unix_us`
/// minus the source's `paused_at_unix_us`, for both VMMs alike.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct VcpuSwitchTimes {
    /// The last stop.
    pub paused_at_unix_us: u64,
    /// The last run after a stop (or the first run).
    pub resumed_at_unix_us: u64,
}

/// Now, in µs of CLOCK_REALTIME since the Unix epoch.
pub fn unix_micros() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

impl VcpuShared {
    pub fn new() -> Self {
        VcpuShared {
            status: Mutex::new(VcpuStatus::Created),
            changed: Condvar::new(),
            wants_pause: AtomicBool::new(true),
            throttle_per_mille: AtomicU32::new(0),
            snapshot_wanted: AtomicBool::new(false),
            snapshot: Mutex::new(None),
            thread_id: std::sync::atomic::AtomicI32::new(0),
            switched: [AtomicU64::new(0), AtomicU64::new(0)],
        }
    }

    pub(crate) fn set(&self, status: VcpuStatus) {
        match status {
            VcpuStatus::Paused => self.switched[0].store(unix_micros(), Ordering::Release),
            VcpuStatus::Running => self.switched[1].store(unix_micros(), Ordering::Release),
            _ => {}
        }
        *self.status.lock().unwrap() = status;
        self.changed.notify_all();
    }

    /// When the vCPU last stopped and last ran again.
    pub fn switch_times(&self) -> VcpuSwitchTimes {
        VcpuSwitchTimes {
            paused_at_unix_us: self.switched[0].load(Ordering::Acquire),
            resumed_at_unix_us: self.switched[1].load(Ordering::Acquire),
        }
    }

    /// Current status.
    pub fn get(&self) -> VcpuStatus {
        self.status.lock().unwrap().clone()
    }

    /// Waits until `done` holds for the status, or the timeout passes.
    pub fn wait_for(&self, timeout: std::time::Duration, done: impl Fn(&VcpuStatus) -> bool) -> VcpuStatus {
        let guard = self.status.lock().unwrap();
        let (guard, _) = self.changed.wait_timeout_while(guard, timeout, |s| !done(s)).unwrap();
        guard.clone()
    }
}

/// Requests to a vCPU thread that is not running guest code.
pub(crate) enum VcpuRequest {
    Resume,
    /// Run the guest: the caller marked it running already.
    Run,
    Save(Sender<Result<VcpuState, VcpuError>>),
    /// Restore (at this TSC rate, when given); the guest stays paused.
    Restore(Box<VcpuState>, Option<u32>, Sender<Result<(), VcpuError>>),
    /// Restore (at this TSC rate, when given), then run the guest; the
    /// callback and the reply come as it goes into the guest.
    RestoreAndRun(Box<VcpuState>, Option<u32>, Box<dyn FnOnce() + Send>, Sender<Result<(), VcpuError>>),
    Stop,
}

thread_local! {
    /// The running vCPU's `kvm_run.immediate_exit`, for the kick handler.
    static IMMEDIATE_EXIT: Cell<*mut u8> = const { Cell::new(std::ptr::null_mut()) };
}

extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    let ptr = IMMEDIATE_EXIT.with(|p| p.get());
    if !ptr.is_null() {
        // SAFETY: the pointer is this thread's own kvm_run mapping, set by
        // the vCPU thread before it first runs and valid until it exits.
        unsafe { std::ptr::write_volatile(ptr, 1) };
    }
}

/// The signal that kicks a vCPU out of KVM_RUN.
pub(crate) fn kick_signal() -> libc::c_int {
    SIGRTMIN()
}

/// Installs the kick handler once per process.
pub(crate) fn install_kick_handler() -> Result<(), VcpuError> {
    static INSTALLED: std::sync::OnceLock<Result<(), i32>> = std::sync::OnceLock::new();
    INSTALLED
        .get_or_init(|| register_signal_handler(kick_signal(), kick_handler).map_err(|e| e.errno()))
        .map_err(|errno| VcpuError::Signal(std::io::Error::from_raw_os_error(errno)))
}

/// Handle to a vCPU thread.
pub(crate) struct VcpuThread {
    pub requests: Sender<VcpuRequest>,
    pub thread: Option<JoinHandle<()>>,
}

impl VcpuThread {
    /// Makes the thread leave KVM_RUN soon.
    pub fn kick(&self) {
        if let Some(t) = &self.thread {
            // An already finished thread cannot be kicked; that's fine.
            let _ = t.kill(kick_signal());
        }
    }
}

/// State owned by the vCPU thread.
pub(crate) struct VcpuRunner {
    pub fd: VcpuFd,
    pub msr_indices: Vec<u32>,
    pub console: Sender<ConsoleLine>,
    pub requests: Receiver<VcpuRequest>,
    pub shared: Arc<VcpuShared>,
    /// The PCI bus and its disk; requests run here, at the guest's notify.
    pub bus: Arc<Mutex<PciBus>>,
    /// Run the guest at once instead of waiting for a resume.
    pub start_running: bool,
}

enum Flow {
    Continue,
    Stop(VcpuStatus),
}

/// The most a vCPU is throttled: 99 %, as QEMU's cpu-throttle-max.
pub const MAX_THROTTLE_PER_MILLE: u32 = 990;

/// A throttled vCPU runs this long between sleeps (QEMU's CPU throttle
/// uses the same 10 ms slice).
const THROTTLE_SLICE: Duration = Duration::from_millis(10);

/// The vCPU thread's own pthread handle, for its throttle kicker.
struct OwnThread(libc::pthread_t);

// SAFETY: the handle is the vCPU thread's own (`pthread_self`), and the
// kicker holding it is joined by that thread before it returns, so the
// handle names a live thread whenever a signal is sent through it.
unsafe impl Killable for OwnThread {
    fn pthread_handle(&self) -> libc::pthread_t {
        self.0
    }
}

/// While the vCPU is throttled, kicks it out of KVM_RUN every slice, so
/// that it can sleep even when the guest makes no exits of its own.
fn throttle_kicker(shared: Arc<VcpuShared>, vcpu: OwnThread, done: Arc<AtomicBool>) {
    while !done.load(Ordering::Acquire) {
        if shared.throttle_per_mille.load(Ordering::Relaxed) == 0 {
            std::thread::park_timeout(Duration::from_millis(50));
            continue;
        }
        std::thread::sleep(THROTTLE_SLICE);
        let _ = vcpu.kill(kick_signal());
    }
}

impl VcpuRunner {
    /// The thread body: wait for the first resume, then run until stopped.
    pub fn run(mut self) {
        crate::cpu_time::normal_thread();
        self.shared.thread_id.store(crate::cpu_time::current_thread_id(), Ordering::Release);
        let exit_flag: *mut u8 = &mut self.fd.get_kvm_run().immediate_exit;
        IMMEDIATE_EXIT.with(|p| p.set(exit_flag));
        // SAFETY: pthread_self has no preconditions.
        let own = OwnThread(unsafe { libc::pthread_self() });
        let kicker_done = Arc::new(AtomicBool::new(false));
        let kicker = {
            let (shared, done) = (self.shared.clone(), kicker_done.clone());
            std::thread::Builder::new().name("vcpu0-throttle".into()).spawn(move || throttle_kicker(shared, own, done))
        };
        let mut console = DebugConsole::default();
        let mut unknown = UnknownPorts::default();
        let mut stop_status = (!self.start_running).then_some(VcpuStatus::Paused);
        let mut slice_start = Instant::now();
        loop {
            if self.shared.wants_pause.load(Ordering::Acquire) && stop_status.is_none() {
                stop_status = Some(VcpuStatus::Paused);
            }
            if let Some(status) = stop_status.take() {
                if !self.serve_stopped(status) {
                    break;
                }
                slice_start = Instant::now();
                continue;
            }
            if let Flow::Stop(status) = self.run_once(&mut console, &mut unknown) {
                stop_status = Some(status);
            }
            self.throttle(&mut slice_start);
        }
        kicker_done.store(true, Ordering::Release);
        if let Ok(kicker) = kicker {
            kicker.thread().unpark();
            let _ = kicker.join();
        }
        IMMEDIATE_EXIT.with(|p| p.set(std::ptr::null_mut()));
        self.shared.set(VcpuStatus::Stopped);
    }

    /// When throttled to a share p, sleeps p/(1−p) of a slice after each
    /// slice of running; a pause request cuts the sleep short.
    fn throttle(&self, slice_start: &mut Instant) {
        let per_mille = self.shared.throttle_per_mille.load(Ordering::Relaxed).min(MAX_THROTTLE_PER_MILLE);
        if per_mille == 0 {
            *slice_start = Instant::now();
            return;
        }
        if slice_start.elapsed() < THROTTLE_SLICE {
            return;
        }
        let until = Instant::now() + THROTTLE_SLICE * per_mille / (1000 - per_mille);
        while Instant::now() < until && !self.shared.wants_pause.load(Ordering::Acquire) {
            std::thread::sleep((until - Instant::now()).min(Duration::from_millis(1)));
        }
        *slice_start = Instant::now();
    }

    /// Serves requests while not running. Returns false when told to stop.
    fn serve_stopped(&mut self, status: VcpuStatus) -> bool {
        if self.shared.snapshot_wanted.swap(false, Ordering::AcqRel) {
            // The pause is told before the state is read (~0.1 ms of
            // ioctls): its caller reads the dirty log meanwhile, and a
            // reader of the state waits on this lock until it is in.
            let mut snapshot = self.shared.snapshot.lock().unwrap();
            self.shared.set(status);
            *snapshot = save_state(&self.fd, &self.msr_indices).ok();
        } else {
            self.shared.set(status);
        }
        // A pause may have hurried this thread (Vm::pause_for_state); the
        // pause is told first (going back may give the CPU away at once).
        crate::cpu_time::normal_thread();
        loop {
            let Ok(req) = self.requests.recv() else { return false };
            match req {
                VcpuRequest::Resume => {
                    // Hurried after it stopped (the pause kicks first), it
                    // must not run guest code under SCHED_FIFO.
                    crate::cpu_time::normal_thread();
                    self.mark_running();
                    return true;
                }
                VcpuRequest::Run => {
                    crate::cpu_time::normal_thread();
                    *self.shared.snapshot.lock().unwrap() = None;
                    return true;
                }
                VcpuRequest::Save(reply) => {
                    let _ = reply.send(save_state(&self.fd, &self.msr_indices));
                }
                VcpuRequest::Restore(state, tsc_khz, reply) => {
                    *self.shared.snapshot.lock().unwrap() = None;
                    let _ = reply.send(self.restore(&state, tsc_khz));
                }
                VcpuRequest::RestoreAndRun(state, tsc_khz, announce, reply) => {
                    let restored = self.restore(&state, tsc_khz);
                    let run = restored.is_ok();
                    if run {
                        self.mark_running();
                        announce();
                    }
                    let _ = reply.send(restored);
                    if run {
                        return true;
                    }
                }
                VcpuRequest::Stop => return false,
            }
        }
    }

    /// Loads `state`, at this TSC rate when given.
    fn restore(&self, state: &VcpuState, tsc_khz: Option<u32>) -> Result<(), VcpuError> {
        if let Some(khz) = tsc_khz {
            self.fd.set_tsc_khz(khz).map_err(ioctl_err("KVM_SET_TSC_KHZ"))?;
        }
        restore_state(&self.fd, state)
    }

    /// The state is the guest's own from here on: it runs.
    fn mark_running(&self) {
        *self.shared.snapshot.lock().unwrap() = None;
        self.shared.wants_pause.store(false, Ordering::Release);
        self.shared.set(VcpuStatus::Running);
    }

    fn run_once(&mut self, console: &mut DebugConsole, unknown: &mut UnknownPorts) -> Flow {
        let result = self.fd.run();
        let flow = match result {
            Ok(VcpuExit::IoOut(port, data)) => {
                if port == DEBUG_CONSOLE_PORT {
                    console.write(data, |line| {
                        let _ = self.console.send(line);
                    });
                } else if !self.bus.lock().unwrap().write(port, data) && unknown.first_access(port, true) {
                    eprintln!("tsubame: guest wrote to unknown port {port:#x}; ignoring it");
                }
                Flow::Continue
            }
            Ok(VcpuExit::IoIn(port, data)) => {
                if !self.bus.lock().unwrap().read(port, data) {
                    data.fill(0xFF);
                    if unknown.first_access(port, false) {
                        eprintln!("tsubame: guest read unknown port {port:#x}; returning 0xff");
                    }
                }
                Flow::Continue
            }
            Ok(VcpuExit::MmioRead(_, data)) => {
                data.fill(0xFF);
                Flow::Continue
            }
            Ok(VcpuExit::MmioWrite(..)) => Flow::Continue,
            Ok(VcpuExit::Hlt) => Flow::Stop(VcpuStatus::Halted),
            Ok(VcpuExit::Shutdown) => {
                Flow::Stop(VcpuStatus::Failed("the guest triple-faulted (KVM_EXIT_SHUTDOWN)".into()))
            }
            Ok(VcpuExit::FailEntry(reason, _)) => {
                Flow::Stop(VcpuStatus::Failed(format!("KVM could not enter the guest (reason {reason:#x})")))
            }
            Ok(VcpuExit::InternalError) => {
                Flow::Stop(VcpuStatus::Failed("KVM internal error (an instruction the host cannot emulate?)".into()))
            }
            Ok(other) => Flow::Stop(VcpuStatus::Failed(format!("unexpected KVM exit: {other:?}"))),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => Flow::Continue,
            Err(e) => Flow::Stop(VcpuStatus::Failed(format!("KVM_RUN failed: {e}"))),
        };
        // A kick sets immediate_exit; clear it before the loop looks at
        // wants_pause, so a kick after this point still stops the next run.
        self.fd.set_kvm_immediate_exit(0);
        flow
    }
}
