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
//! instead of 0.2 s over 1 Gbit/s). So by default contents go, those the
//! guest likely reads next first, only until they are 2 s of its reads
//! ahead of it ([`WarmData::Budget`]); the destination's own reads from
//! storage bring the rest.

use std::time::{Duration, Instant};

use super::error::SourceError;
use super::link::Link;
use super::migration::Migration;
use crate::options::{WarmData, WARM_DATA_WINDOW};
use crate::protocol::disk::{MAX_BLOCKS_PER_FRAME, MAX_DATA_BLOCKS};
use crate::protocol::{DiskWritten, FrameKind, WarmBlocks, WarmData as WarmDataFrame};
use crate::stats::WarmCacheStats;

/// Most blocks named (64 GiB of cache).
const MAX_WARM_BLOCKS: usize = 16 << 20;

/// The blocks named in WARM_BLOCKS, and when.
pub(super) struct WarmUnsent {
    blocks: Vec<u64>,
    listed_at: Instant,
}

/// Whether `mode` lets more contents go after `sent_bytes`, `since_list`
/// after the list went, for a guest reading `read_bytes_per_sec`. Under
/// [`WarmData::Budget`]: while they are less than what the guest reads
/// from the list's start to [`WARM_DATA_WINDOW`] past now. Measured as
/// they go, so the link's rate needs no estimate: a link faster than the
/// guest's reads stops them that window ahead; a slower one never does.
pub(super) fn more_data(mode: WarmData, sent_bytes: u64, since_list: Duration, read_bytes_per_sec: f64) -> bool {
    match mode {
        WarmData::All => true,
        WarmData::Off => false,
        WarmData::Budget => (sent_bytes as f64) < read_bytes_per_sec * (since_list + WARM_DATA_WINDOW).as_secs_f64(),
    }
}

/// Sends the disk cache's block list (WARM_BLOCKS frames on channel 0)
/// when the VM has a disk cache holding anything and warm migration is
/// on; returns the blocks named, whose contents may still go.
pub(super) fn send_blocks(m: &mut Migration, link: &mut Link) -> Result<Option<WarmUnsent>, SourceError> {
    if !m.options.warm_cache {
        return Ok(None);
    }
    let Some(list) = m.vm.disk_warm_start(MAX_WARM_BLOCKS) else { return Ok(None) };
    if list.blocks.is_empty() {
        m.vm.disk_warm_stop();
        return Ok(None);
    }
    for chunk in list.blocks.chunks(MAX_BLOCKS_PER_FRAME) {
        let frame = WarmBlocks {
            disk: list.disk.to_string(),
            size_bytes: list.size_bytes,
            cache_bytes: list.cache_bytes,
            blocks: chunk.to_vec(),
        };
        link.write_control(FrameKind::WarmBlocks, &frame.encode())?;
    }
    m.stats.warm_cache = Some(WarmCacheStats { blocks_listed: list.blocks.len() as u64, ..WarmCacheStats::default() });
    Ok(Some(WarmUnsent { blocks: list.blocks, listed_at: Instant::now() }))
}

/// Sends the contents of the listed blocks (`unsent`), those the guest
/// likely reads next first, that `--warm-data` lets go and the source's
/// cache still holds (WARM_DATA frames on channel 0). A block the guest
/// writes after it was read here is named in a later DISK_WRITTEN, so
/// the destination drops the stale copy.
pub(super) fn send_data(m: &mut Migration, link: &mut Link, unsent: WarmUnsent) -> Result<(), SourceError> {
    let rate = m.vm.disk_stats().map_or(0.0, |d| d.recent_read_bytes_per_sec);
    let started = Instant::now();
    let (mut sent, mut sent_bytes) = (0, 0);
    for chunk in unsent.blocks.chunks(MAX_DATA_BLOCKS) {
        if !more_data(m.options.warm_data, sent_bytes, unsent.listed_at.elapsed(), rate) {
            break;
        }
        // One chunk at a time: the vCPU waits for the cache's lock
        // only as long as copying 1 MiB takes.
        let data = WarmDataFrame { blocks: m.vm.disk_cached_blocks(chunk) };
        if data.blocks.is_empty() {
            continue;
        }
        sent += data.blocks.len() as u64;
        sent_bytes += data.blocks.iter().map(|(_, bytes)| bytes.len() as u64).sum::<u64>();
        link.write_control(FrameKind::WarmData, &data.encode())?;
    }
    if let Some(warm) = m.stats.warm_cache.as_mut() {
        warm.blocks_sent += sent;
        warm.read_bytes_per_sec = rate;
        warm.data_seconds = started.elapsed().as_secs_f64();
    }
    Ok(())
}

/// DISK_WRITTEN payloads for the blocks written since the last call
/// (none when no warm list went out).
pub(super) fn disk_written_frames(m: &mut Migration) -> Vec<Vec<u8>> {
    let Some(warm) = m.stats.warm_cache.as_mut() else { return Vec::new() };
    let blocks = m.vm.disk_written_blocks();
    warm.blocks_written += blocks.len() as u64;
    blocks.chunks(MAX_BLOCKS_PER_FRAME).map(|c| DiskWritten { blocks: c.to_vec() }.encode()).collect()
}

/// Sends DISK_WRITTEN on channel 0 for the blocks written since the
/// last call.
pub(super) fn send_disk_written(m: &mut Migration, link: &mut Link) -> Result<(), SourceError> {
    for payload in disk_written_frames(m) {
        link.write_control(FrameKind::DiskWritten, &payload)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contents_go_until_they_are_a_window_ahead_of_the_guest_s_reads() {
        let secs = Duration::from_secs_f64;
        // 26 MB/s, listed 0.5 s ago: up to 26e6 * 2.5 = 65 MB.
        assert!(more_data(WarmData::Budget, 64_000_000, secs(0.5), 26e6));
        assert!(!more_data(WarmData::Budget, 65_000_000, secs(0.5), 26e6));
        // A link slower than the reads never gets ahead: 20 MB/s sent.
        assert!((0..100).all(|t| more_data(WarmData::Budget, t * 20_000_000, secs(t as f64), 26e6)));
        assert!(!more_data(WarmData::Budget, 0, secs(3.0), 0.0), "a guest that reads nothing gets none");
        assert!(more_data(WarmData::All, u64::MAX, secs(0.0), 0.0));
        assert!(!more_data(WarmData::Off, 0, secs(0.0), 1e9));
    }

    #[test]
    fn warm_data_modes_parse_and_print_back() {
        for mode in ["auto", "all", "none"] {
            assert_eq!(mode.parse::<WarmData>().unwrap().to_string(), mode);
        }
        assert!("some".parse::<WarmData>().unwrap_err().contains("auto, all or none"));
    }
}
