//! Loading a saved state into a VM: before it starts, into its paused
//! vCPU (a migration's destination, which checks its memory meanwhile),
//! or into a paused vCPU that runs the guest at once (post-copy's start).

use super::{ioctl_err, VcpuSlot, Vm, VmError};
use crate::pci::PciFunctionState;
use crate::persist::VmState;
use crate::vcpu::{restore_state, VcpuError, VcpuRequest, VcpuState, VcpuStatus};
use crate::virtio_blk::VirtioBlk;

/// The disk a state names, opened (behind a warm cache where it fits).
type OpenedDisk = Option<(VirtioBlk, PciFunctionState)>;
type WarmCache = Option<(tsubame_block::DiskSpec, tsubame_block::BlockCache)>;

/// A restore under way on the vCPU thread ([`Vm::begin_restore`]).
pub struct PendingRestore {
    /// The vCPU thread's answer; none when the state loaded at once.
    reply: Option<crossbeam_channel::Receiver<Result<(), VcpuError>>>,
    disk: OpenedDisk,
    tsc_khz: u32,
}

impl Vm {
    /// Loads a saved vCPU and device state (opening the disk's storage the
    /// state names); the VM must be paused or not started.
    pub fn restore_state(&mut self, state: &VmState) -> Result<(), VmError> {
        self.restore_state_with_cache(state, None)
    }

    /// [`Vm::restore_state`], with the disk behind `cache` when one was
    /// filled ahead (a warm migration) and the state names the same
    /// storage with the same cache capacity; otherwise the disk opens cold.
    pub fn restore_state_with_cache(&mut self, state: &VmState, cache: WarmCache) -> Result<(), VmError> {
        let pending = self.begin_restore(state, cache)?;
        self.finish_restore(pending)
    }

    /// [`Vm::restore_state_with_cache`] without waiting for the vCPU's
    /// part: a paused vCPU thread loads it while the caller goes on (a
    /// migration's destination checks its memory meanwhile: the ioctls
    /// took 0.06-0.08 ms of the stop here). [`Vm::finish_restore`] waits
    /// for it; nothing changes until then but the vCPU's registers.
    pub fn begin_restore(&mut self, state: &VmState, cache: WarmCache) -> Result<PendingRestore, VmError> {
        let (vcpu_state, disk) = self.check_and_open(state, cache)?;
        let tsc_khz = (state.tsc_khz != self.tsc_khz).then_some(state.tsc_khz);
        let reply = match &self.vcpu {
            VcpuSlot::NotStarted(fd) => {
                if let Some(khz) = tsc_khz {
                    fd.set_tsc_khz(khz).map_err(ioctl_err("KVM_SET_TSC_KHZ"))?;
                }
                restore_state(fd, vcpu_state)?;
                None
            }
            VcpuSlot::Started(t) => {
                if !self.shared.get().is_stopped() {
                    return Err(VmError::WrongState("running; pause it first"));
                }
                let (tx, rx) = crossbeam_channel::bounded(1);
                let request = VcpuRequest::Restore(Box::new(vcpu_state.clone()), tsc_khz, tx);
                t.requests.send(request).map_err(|_| VcpuError::Gone)?;
                Some(rx)
            }
            VcpuSlot::Empty => return Err(VmError::WrongState("being started")),
        };
        Ok(PendingRestore { reply, disk, tsc_khz: state.tsc_khz })
    }

    /// Waits for the restore [`Vm::begin_restore`] handed over, then plugs
    /// in the disk the state names.
    pub fn finish_restore(&mut self, pending: PendingRestore) -> Result<(), VmError> {
        let PendingRestore { reply, disk, tsc_khz } = pending;
        if let Some(reply) = reply {
            reply.recv().map_err(|_| VcpuError::Gone)??;
        }
        self.tsc_khz = tsc_khz;
        if let Some((disk, pci)) = disk {
            self.plug_disk(disk, pci);
        }
        Ok(())
    }

    /// Loads a saved state and runs the guest: with a vCPU thread started
    /// paused ahead, that thread loads it and goes on into the guest (one
    /// wake-up; a thread created at this moment waited ~1 ms for a CPU
    /// here), otherwise restore, then start. `announce` runs as the guest
    /// starts (on the vCPU thread, right before its first instruction).
    /// Returns once the vCPU runs.
    pub fn restore_and_run(
        &mut self,
        state: &VmState,
        cache: WarmCache,
        announce: Box<dyn FnOnce() + Send>,
    ) -> Result<(), VmError> {
        let VcpuSlot::Started(t) = &self.vcpu else {
            self.restore_state_with_cache(state, cache)?;
            self.start(false)?;
            announce();
            return Ok(());
        };
        if self.shared.get() != VcpuStatus::Paused {
            return Err(VmError::WrongState("not paused"));
        }
        let requests = t.requests.clone();
        let (vcpu_state, disk) = self.check_and_open(state, cache)?;
        let vcpu_state = Box::new(vcpu_state.clone());
        // The disk is there before the guest's first instruction.
        if let Some((disk, pci)) = disk {
            self.plug_disk(disk, pci);
        }
        let tsc_khz = (state.tsc_khz != self.tsc_khz).then_some(state.tsc_khz);
        let (tx, rx) = crossbeam_channel::bounded(1);
        // The thread wakes ahead of every other and goes into the guest
        // without waiting for a CPU; it is put back under the normal
        // scheduler once it is there (a thread that does so itself gives
        // its CPU away first: its guest ran 0.1-0.3 ms later).
        let tid = self.shared.thread_id.load(std::sync::atomic::Ordering::Acquire);
        if tid != 0 {
            crate::cpu_time::hurry_thread(tid);
        }
        let sent = requests.send(VcpuRequest::RestoreAndRun(vcpu_state, tsc_khz, announce, tx));
        let replied = sent.map_err(|_| VcpuError::Gone).and_then(|()| rx.recv().map_err(|_| VcpuError::Gone));
        if tid != 0 {
            crate::cpu_time::normal_thread_of(tid);
        }
        replied??;
        self.tsc_khz = state.tsc_khz;
        Ok(())
    }

    /// Checks that `state` fits this VM and opens the disk it names: the
    /// storage that cannot be opened here, or has another size, fails the
    /// restore before anything changed.
    fn check_and_open<'s>(&self, state: &'s VmState, cache: WarmCache) -> Result<(&'s VcpuState, OpenedDisk), VmError> {
        if state.memory_bytes != self.memory_bytes() {
            return Err(VmError::StateMismatch(format!(
                "state is for {} bytes of memory, this VM has {}",
                state.memory_bytes,
                self.memory_bytes()
            )));
        }
        let [vcpu_state] = state.vcpus.as_slice() else {
            return Err(VmError::StateMismatch(format!("state has {} vCPUs, this VM has 1", state.vcpus.len())));
        };
        let disk = match &state.disk {
            Some(saved) => {
                let mut disk = match cache {
                    Some((spec, cache)) if spec == saved.disk && cache.capacity_bytes() == saved.cache_bytes => {
                        VirtioBlk::new(self.memory.clone(), cache, spec)
                    }
                    _ => VirtioBlk::open(self.memory.clone(), &saved.disk, saved.cache_bytes)?,
                };
                disk.restore(saved)?;
                Some((disk, saved.pci))
            }
            None if self.bus.lock().unwrap().disk().is_some() => {
                return Err(VmError::StateMismatch("this VM has a disk, the state has none".into()))
            }
            None => None,
        };
        Ok((vcpu_state, disk))
    }
}
