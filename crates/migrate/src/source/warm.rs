//! Warm migration of the disk cache (the large-I/O paper's proposal): the
//! source names its cache's blocks, hottest first, at the start of
//! pre-copy, and the destination reads them from the shared storage into
//! its own cache while memory moves; the blocks the guest writes meanwhile
//! are named again (DISK_WRITTEN) so the destination drops its early
//! copies. Storage may be slower than the migration (a small VM moves in
//! a fraction of a second; 100 MiB of cache take a second from a 100 MB/s
//! disk), so once the first iteration has moved the bulk of memory the
//! source also sends the cached contents themselves (WARM_DATA): they
//! arrive before STATE whatever the storage's speed, and the
//! destination's fill from storage only saves link bandwidth where it
//! wins the race.

use super::{SourceError, SourceRun};
use crate::protocol::disk::{MAX_BLOCKS_PER_FRAME, MAX_DATA_BLOCKS};
use crate::protocol::{DiskWritten, FrameKind, WarmBlocks, WarmData};
use crate::stats::WarmCacheStats;

/// Most blocks named (64 GiB of cache).
const MAX_WARM_BLOCKS: usize = 16 << 20;

impl SourceRun<'_> {
    /// Sends the disk cache's block list (WARM_BLOCKS frames on channel 0)
    /// when the VM has a disk cache holding anything and warm migration is
    /// on.
    pub(super) fn send_warm_blocks(&mut self) -> Result<(), SourceError> {
        if !self.options.warm_cache {
            return Ok(());
        }
        let Some(list) = self.vm.disk_warm_start(MAX_WARM_BLOCKS) else { return Ok(()) };
        if list.blocks.is_empty() {
            self.vm.disk_warm_stop();
            return Ok(());
        }
        for chunk in list.blocks.chunks(MAX_BLOCKS_PER_FRAME) {
            let frame = WarmBlocks {
                disk: list.disk.to_string(),
                size_bytes: list.size_bytes,
                cache_bytes: list.cache_bytes,
                blocks: chunk.to_vec(),
            };
            self.write_control(FrameKind::WarmBlocks, &frame.encode())?;
        }
        self.stats.warm_cache =
            Some(WarmCacheStats { blocks_listed: list.blocks.len() as u64, blocks_written: 0, blocks_sent: 0 });
        self.warm_unsent = list.blocks;
        Ok(())
    }

    /// Sends the listed blocks' contents that the source's cache still
    /// holds (WARM_DATA frames on channel 0), hottest first. A block the
    /// guest writes after it was read here is named in a later
    /// DISK_WRITTEN, so the destination drops the stale copy.
    pub(super) fn send_warm_data(&mut self) -> Result<(), SourceError> {
        let blocks = std::mem::take(&mut self.warm_unsent);
        let mut sent = 0;
        for chunk in blocks.chunks(MAX_DATA_BLOCKS) {
            // One chunk at a time: the vCPU waits for the cache's lock
            // only as long as copying 1 MiB takes.
            let data = WarmData { blocks: self.vm.disk_cached_blocks(chunk) };
            if data.blocks.is_empty() {
                continue;
            }
            sent += data.blocks.len() as u64;
            self.write_control(FrameKind::WarmData, &data.encode())?;
        }
        if let Some(warm) = self.stats.warm_cache.as_mut() {
            warm.blocks_sent += sent;
        }
        Ok(())
    }

    /// DISK_WRITTEN payloads for the blocks written since the last call
    /// (none when no warm list went out).
    pub(super) fn disk_written_frames(&mut self) -> Vec<Vec<u8>> {
        let Some(warm) = self.stats.warm_cache.as_mut() else { return Vec::new() };
        let blocks = self.vm.disk_written_blocks();
        warm.blocks_written += blocks.len() as u64;
        blocks.chunks(MAX_BLOCKS_PER_FRAME).map(|c| DiskWritten { blocks: c.to_vec() }.encode()).collect()
    }

    /// Sends DISK_WRITTEN on channel 0 for the blocks written since the
    /// last call.
    pub(super) fn send_disk_written(&mut self) -> Result<(), SourceError> {
        for payload in self.disk_written_frames() {
            self.write_control(FrameKind::DiskWritten, &payload)?;
        }
        Ok(())
    }
}
