//! What the source needs of the thing it migrates: memory, a dirty log,
//! pause/resume and a state blob. A KVM [`Vm`] is one; a trace replay
//! into plain memory ([`crate::replay`]) is the other, so the same engine
//! runs where there is no /dev/kvm.

use std::sync::Arc;

use tsubame_vmm::memory::GuestMemory;
use tsubame_vmm::{DirtyBitmap, DiskStats, DiskWarmList, VcpuStatus, Vm, VmError};

/// A migratable memory with a dirty log.
pub trait SourceVm: Sync {
    /// Guest memory (shared: the digest thread hashes it too).
    fn memory(&self) -> &Arc<GuestMemory>;
    /// Its size in bytes.
    fn memory_bytes(&self) -> u64;
    /// Running, paused, halted.
    fn status(&self) -> VcpuStatus;
    /// Turns dirty logging on or off.
    fn set_dirty_logging(&self, on: bool) -> Result<(), VmError>;
    /// True when [`SourceVm::dirty_log`] leaves bits set until
    /// [`SourceVm::clear_dirty_log`] (KVM's manual protect).
    fn manual_dirty_protect(&self) -> bool;
    /// An empty bitmap of the memory's size.
    fn dirty_bitmap(&self) -> DirtyBitmap;
    /// Fills `bitmap` with the dirty set (KVM's log and the VMM's own
    /// writes).
    fn dirty_log(&self, bitmap: &mut DirtyBitmap) -> Result<(), VmError>;
    /// Adds the dirty set, taken as [`SourceVm::dirty_log`] takes it, to
    /// `into`.
    fn add_dirty_log(&self, into: &mut DirtyBitmap) -> Result<(), VmError> {
        let mut fresh = self.dirty_bitmap();
        self.dirty_log(&mut fresh)?;
        into.union_with(&fresh);
        Ok(())
    }
    /// Looks at the dirty log without taking anything (false when this
    /// source cannot).
    fn peek_dirty_log(&self, _bitmap: &mut DirtyBitmap) -> Result<bool, VmError> {
        Ok(false)
    }
    /// Clears (re-protects) these bits, starting at `first_page`.
    fn clear_dirty_log(&self, first_page: u64, bits: &[u64]) -> Result<(), VmError>;
    /// Stops the guest.
    fn pause(&self) -> Result<(), VmError>;
    /// Stops the guest for a caller that asks for [`SourceVm::state_blob`]
    /// next (a KVM vCPU reads its state as it stops).
    fn pause_for_state(&self) -> Result<(), VmError> {
        self.pause()
    }
    /// When the guest last stopped, in µs of CLOCK_REALTIME since the Unix
    /// epoch (a source without a vCPU: now, as it is asked right after
    /// its pause).
    fn paused_at_unix_us(&self) -> u64 {
        tsubame_vmm::vcpu::unix_micros()
    }
    /// Runs the guest again.
    fn resume(&self) -> Result<(), VmError>;
    /// The vCPU and device state as sent in the STATE frame.
    fn state_blob(&self) -> Result<Vec<u8>, VmError>;
    /// Makes the guest sleep this share of its time (auto-converge; 0:
    /// run freely). A source whose guest cannot be slowed ignores it.
    fn set_throttle(&self, _fraction: f64) {}
    /// The disk cache's blocks, hottest first (at most `max_blocks`), and
    /// from now on a record of the blocks the guest writes; `None` without
    /// a disk cache.
    fn disk_warm_start(&self, _max_blocks: usize) -> Option<DiskWarmList> {
        None
    }
    /// Blocks written since the warm start or the last call.
    fn disk_written_blocks(&self) -> Vec<u64> {
        Vec::new()
    }
    /// The cached contents of those of `blocks` the disk cache holds.
    fn disk_cached_blocks(&self, _blocks: &[u64]) -> Vec<(u64, Vec<u8>)> {
        Vec::new()
    }
    /// Stops recording written blocks.
    fn disk_warm_stop(&self) {}
    /// The disk's statistics (`None` without a disk).
    fn disk_stats(&self) -> Option<DiskStats> {
        None
    }
}

impl SourceVm for Vm {
    fn memory(&self) -> &Arc<GuestMemory> {
        Vm::memory(self)
    }
    fn memory_bytes(&self) -> u64 {
        Vm::memory_bytes(self)
    }
    fn status(&self) -> VcpuStatus {
        Vm::status(self)
    }
    fn set_dirty_logging(&self, on: bool) -> Result<(), VmError> {
        Vm::set_dirty_logging(self, on)
    }
    fn manual_dirty_protect(&self) -> bool {
        Vm::manual_dirty_protect(self)
    }
    fn dirty_bitmap(&self) -> DirtyBitmap {
        Vm::dirty_bitmap(self)
    }
    fn dirty_log(&self, bitmap: &mut DirtyBitmap) -> Result<(), VmError> {
        Vm::dirty_log(self, bitmap)
    }
    fn peek_dirty_log(&self, bitmap: &mut DirtyBitmap) -> Result<bool, VmError> {
        Vm::peek_dirty_log(self, bitmap)
    }
    fn clear_dirty_log(&self, first_page: u64, bits: &[u64]) -> Result<(), VmError> {
        Vm::clear_dirty_log(self, first_page, bits)
    }
    fn pause(&self) -> Result<(), VmError> {
        Vm::pause(self)
    }
    fn resume(&self) -> Result<(), VmError> {
        Vm::resume(self)
    }
    fn pause_for_state(&self) -> Result<(), VmError> {
        Vm::pause_for_state(self)
    }
    fn paused_at_unix_us(&self) -> u64 {
        self.switch_times().paused_at_unix_us
    }
    fn state_blob(&self) -> Result<Vec<u8>, VmError> {
        Ok(self.save_state()?.encode())
    }
    fn set_throttle(&self, fraction: f64) {
        Vm::set_throttle(self, fraction)
    }
    fn disk_warm_start(&self, max_blocks: usize) -> Option<DiskWarmList> {
        Vm::disk_warm_start(self, max_blocks)
    }
    fn disk_written_blocks(&self) -> Vec<u64> {
        Vm::disk_written_blocks(self)
    }
    fn disk_cached_blocks(&self, blocks: &[u64]) -> Vec<(u64, Vec<u8>)> {
        Vm::disk_cached_blocks(self, blocks)
    }
    fn disk_warm_stop(&self) {
        Vm::disk_warm_stop(self)
    }
    fn disk_stats(&self) -> Option<DiskStats> {
        Vm::disk_stats(self)
    }
}
