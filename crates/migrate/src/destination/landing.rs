//! Where an incoming VM lands: a KVM VM, or plain memory (fuzzing, tests,
//! `receive --memory-only`).

use std::sync::Arc;

use tsubame_block::{BlockCache, DiskSpec};
use tsubame_farmem::{FarMap, FarReader, FarSetup};
use tsubame_vmm::memory::{self, GuestMemory};
use tsubame_vmm::{PendingRestore, Vm, VmConfig, VmState};

use super::error::ReceiveError;
use super::postcopy::{write_flushed, BackChannel};
use crate::protocol::{self, FrameKind, PostcopyRunning};

/// A disk cache a warm migration filled ahead of the VM, for its disk.
pub struct WarmDisk {
    /// The storage it caches.
    pub spec: DiskSpec,
    /// The cache, in front of that storage.
    pub cache: BlockCache,
}

/// Where an incoming VM lands: a real VM, or (fuzzing, tests) plain memory.
pub trait Landing {
    /// Maps guest memory of this size (already range-checked).
    fn create(&mut self, memory_bytes: u64) -> Result<Arc<GuestMemory>, ReceiveError>;
    /// Loads the vCPU and device state from the STATE frame; the disk
    /// uses `disk_cache` when a warm migration filled one for it.
    /// The load may go on in the background until [`Landing::restored`].
    fn restore(&mut self, state: &[u8], disk_cache: Option<WarmDisk>) -> Result<(), ReceiveError>;
    /// Waits until the state [`Landing::restore`] was given is loaded.
    fn restored(&mut self) -> Result<(), ReceiveError> {
        Ok(())
    }
    /// Runs the guest: the source has committed.
    fn start(&mut self) -> Result<(), ReceiveError>;
    /// False where storage must never be opened (plain memory: fuzzing,
    /// `receive --memory-only`): disk frames are then ignored.
    fn opens_storage(&self) -> bool {
        true
    }
    /// Loads the state and runs the guest before all its memory is here
    /// (post-copy): no huge pages yet (they come once every page is in).
    /// `announce` runs as the guest starts.
    fn run_postcopy(
        &mut self,
        state: &[u8],
        disk_cache: Option<WarmDisk>,
        announce: Announce,
    ) -> Result<(), ReceiveError> {
        self.restore(state, disk_cache)?;
        self.restored()?;
        self.start()?;
        announce();
        Ok(())
    }
    /// The VM has far memory (its pages named in `map` live on memory
    /// hosts): attach to them. Plain memory ignores it, as it ignores disks.
    fn far_memory(&mut self, _map: FarMap) -> Result<(), ReceiveError> {
        Ok(())
    }
    /// Lets the vCPU thread run only on `cpus` (the stop's threads kept
    /// apart, destination/apart.rs). Plain memory has no vCPU.
    fn vcpu_run_on(&self, _cpus: &[usize]) {}
    /// A reader of the far pages for post-copy's fault thread (none in
    /// plain memory, which has no far memory attached).
    fn far_reader(&mut self) -> Result<Option<FarReader>, ReceiveError> {
        Ok(None)
    }
}

/// Lands the VM in a KVM VM.
///
/// Memory is mapped with 4 KiB pages while pages arrive, and its dense
/// ranges are backed with huge pages once the guest runs
/// ([`memory::back_dense_with_huge_pages_later`]): with huge pages, every page written into a
/// fresh 2 MiB region costs the kernel zeroing all 2 MiB, and a guest whose
/// pages are few and scattered (GMigrate's "Best") made the destination
/// zero gigabytes it never needed (12-15 s instead of 1.8 s for 4 GiB of
/// `fill-zero` at 1 Gbit/s).
pub(super) struct VmLanding {
    pub(super) vm: Option<Vm>,
    /// The state its paused vCPU thread loads meanwhile.
    pub(super) restoring: Option<PendingRestore>,
    pub(super) hugepages: bool,
    /// Far memory's exports, opened when the map came; registered with the
    /// VM's memory right before it starts.
    pub(super) far: Option<FarSetup>,
}

impl Landing for VmLanding {
    fn create(&mut self, memory_bytes: u64) -> Result<Arc<GuestMemory>, ReceiveError> {
        let vm = self.vm.insert(Vm::create(&VmConfig { memory_bytes, hugepages: false })?);
        // Its vCPU thread waits, paused, from now on: the stop then only
        // hands it the state and wakes it (creating it took 0.06-0.07 ms
        // of the stop, after COMMIT), as does post-copy's switch.
        vm.start(true)?;
        Ok(vm.memory().clone())
    }

    fn restore(&mut self, blob: &[u8], disk_cache: Option<WarmDisk>) -> Result<(), ReceiveError> {
        let state = decode_state(blob)?;
        let vm = self.vm.as_mut().expect("created first");
        self.restoring = Some(vm.begin_restore(&state, disk_cache.map(|d| (d.spec, d.cache)))?);
        Ok(())
    }

    fn restored(&mut self) -> Result<(), ReceiveError> {
        match self.restoring.take() {
            Some(pending) => Ok(self.vm.as_mut().expect("created first").finish_restore(pending)?),
            None => Ok(()),
        }
    }

    fn start(&mut self) -> Result<(), ReceiveError> {
        let vm = self.vm.as_mut().expect("created first");
        match self.far.as_mut() {
            // Far pages come back through userfaultfd, 4 KiB at a time.
            Some(far) => far.register(vm).map_err(|e| ReceiveError::FarMemory(e.to_string()))?,
            None if self.hugepages => memory::back_dense_with_huge_pages_later(vm.memory().clone()),
            None => {}
        }
        Ok(vm.release()?)
    }

    fn vcpu_run_on(&self, cpus: &[usize]) {
        if let Some(vm) = &self.vm {
            vm.vcpu_run_on(cpus);
        }
    }

    fn far_memory(&mut self, map: FarMap) -> Result<(), ReceiveError> {
        let bytes = self.vm.as_ref().expect("created first").memory_bytes();
        self.far = Some(FarSetup::arrived(map, bytes).map_err(|e| ReceiveError::FarMemory(e.to_string()))?);
        Ok(())
    }

    fn run_postcopy(
        &mut self,
        blob: &[u8],
        disk_cache: Option<WarmDisk>,
        announce: Announce,
    ) -> Result<(), ReceiveError> {
        let state = decode_state(blob)?;
        let vm = self.vm.as_mut().expect("created first");
        if self.far.is_some() {
            // Before the vCPU runs: far memory reads the log once it takes
            // over, and a memory-slot change then would wait for a vCPU
            // that may be waiting on a far page.
            vm.set_dirty_logging(true)?;
        }
        Ok(vm.restore_and_run(&state, disk_cache.map(|d| (d.spec, d.cache)), announce)?)
    }

    fn far_reader(&mut self) -> Result<Option<FarReader>, ReceiveError> {
        match &self.far {
            Some(far) => Ok(Some(far.reader().map_err(|e| ReceiveError::FarMemory(e.to_string()))?)),
            None => Ok(None),
        }
    }
}

/// Lands the VM's memory in plain memory (no KVM): for fuzzing the
/// receiver and for tests. Refuses memory above `max_bytes`.
pub struct MemoryLanding {
    /// Largest memory accepted.
    pub max_bytes: u64,
    /// The memory, once created.
    pub memory: Option<Arc<GuestMemory>>,
    /// True once the source committed.
    pub started: bool,
}

impl Landing for MemoryLanding {
    fn create(&mut self, memory_bytes: u64) -> Result<Arc<GuestMemory>, ReceiveError> {
        if memory_bytes > self.max_bytes {
            return Err(ReceiveError::Mismatch(format!("{memory_bytes} bytes of memory exceed {}", self.max_bytes)));
        }
        let mem = Arc::new(memory::create(memory_bytes, false).map_err(tsubame_vmm::VmError::from)?);
        Ok(self.memory.insert(mem).clone())
    }

    fn opens_storage(&self) -> bool {
        false
    }

    fn restore(&mut self, _state: &[u8], _disk_cache: Option<WarmDisk>) -> Result<(), ReceiveError> {
        Ok(())
    }

    fn start(&mut self) -> Result<(), ReceiveError> {
        self.started = true;
        Ok(())
    }
}

/// Tells the source the VM runs here (post-copy's switch).
pub(super) type Announce = Box<dyn FnOnce() + Send>;

/// The [`Announce`] that writes POSTCOPY_RUNNING on the back channel (a
/// failed write shows on the link's reader; the VM runs here regardless).
pub(super) fn announce_running(back: BackChannel, running: PostcopyRunning) -> Announce {
    Box::new(move || {
        let _ = write_flushed(&back, |w| protocol::write_frame(w, FrameKind::PostcopyRunning, &running.encode()));
    })
}

/// The VM's state from its blob.
fn decode_state(blob: &[u8]) -> Result<VmState, ReceiveError> {
    if blob.is_empty() {
        return Err(ReceiveError::BadState(
            "the source sent no vCPU state (a trace replay?); receive it with --memory-only".into(),
        ));
    }
    VmState::decode(blob).map_err(|e| ReceiveError::BadState(e.to_string()))
}
