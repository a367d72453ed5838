//! The VM's virtio-blk disk: attaching it, and what a warm migration
//! reads of its host block cache.

use super::{VcpuSlot, Vm, VmError};
use crate::pci::PciFunctionState;
use crate::virtio_blk::{DiskStats, DiskStatsHandle, VirtioBlk};

/// A disk cache's contents by name, for a warm migration
/// ([`Vm::disk_warm_start`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskWarmList {
    /// The storage.
    pub disk: tsubame_block::DiskSpec,
    /// Its size in bytes.
    pub size_bytes: u64,
    /// The cache's capacity in bytes.
    pub cache_bytes: u64,
    /// Cached blocks (byte offset / 4 KiB), most recently used first.
    pub blocks: Vec<u64>,
}

impl Vm {
    /// Gives the VM a virtio-blk disk on the storage `spec` names, behind a
    /// host block cache of `cache_bytes` (0: none). Before the VM starts.
    pub fn attach_disk(&mut self, spec: &tsubame_block::DiskSpec, cache_bytes: u64) -> Result<(), VmError> {
        if !matches!(self.vcpu, VcpuSlot::NotStarted(_)) {
            return Err(VmError::WrongState("already started"));
        }
        let disk = VirtioBlk::open(self.memory.clone(), spec, cache_bytes)?;
        self.plug_disk(disk, PciFunctionState::default());
        Ok(())
    }

    pub(super) fn plug_disk(&mut self, disk: VirtioBlk, pci: PciFunctionState) {
        self.disk_stats = Some(disk.stats_handle());
        self.bus.lock().unwrap().attach_disk(disk, pci);
    }

    /// What a warm migration sends ahead of the VM: the disk's storage, its
    /// size, its cache's capacity and the cached blocks, most recently used
    /// first (at most `max_blocks`); `None` without a disk or a cache.
    /// From now on the cache records the blocks the guest writes, for
    /// [`Vm::disk_written_blocks`].
    pub fn disk_warm_start(&self, max_blocks: usize) -> Option<DiskWarmList> {
        let mut bus = self.bus.lock().unwrap();
        let disk = bus.disk_mut()?;
        if disk.cache().capacity_bytes() == 0 {
            return None;
        }
        disk.cache_mut().track_writes(true);
        Some(DiskWarmList {
            disk: disk.spec().clone(),
            size_bytes: disk.size_bytes(),
            cache_bytes: disk.cache().capacity_bytes(),
            blocks: disk.cache().hot_blocks(max_blocks),
        })
    }

    /// Blocks the guest wrote since [`Vm::disk_warm_start`] or the last
    /// call, ascending.
    pub fn disk_written_blocks(&self) -> Vec<u64> {
        self.bus.lock().unwrap().disk_mut().map(|d| d.cache_mut().take_written()).unwrap_or_default()
    }

    /// The cached contents of those of `blocks` the disk cache holds (a
    /// warm migration sends them so the destination need not read them).
    pub fn disk_cached_blocks(&self, blocks: &[u64]) -> Vec<(u64, Vec<u8>)> {
        let bus = self.bus.lock().unwrap();
        let Some(disk) = bus.disk() else { return Vec::new() };
        blocks.iter().filter_map(|&b| Some((b, disk.cache().peek(b)?.to_vec()))).collect()
    }

    /// Ends what [`Vm::disk_warm_start`] began (the migration ended).
    pub fn disk_warm_stop(&self) {
        if let Some(disk) = self.bus.lock().unwrap().disk_mut() {
            disk.cache_mut().track_writes(false);
        }
    }

    /// The disk's statistics, when the VM has one.
    pub fn disk_stats(&self) -> Option<DiskStats> {
        self.disk_stats.as_ref().map(DiskStatsHandle::get)
    }
}
