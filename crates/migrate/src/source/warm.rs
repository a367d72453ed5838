//! Warm migration of the disk cache (the large-I/O paper's proposal): the
//! source names its cache's blocks, hottest first, at the start of
//! pre-copy, and the destination reads them from the shared storage into
//! its own cache while memory moves; the blocks the guest writes meanwhile
//! are named again (DISK_WRITTEN) so the destination drops its early
//! copies. Storage may be slower than the migration (a small VM moves in
//! a fraction of a second; 100 MiB of cache take a second from a 100 MB/s
//! disk), so once the first iteration has moved the bulk of memory the
//! source also sends cached contents themselves (WARM_DATA): they arrive
//! before STATE whatever the storage's speed, but every byte of them
//! lengthens the migration (six VMs of 256 MiB of cache each took 12.4 s
//! instead of 0.2 s over 1 Gbit/s). So by default contents go only where
//! storage serves the guest slower than it reads, and only those it reads
//! first at the destination ([`WarmData::Budget`]); the destination's own
//! reads from storage bring the rest.

use std::time::Instant;

use super::{SourceError, SourceRun};
use crate::options::{WarmData, WARM_DATA_WINDOW};
use crate::protocol::disk::{MAX_BLOCKS_PER_FRAME, MAX_DATA_BLOCKS};
use crate::protocol::{DiskWritten, FrameKind, WarmBlocks, WarmData as WarmDataFrame};
use crate::stats::WarmCacheStats;

/// Most blocks named (64 GiB of cache).
const MAX_WARM_BLOCKS: usize = 16 << 20;

/// The blocks named in WARM_BLOCKS, and when: the guest's read rate
/// from then on budgets the contents sent.
pub(super) struct WarmUnsent {
    blocks: Vec<u64>,
    listed_at: Instant,
    bytes_read_then: u64,
}

/// The rates [`WarmData::Budget`] weighs, in bytes per second.
#[derive(Debug, Clone, Copy)]
pub(super) struct Rates {
    /// The guest's disk reads since the list went.
    pub guest: f64,
    /// What storage served its reads at (`None` until it served some).
    pub storage: Option<f64>,
    /// What the migration link carries.
    pub link: f64,
}

/// Blocks of `block_bytes` whose contents `mode` lets go, of `listed`.
/// Under [`WarmData::Budget`], a guest storage keeps up with gets none;
/// else the reads of its first [`WARM_DATA_WINDOW`] at the destination
/// and those it makes while they cross the link: B = R·W + R·B/L, so
/// B = R·W / (1 − R/L), and every block when R ≥ L.
pub(super) fn data_budget(mode: WarmData, listed: usize, rates: Rates, block_bytes: usize) -> usize {
    let Rates { guest, storage, link } = rates;
    match mode {
        WarmData::All => listed,
        WarmData::Off => 0,
        WarmData::Budget if guest <= 0.0 || storage.is_some_and(|s| s >= guest) => 0,
        WarmData::Budget if guest >= link => listed,
        WarmData::Budget => {
            let bytes = guest * WARM_DATA_WINDOW.as_secs_f64() / (1.0 - guest / link);
            ((bytes / block_bytes as f64).ceil() as usize).min(listed)
        }
    }
}

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
            Some(WarmCacheStats { blocks_listed: list.blocks.len() as u64, ..WarmCacheStats::default() });
        let bytes_read_then = self.vm.disk_stats().map_or(0, |stats| stats.bytes_read);
        self.warm_unsent = Some(WarmUnsent { blocks: list.blocks, listed_at: Instant::now(), bytes_read_then });
        Ok(())
    }

    /// Sends the contents of the hottest listed blocks that
    /// `--warm-data` allows and the source's cache still holds (WARM_DATA
    /// frames on channel 0). A block the guest writes after it was read
    /// here is named in a later DISK_WRITTEN, so the destination drops the
    /// stale copy.
    pub(super) fn send_warm_data(&mut self) -> Result<(), SourceError> {
        let Some(unsent) = self.warm_unsent.take() else { return Ok(()) };
        let seconds = unsent.listed_at.elapsed().as_secs_f64();
        let disk = self.vm.disk_stats();
        let read = disk.as_ref().map_or(0, |d| d.bytes_read).saturating_sub(unsent.bytes_read_then);
        let rates = Rates {
            guest: if seconds > 0.0 { read as f64 / seconds } else { 0.0 },
            storage: disk.and_then(|d| d.cache.storage_rate()),
            link: self.policy.bandwidth_for(self.options),
        };
        let budget = data_budget(self.options.warm_data, unsent.blocks.len(), rates, tsubame_block::BLOCK_SIZE);
        let mut sent = 0;
        for chunk in unsent.blocks[..budget].chunks(MAX_DATA_BLOCKS) {
            // One chunk at a time: the vCPU waits for the cache's lock
            // only as long as copying 1 MiB takes.
            let data = WarmDataFrame { blocks: self.vm.disk_cached_blocks(chunk) };
            if data.blocks.is_empty() {
                continue;
            }
            sent += data.blocks.len() as u64;
            self.write_control(FrameKind::WarmData, &data.encode())?;
        }
        if let Some(warm) = self.stats.warm_cache.as_mut() {
            warm.blocks_sent += sent;
            warm.blocks_budget = budget as u64;
            warm.read_bytes_per_sec = rates.guest;
            warm.storage_bytes_per_sec = rates.storage.unwrap_or(0.0);
            warm.link_bytes_per_sec = rates.link;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_is_the_window_of_reads_and_what_is_read_while_it_crosses() {
        let rates = |guest, storage, link| Rates { guest, storage, link };
        // 26 MB/s from 16 MB/s storage over 125 MB/s: 26e6·2 / (1 − 26/125)
        // = 65.66 MB, 16,030 blocks (ceil).
        assert_eq!(data_budget(WarmData::Budget, 65_536, rates(26e6, Some(16e6), 125e6), 4096), 16_030);
        assert_eq!(data_budget(WarmData::Budget, 1000, rates(26e6, None, 125e6), 4096), 1000, "never more than listed");
        assert_eq!(data_budget(WarmData::Budget, 65_536, rates(26e6, Some(30e6), 125e6), 4096), 0, "storage keeps up");
        assert_eq!(
            data_budget(WarmData::Budget, 65_536, rates(26e6, Some(16e6), 21e6), 4096),
            65_536,
            "faster than the link"
        );
        assert_eq!(data_budget(WarmData::Budget, 1000, rates(0.0, None, 1e9), 4096), 0, "a guest that reads nothing");
        assert_eq!(data_budget(WarmData::All, 1000, rates(0.0, Some(1e9), 1e9), 4096), 1000);
        assert_eq!(data_budget(WarmData::Off, 1000, rates(1e9, Some(1.0), 1e12), 4096), 0);
    }

    #[test]
    fn warm_data_modes_parse_and_print_back() {
        for mode in ["auto", "all", "none"] {
            assert_eq!(mode.parse::<WarmData>().unwrap().to_string(), mode);
        }
        assert!("some".parse::<WarmData>().unwrap_err().contains("auto, all or none"));
    }
}
