//! One VM: KVM VM fd, guest memory in slot 0, one vCPU on its thread, and
//! the operations the CLI and the migration engine need.

use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{unbounded, Receiver};
use kvm_bindings::{
    kvm_enable_cap, kvm_userspace_memory_region, KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2, KVM_DIRTY_LOG_INITIALLY_SET,
    KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE, KVM_MAX_CPUID_ENTRIES, KVM_MEM_LOG_DIRTY_PAGES,
};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use crate::bitmap::DirtyBitmap;
use crate::boot::{self, BootError};
use crate::devices::ConsoleLine;
use crate::dirty;
use crate::kvm::{self, KvmError};
use crate::memory::{self, GuestMemory, MemoryError};
use crate::pci::PciBus;
use crate::persist::VmState;
use crate::vcpu::{
    install_kick_handler, save_state, VcpuError, VcpuRequest, VcpuRunner, VcpuShared, VcpuStatus, VcpuThread,
    MAX_THROTTLE_PER_MILLE,
};
use crate::virtio_blk::{DiskError, DiskStatsHandle};

pub(crate) mod disk;
pub(crate) mod restore;

/// How long pause waits for a vCPU before calling it stuck.
const PAUSE_TIMEOUT: Duration = Duration::from_secs(5);
/// A pause that takes longer than this is out of the ordinary (0.05-0.3 ms
/// is usual here): worth a line on where the vCPU waits.
const SLOW_PAUSE: Duration = Duration::from_millis(5);

/// Errors of VM operations.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// KVM itself is not usable.
    #[error(transparent)]
    Kvm(#[from] KvmError),
    /// Guest memory.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// Loading the guest image.
    #[error(transparent)]
    Boot(#[from] BootError),
    /// A vCPU operation.
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    /// A VM-level ioctl.
    #[error("{0} failed")]
    Ioctl(&'static str, #[source] std::io::Error),
    /// The operation needs another run state.
    #[error("the VM is {0}")]
    WrongState(&'static str),
    /// The vCPU did not stop in time.
    #[error("the vCPU did not pause within {PAUSE_TIMEOUT:?}")]
    PauseTimeout,
    /// A thread could not be started.
    #[error("cannot start the vCPU thread")]
    Thread(#[source] std::io::Error),
    /// A saved state from a VM of another shape.
    #[error("saved state does not fit this VM: {0}")]
    StateMismatch(String),
    /// The virtual disk's storage.
    #[error(transparent)]
    Disk(#[from] DiskError),
}

fn ioctl_err(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |e| VmError::Ioctl(what, std::io::Error::from_raw_os_error(e.errno()))
}

/// What a VM is made of.
#[derive(Debug, Clone)]
pub struct VmConfig {
    /// Guest memory in bytes.
    pub memory_bytes: u64,
    /// Ask for transparent huge pages behind guest memory.
    pub hugepages: bool,
}

enum VcpuSlot {
    NotStarted(Box<VcpuFd>),
    Started(VcpuThread),
    Empty,
}

/// A VM with one vCPU. Dropping it stops the vCPU thread.
pub struct Vm {
    _kvm: Kvm,
    fd: VmFd,
    memory: Arc<GuestMemory>,
    vcpu: VcpuSlot,
    shared: Arc<VcpuShared>,
    msr_indices: Vec<u32>,
    console: Option<Receiver<ConsoleLine>>,
    console_tx: crossbeam_channel::Sender<ConsoleLine>,
    tsc_khz: u32,
    dirty_logging: std::sync::atomic::AtomicBool,
    manual_dirty_protect: bool,
    hugepages: bool,
    /// Port I/O devices beyond the console: the PCI bus and its disk,
    /// shared with the vCPU thread that serves the guest's accesses.
    bus: Arc<std::sync::Mutex<PciBus>>,
    disk_stats: Option<DiskStatsHandle>,
    /// Held by a pause or a resume until the vCPU has done it: two threads
    /// that resumed at once each sent a request, and the second one undid
    /// a later pause as soon as it stopped the vCPU.
    stop_go: std::sync::Mutex<()>,
}

/// Probes, one by one, which MSRs this KVM lets us both read and write
/// back: those are the ones a saved state can carry.
fn migratable_msrs(kvm: &Kvm, vcpu: &VcpuFd) -> Result<Vec<u32>, VmError> {
    let list = kvm.get_msr_index_list().map_err(ioctl_err("KVM_GET_MSR_INDEX_LIST"))?;
    let mut migratable = Vec::new();
    for &index in list.as_slice() {
        let entry = [kvm_bindings::kvm_msr_entry { index, ..Default::default() }];
        let mut msrs = kvm_bindings::Msrs::from_entries(&entry).expect("one entry fits");
        if vcpu.get_msrs(&mut msrs) == Ok(1) && vcpu.set_msrs(&msrs) == Ok(1) {
            migratable.push(index);
        }
    }
    Ok(migratable)
}

/// Asks KVM to leave dirty bits set until we clear them, with every bit
/// set when logging starts (no up-front write-protection of all memory).
fn enable_manual_dirty_protect(vm: &VmFd) -> bool {
    let wanted = KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE | KVM_DIRTY_LOG_INITIALLY_SET;
    let offered = vm.check_extension_raw(KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2.into()) as u32;
    if offered & wanted != wanted {
        return false;
    }
    let mut cap = kvm_enable_cap { cap: KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2, ..Default::default() };
    cap.args[0] = wanted.into();
    vm.enable_cap(&cap).is_ok()
}

impl Vm {
    /// Creates the VM, its memory and its vCPU; nothing runs yet.
    pub fn create(config: &VmConfig) -> Result<Vm, VmError> {
        let kvm = kvm::open()?;
        let fd = kvm.create_vm().map_err(ioctl_err("KVM_CREATE_VM"))?;
        let memory = Arc::new(memory::create(config.memory_bytes, config.hugepages)?);
        let vm_fd = fd;
        let mut vm_slots = Vec::new();
        for (slot, region) in memory.iter().enumerate() {
            vm_slots.push(kvm_userspace_memory_region {
                slot: slot as u32,
                flags: 0,
                guest_phys_addr: region.start_addr().0,
                memory_size: region.len(),
                userspace_addr: memory::host_address(&memory, region.start_addr().0) as u64,
            });
        }
        for region in &vm_slots {
            // SAFETY: the host range is a live mapping owned by `memory`,
            // which the Vm keeps alive for as long as `vm_fd` exists.
            unsafe { vm_fd.set_user_memory_region(*region) }.map_err(ioctl_err("KVM_SET_USER_MEMORY_REGION"))?;
        }
        let vcpu = vm_fd.create_vcpu(0).map_err(ioctl_err("KVM_CREATE_VCPU"))?;
        let cpuid = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).map_err(ioctl_err("KVM_GET_SUPPORTED_CPUID"))?;
        vcpu.set_cpuid2(&cpuid).map_err(ioctl_err("KVM_SET_CPUID2"))?;
        let tsc_khz = vcpu.get_tsc_khz().map_err(ioctl_err("KVM_GET_TSC_KHZ"))?;
        let msr_indices = migratable_msrs(&kvm, &vcpu)?;
        let manual_dirty_protect = enable_manual_dirty_protect(&vm_fd);
        install_kick_handler()?;
        let (console_tx, console_rx) = unbounded();
        Ok(Vm {
            _kvm: kvm,
            fd: vm_fd,
            memory,
            vcpu: VcpuSlot::NotStarted(Box::new(vcpu)),
            shared: Arc::new(VcpuShared::new()),
            msr_indices,
            console: Some(console_rx),
            console_tx,
            tsc_khz,
            dirty_logging: std::sync::atomic::AtomicBool::new(false),
            manual_dirty_protect,
            hugepages: config.hugepages,
            bus: Arc::default(),
            disk_stats: None,
            stop_go: std::sync::Mutex::new(()),
        })
    }

    /// Guest memory, shared with whoever copies it.
    pub fn memory(&self) -> &Arc<GuestMemory> {
        &self.memory
    }

    /// Guest memory size in bytes.
    pub fn memory_bytes(&self) -> u64 {
        memory::size(&self.memory)
    }

    /// Whether guest memory was created asking for transparent huge pages.
    pub fn hugepages(&self) -> bool {
        self.hugepages
    }

    /// The vCPU's TSC frequency in kHz (what the guest needs as tsc_khz=).
    pub fn tsc_khz(&self) -> u32 {
        self.tsc_khz
    }

    /// Takes the console's line receiver (once).
    pub fn take_console(&mut self) -> Option<Receiver<ConsoleLine>> {
        self.console.take()
    }

    /// Loads a multiboot image and points the (not yet started) vCPU at it.
    pub fn load_guest(&mut self, image: &[u8], cmdline: &str) -> Result<(), VmError> {
        let VcpuSlot::NotStarted(vcpu) = &self.vcpu else {
            return Err(VmError::WrongState("already started"));
        };
        let entry = boot::load_multiboot(&self.memory, image, cmdline)?;
        vcpu.set_sregs(&entry.sregs).map_err(ioctl_err("KVM_SET_SREGS"))?;
        vcpu.set_regs(&entry.regs).map_err(ioctl_err("KVM_SET_REGS"))?;
        Ok(())
    }

    /// Starts the vCPU thread; the guest runs unless `paused`.
    pub fn start(&mut self, paused: bool) -> Result<(), VmError> {
        let VcpuSlot::NotStarted(fd) = std::mem::replace(&mut self.vcpu, VcpuSlot::Empty) else {
            return Err(VmError::WrongState("already started"));
        };
        let (req_tx, req_rx) = unbounded();
        let runner = VcpuRunner {
            fd: *fd,
            msr_indices: self.msr_indices.clone(),
            console: self.console_tx.clone(),
            requests: req_rx,
            shared: self.shared.clone(),
            bus: self.bus.clone(),
            start_running: !paused,
        };
        if !paused {
            // Running from its first instruction: no resume round trip with
            // a thread the scheduler may take milliseconds to wake (a
            // post-copy destination's downtime ends here).
            self.shared.wants_pause.store(false, std::sync::atomic::Ordering::Release);
            self.shared.set(VcpuStatus::Running);
        }
        let thread =
            std::thread::Builder::new().name("vcpu0".into()).spawn(move || runner.run()).map_err(VmError::Thread)?;
        self.vcpu = VcpuSlot::Started(VcpuThread { requests: req_tx, thread: Some(thread) });
        if paused {
            self.shared.wait_for(PAUSE_TIMEOUT, |s| *s != VcpuStatus::Created);
        }
        Ok(())
    }

    fn thread(&self) -> Result<&VcpuThread, VmError> {
        match &self.vcpu {
            VcpuSlot::Started(t) => Ok(t),
            _ => Err(VmError::WrongState("not started")),
        }
    }

    /// The vCPU's run state.
    pub fn status(&self) -> VcpuStatus {
        self.shared.get()
    }

    /// When the vCPU last stopped and last ran again (wall clock).
    pub fn switch_times(&self) -> crate::vcpu::VcpuSwitchTimes {
        self.shared.switch_times()
    }

    /// Waits up to `timeout` for the vCPU to leave the Running state.
    pub fn wait_stopped(&self, timeout: Duration) -> VcpuStatus {
        self.shared.wait_for(timeout, |s| s.is_stopped())
    }

    /// [`Vm::pause`] for a caller that reads the state next
    /// ([`Vm::save_state`]): the vCPU thread reads it as it stops. A
    /// migration's stop: its downtime starts now.
    pub fn pause_for_state(&self) -> Result<(), VmError> {
        self.shared.snapshot_wanted.store(true, std::sync::atomic::Ordering::Release);
        self.stop_guest(true)
    }

    /// Stops guest execution; returns once the vCPU is out of KVM_RUN.
    pub fn pause(&self) -> Result<(), VmError> {
        self.stop_guest(false)
    }

    /// Kicks the vCPU out of the guest and waits until it is out. For a
    /// migration (`migrating`) the vCPU thread must not wait for a CPU
    /// behind other threads to notice the kick: it is hurried (it goes
    /// back to the normal scheduler as it stops, or as it resumes when it
    /// had stopped before this reached it).
    fn stop_guest(&self, migrating: bool) -> Result<(), VmError> {
        let tid = self.shared.thread_id.load(std::sync::atomic::Ordering::Acquire);
        let running = tid != 0 && !self.shared.get().is_stopped();
        let thread = self.thread()?;
        let _one_at_a_time = self.stop_go.lock().unwrap();
        self.shared.wants_pause.store(true, std::sync::atomic::Ordering::Release);
        // Kicked first: a vCPU that has a CPU leaves the guest meanwhile
        // (changing a thread's scheduler took 20-50 µs here).
        thread.kick();
        if migrating && running {
            crate::cpu_time::hurry_thread(tid);
        }
        self.wait_paused(migrating)
    }

    /// Waits for the kicked vCPU to stop; `report_slow`: a migration's
    /// stop, where a slow pause is news (elsewhere, e.g. far memory's
    /// evictor, a vCPU waiting on a far page is expected to take long).
    fn wait_paused(&self, report_slow: bool) -> Result<(), VmError> {
        if !report_slow || self.shared.wait_for(SLOW_PAUSE, |s| s.is_stopped()).is_stopped() {
            return self.wait_stopped_or_time_out();
        }
        // About one pause in six on this host: the vCPU thread stays in
        // KVM_RUN for 10-60 ms after the kick. Where it waits is the clue: said once, on stderr.
        let tid = self.shared.thread_id.load(std::sync::atomic::Ordering::Acquire);
        let stack = std::fs::read_to_string(format!("/proc/self/task/{tid}/stack")).unwrap_or_default();
        let frames: Vec<&str> = stack.lines().filter_map(|l| l.split_whitespace().nth(1)).collect();
        eprintln!(
            "tsubame: the vCPU has not paused {} ms after the kick; its thread's kernel stack: {}",
            SLOW_PAUSE.as_millis(),
            if frames.is_empty() { "(unreadable)".to_string() } else { frames.join(" < ") }
        );
        self.wait_stopped_or_time_out()
    }

    fn wait_stopped_or_time_out(&self) -> Result<(), VmError> {
        if self.shared.wait_for(PAUSE_TIMEOUT, |s| s.is_stopped()).is_stopped() {
            Ok(())
        } else {
            Err(VmError::PauseTimeout)
        }
    }

    /// Makes the vCPU sleep `fraction` of its time (0 to 0.99), in 10 ms
    /// slices: auto-converge slows a guest that dirties memory faster than
    /// a migration can send it. 0 lets it run freely again.
    pub fn set_throttle(&self, fraction: f64) {
        let per_mille = (fraction.clamp(0.0, 1.0) * 1000.0).round() as u32;
        self.shared
            .throttle_per_mille
            .store(per_mille.min(MAX_THROTTLE_PER_MILLE), std::sync::atomic::Ordering::Relaxed);
    }

    /// The share of time the vCPU is made to sleep.
    pub fn throttle(&self) -> f64 {
        self.shared.throttle_per_mille.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1000.0
    }

    /// Lets the guest run again.
    pub fn resume(&self) -> Result<(), VmError> {
        let thread = self.thread()?;
        let _one_at_a_time = self.stop_go.lock().unwrap();
        if !self.shared.get().is_stopped() {
            return Ok(());
        }
        thread.requests.send(VcpuRequest::Resume).map_err(|_| VcpuError::Gone)?;
        self.shared.wait_for(PAUSE_TIMEOUT, |s| !s.is_stopped());
        Ok(())
    }

    /// Lets the paused guest run without waiting for its vCPU thread to
    /// take it up: from now on it is running, as a guest just started
    /// ([`Vm::start`]) is. A migration's destination tells the source at
    /// once: after [`Vm::resume`]'s wait the guest already ran, and the
    /// source read RESUMED 0.08-0.2 ms later instead of 0.01.
    pub fn release(&self) -> Result<(), VmError> {
        let thread = self.thread()?;
        let _one_at_a_time = self.stop_go.lock().unwrap();
        if !self.shared.get().is_stopped() {
            return Ok(());
        }
        self.shared.wants_pause.store(false, std::sync::atomic::Ordering::Release);
        self.shared.set(VcpuStatus::Running);
        thread.requests.send(VcpuRequest::Run).map_err(|_| VcpuError::Gone)?;
        Ok(())
    }

    /// Lets the vCPU thread run only on `cpus` (best effort; nothing
    /// before it started).
    pub fn vcpu_run_on(&self, cpus: &[usize]) {
        use std::os::unix::thread::JoinHandleExt;
        if let VcpuSlot::Started(VcpuThread { thread: Some(thread), .. }) = &self.vcpu {
            crate::cpu_time::set_thread_cpus(thread.as_pthread_t(), cpus);
        }
    }

    /// Captures vCPU and device state; the VM must be paused (or never
    /// started).
    pub fn save_state(&self) -> Result<VmState, VmError> {
        let vcpu = match &self.vcpu {
            VcpuSlot::NotStarted(fd) => save_state(fd, &self.msr_indices)?,
            VcpuSlot::Started(t) => {
                if !self.shared.get().is_stopped() {
                    return Err(VmError::WrongState("running; pause it first"));
                }
                if let Some(state) = self.shared.snapshot.lock().unwrap().clone() {
                    return self.finish_state(state);
                }
                let (tx, rx) = crossbeam_channel::bounded(1);
                t.requests.send(VcpuRequest::Save(tx)).map_err(|_| VcpuError::Gone)?;
                rx.recv().map_err(|_| VcpuError::Gone)??
            }
            VcpuSlot::Empty => return Err(VmError::WrongState("being started")),
        };
        self.finish_state(vcpu)
    }

    /// The VM's state around a stopped vCPU's: the disk's, flushed.
    fn finish_state(&self, vcpu: crate::vcpu::VcpuState) -> Result<VmState, VmError> {
        // No request is in flight while the vCPU is out of KVM_RUN (it
        // serves them synchronously); flush so the storage holds every
        // write the guest saw completed before anyone else opens it.
        let disk = {
            let mut bus = self.bus.lock().unwrap();
            let pci = bus.function();
            match bus.disk_mut() {
                Some(disk) => {
                    disk.flush()?;
                    Some(disk.state(pci))
                }
                None => None,
            }
        };
        Ok(VmState { memory_bytes: self.memory_bytes(), tsc_khz: self.tsc_khz, vcpus: vec![vcpu], disk })
    }

    /// Turns KVM's dirty page logging on or off for all of guest memory.
    pub fn set_dirty_logging(&self, on: bool) -> Result<(), VmError> {
        if on {
            // What the VMM wrote before (loading the guest, receiving it)
            // is no news to a migration that starts with every page.
            memory::take_vmm_dirty(&self.memory);
        }
        for (slot, region) in self.memory.iter().enumerate() {
            let r = kvm_userspace_memory_region {
                slot: slot as u32,
                flags: if on { KVM_MEM_LOG_DIRTY_PAGES } else { 0 },
                guest_phys_addr: region.start_addr().0,
                memory_size: region.len(),
                userspace_addr: memory::host_address(&self.memory, region.start_addr().0) as u64,
            };
            // SAFETY: same mapping as registered at creation, still owned
            // by `self.memory`; only the flags change.
            unsafe { self.fd.set_user_memory_region(r) }.map_err(ioctl_err("KVM_SET_USER_MEMORY_REGION"))?;
        }
        self.dirty_logging.store(on, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// True when dirty bits stay set until [`Vm::clear_dirty_log`] (KVM's
    /// manual protect mode); false when [`Vm::dirty_log`] clears them.
    pub fn manual_dirty_protect(&self) -> bool {
        self.manual_dirty_protect
    }

    /// An empty dirty bitmap of this VM's size.
    pub fn dirty_bitmap(&self) -> DirtyBitmap {
        DirtyBitmap::new(memory::page_count(&self.memory))
    }

    /// Fills `bitmap` with the dirty set: KVM's dirty log (one bit per
    /// page) OR the pages the VMM wrote since the last call, which KVM
    /// cannot see. With manual protect and logging just enabled, every bit
    /// of KVM's log starts set; its bits stay set until
    /// [`Vm::clear_dirty_log`], while the VMM's are taken (cleared) here.
    pub fn dirty_log(&self, bitmap: &mut DirtyBitmap) -> Result<(), VmError> {
        if !self.dirty_logging.load(std::sync::atomic::Ordering::Acquire) {
            return Err(VmError::WrongState("not logging dirty pages"));
        }
        if bitmap.pages() != memory::page_count(&self.memory) {
            return Err(VmError::WrongState("given a dirty bitmap of the wrong size"));
        }
        dirty::get_dirty_log(&self.fd, 0, bitmap.words_mut()).map_err(|e| VmError::Ioctl("KVM_GET_DIRTY_LOG", e))?;
        memory::add_vmm_dirty(&self.memory, bitmap);
        Ok(())
    }

    /// Copies KVM's dirty log into `bitmap` without taking anything: with
    /// manual protect its bits stay set until cleared (then true); without,
    /// reading would clear them, so it does not look (false).
    pub fn peek_dirty_log(&self, bitmap: &mut DirtyBitmap) -> Result<bool, VmError> {
        if !self.manual_dirty_protect || !self.dirty_logging.load(std::sync::atomic::Ordering::Acquire) {
            return Ok(false);
        }
        if bitmap.pages() != memory::page_count(&self.memory) {
            return Err(VmError::WrongState("given a dirty bitmap of the wrong size"));
        }
        dirty::get_dirty_log(&self.fd, 0, bitmap.words_mut()).map_err(|e| VmError::Ioctl("KVM_GET_DIRTY_LOG", e))?;
        Ok(true)
    }

    /// Clears the dirty bits in `mask` for the pages from `first_page` (a
    /// multiple of 64) on, write-protecting them again. Call it right
    /// before reading those pages, so a racing write is logged anew.
    /// Does nothing without manual protect (`dirty_log` cleared them).
    pub fn clear_dirty_log(&self, first_page: u64, mask: &[u64]) -> Result<(), VmError> {
        if !self.manual_dirty_protect {
            return Ok(());
        }
        let words = memory::page_count(&self.memory).div_ceil(64);
        if !first_page.is_multiple_of(64) || first_page / 64 + mask.len() as u64 > words {
            return Err(VmError::WrongState("asked to clear dirty bits outside guest memory"));
        }
        dirty::clear_dirty_log(&self.fd, 0, first_page, mask).map_err(|e| VmError::Ioctl("KVM_CLEAR_DIRTY_LOG", e))
    }

    /// Stops the vCPU thread for good.
    pub fn shutdown(&mut self) {
        if let VcpuSlot::Started(t) = &mut self.vcpu {
            self.shared.wants_pause.store(true, std::sync::atomic::Ordering::Release);
            t.kick();
            let _ = t.requests.send(VcpuRequest::Stop);
            // A vCPU blocked on a page a failed post-copy never brought
            // can leave now (it is stopping, it will not run the guest).
            crate::uffd::thaw(&self.memory);
            // The thread may be in KVM_RUN: keep kicking until it leaves.
            while !self
                .shared
                .wait_for(Duration::from_millis(50), |s| *s == VcpuStatus::Stopped)
                .eq(&VcpuStatus::Stopped)
            {
                t.kick();
            }
            if let Some(handle) = t.thread.take() {
                let _ = handle.join();
            }
        }
        self.vcpu = VcpuSlot::Empty;
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.shutdown();
    }
}
