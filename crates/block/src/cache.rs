//! The host-side block cache (`--block-cache SIZE`): the analogue of the
//! hypervisor host's page cache in the I/O paper. 4 KiB blocks, least
//! recently used evicted first, write-through (a write reaches storage
//! before it completes, so the cache never holds the only copy of data and
//! a VM can move away at any time without flushing it). With no capacity
//! it passes every request through and only counts.

use std::collections::HashSet;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use lru::LruCache;
use serde::{Deserialize, Serialize};

use crate::{check_range, Backend, BlockError, BLOCK_SIZE};

/// Most blocks read from storage in one request on a run of misses.
const MAX_MISS_RUN: u64 = 256;
/// Blocks read ahead when a miss continues where the last storage read
/// ended (a sequential reader), as a host page cache does (256 KiB).
const READAHEAD_BLOCKS: u64 = 64;

/// What the cache did, as `stats` and `run`'s summary report it.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheStats {
    /// Bytes the cache may hold (0: no cache).
    pub capacity_bytes: u64,
    /// Bytes it holds now.
    pub cached_bytes: u64,
    /// Blocks read that the cache held.
    pub hits: u64,
    /// Blocks read that it had to fetch from storage.
    pub misses: u64,
    /// Bytes read from storage.
    pub bytes_from_storage: u64,
    /// Bytes written to storage.
    pub bytes_written: u64,
    /// Flushes passed to storage.
    pub flushes: u64,
    /// Blocks read ahead of a sequential reader.
    pub readahead_blocks: u64,
    /// Blocks read ahead of the guest by a warm migration's fill.
    pub warmed_blocks: u64,
    /// Warmed blocks dropped again because the guest wrote them at the
    /// source after they were read here.
    pub invalidated_blocks: u64,
}

/// Counters readable from any thread while the cache works on another.
#[derive(Debug, Default)]
struct Counters {
    cached_blocks: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    bytes_from_storage: AtomicU64,
    bytes_written: AtomicU64,
    flushes: AtomicU64,
    readahead_blocks: AtomicU64,
    warmed_blocks: AtomicU64,
    invalidated_blocks: AtomicU64,
}

/// A handle on a cache's statistics for other threads.
#[derive(Debug, Clone)]
pub struct CacheStatsHandle {
    counters: Arc<Counters>,
    capacity_bytes: u64,
}

impl CacheStatsHandle {
    /// The statistics now.
    pub fn get(&self) -> CacheStats {
        let c = &self.counters;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CacheStats {
            capacity_bytes: self.capacity_bytes,
            cached_bytes: load(&c.cached_blocks) * BLOCK_SIZE as u64,
            hits: load(&c.hits),
            misses: load(&c.misses),
            bytes_from_storage: load(&c.bytes_from_storage),
            bytes_written: load(&c.bytes_written),
            flushes: load(&c.flushes),
            readahead_blocks: load(&c.readahead_blocks),
            warmed_blocks: load(&c.warmed_blocks),
            invalidated_blocks: load(&c.invalidated_blocks),
        }
    }
}

/// A cache of 4 KiB blocks in front of a backend.
pub struct BlockCache {
    inner: Box<dyn Backend>,
    blocks: Option<LruCache<u64, Box<[u8]>>>,
    counters: Arc<Counters>,
    capacity_bytes: u64,
    scratch: Vec<u8>,
    /// Blocks written since tracking began (a warm migration's source
    /// tells the destination which of the blocks it read ahead went stale).
    written: Option<HashSet<u64>>,
    /// The block after the last storage read: a miss there is sequential.
    next_sequential: u64,
    /// The block after the guest's last read, and how sequential its
    /// reads have been lately (up one for a read that starts there, down
    /// one for any other, 0 to [`SEQUENTIAL_MAX`]).
    next_read: u64,
    sequential_score: u8,
}

/// Ceiling of [`BlockCache`]'s sequential score; half of it or more
/// makes a reader sequential.
const SEQUENTIAL_MAX: u8 = 16;

impl BlockCache {
    /// Caches up to `capacity_bytes` (rounded down to whole blocks; 0 for
    /// no cache) of `inner`.
    pub fn new(inner: Box<dyn Backend>, capacity_bytes: u64) -> BlockCache {
        let blocks = usize::try_from(capacity_bytes / BLOCK_SIZE as u64).ok().and_then(NonZeroUsize::new);
        BlockCache {
            inner,
            capacity_bytes: blocks.map_or(0, |b| b.get() as u64 * BLOCK_SIZE as u64),
            blocks: blocks.map(LruCache::new),
            counters: Arc::default(),
            scratch: Vec::new(),
            written: None,
            next_sequential: u64::MAX,
            next_read: u64::MAX,
            sequential_score: 0,
        }
    }

    /// Statistics, readable from other threads.
    pub fn stats_handle(&self) -> CacheStatsHandle {
        CacheStatsHandle { counters: self.counters.clone(), capacity_bytes: self.capacity_bytes }
    }

    /// The cache's capacity in bytes (0: none).
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    /// Up to `max` cached blocks (block index = byte offset / 4 KiB) in
    /// the order the guest is likely to read them next: what a warm
    /// migration sends ahead. Most recently used first, except for a guest
    /// that reads sequentially: going round a region, it comes back first
    /// to the blocks it read longest ago.
    pub fn hot_blocks(&self, max: usize) -> Vec<u64> {
        let Some(blocks) = self.blocks.as_ref() else { return Vec::new() };
        let keys = blocks.iter().map(|(&block, _)| block);
        if self.sequential_score >= SEQUENTIAL_MAX / 2 {
            keys.rev().take(max).collect()
        } else {
            keys.take(max).collect()
        }
    }

    /// Starts (or stops) recording which blocks the guest writes.
    pub fn track_writes(&mut self, on: bool) {
        self.written = on.then(HashSet::new);
    }

    /// Blocks written since tracking began or since the last call, in
    /// ascending order; tracking goes on.
    pub fn take_written(&mut self) -> Vec<u64> {
        let mut blocks: Vec<u64> = self.written.as_mut().map(|w| w.drain().collect()).unwrap_or_default();
        blocks.sort_unstable();
        blocks
    }

    /// True when block `block` is cached.
    pub fn contains(&self, block: u64) -> bool {
        self.blocks.as_ref().is_some_and(|b| b.contains(&block))
    }

    /// True when no block can be added without evicting another.
    pub fn is_full(&self) -> bool {
        self.blocks.as_ref().is_none_or(|b| b.len() == b.cap().get())
    }

    /// Block `block`'s cached bytes, without making it more recent.
    pub fn peek(&self, block: u64) -> Option<&[u8]> {
        self.blocks.as_ref()?.peek(&block).map(|b| &b[..])
    }

    /// Puts a block whose contents came from elsewhere (a warm migration's
    /// stream) behind every cached block, unless it is cached already or
    /// the cache is full. True when it was added.
    pub fn warm_with(&mut self, block: u64, data: &[u8]) -> bool {
        let size_blocks = self.size() / BLOCK_SIZE as u64;
        let Some(blocks) = self.blocks.as_mut() else { return false };
        if data.len() != BLOCK_SIZE
            || block >= size_blocks
            || blocks.len() == blocks.cap().get()
            || blocks.contains(&block)
        {
            return false;
        }
        blocks.put(block, data.to_vec().into_boxed_slice());
        blocks.demote(&block);
        self.counters.warmed_blocks.fetch_add(1, Ordering::Relaxed);
        self.counters.cached_blocks.store(blocks.len() as u64, Ordering::Relaxed);
        true
    }

    /// Drops block `block` from the cache (its storage copy is newer).
    pub fn invalidate(&mut self, block: u64) {
        if let Some(blocks) = self.blocks.as_mut() {
            if blocks.pop(&block).is_some() {
                self.counters.invalidated_blocks.fetch_add(1, Ordering::Relaxed);
                self.counters.cached_blocks.store(blocks.len() as u64, Ordering::Relaxed);
            }
        }
    }

    fn insert(blocks: &mut LruCache<u64, Box<[u8]>>, block: u64, data: &[u8]) {
        if let Some(cached) = blocks.get_mut(&block) {
            cached.copy_from_slice(data);
            return;
        }
        // Reuse the evicted block's buffer.
        let mut buffer = match blocks.len() == blocks.cap().get() {
            true => blocks.pop_lru().map(|(_, b)| b).expect("a full cache has an LRU block"),
            false => vec![0; BLOCK_SIZE].into_boxed_slice(),
        };
        buffer.copy_from_slice(data);
        blocks.put(block, buffer);
    }
}

/// The part of block `block` that `[offset, offset + len)` covers: (start
/// within the block, start within the request, length).
fn overlap(block: u64, offset: u64, len: usize) -> (usize, usize, usize) {
    let block_start = block * BLOCK_SIZE as u64;
    let from = offset.max(block_start);
    let to = (offset + len as u64).min(block_start + BLOCK_SIZE as u64);
    ((from - block_start) as usize, (from - offset) as usize, (to - from) as usize)
}

impl Backend for BlockCache {
    fn size(&self) -> u64 {
        self.inner.size()
    }

    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), BlockError> {
        check_range(offset, buf.len(), self.size())?;
        let Some(blocks) = self.blocks.as_mut() else {
            self.inner.read_at(offset, buf)?;
            self.counters.bytes_from_storage.fetch_add(buf.len() as u64, Ordering::Relaxed);
            return Ok(());
        };
        if buf.is_empty() {
            return Ok(());
        }
        let bs = BLOCK_SIZE as u64;
        let (first, last) = (offset / bs, (offset + buf.len() as u64 - 1) / bs);
        self.sequential_score = if first == self.next_read {
            (self.sequential_score + 1).min(SEQUENTIAL_MAX)
        } else {
            self.sequential_score.saturating_sub(1)
        };
        self.next_read = last + 1;
        let mut block = first;
        while block <= last {
            if let Some(data) = blocks.get(&block) {
                let (within, at, len) = overlap(block, offset, buf.len());
                buf[at..at + len].copy_from_slice(&data[within..within + len]);
                self.counters.hits.fetch_add(1, Ordering::Relaxed);
                block += 1;
                continue;
            }
            // A run of missing blocks: one storage read of whole blocks,
            // and of the blocks after them when the reader is sequential.
            let mut end = block + 1;
            while end <= last && end - block < MAX_MISS_RUN && !blocks.contains(&end) {
                end += 1;
            }
            let mut read_end = end;
            if block == self.next_sequential && end > last {
                let limit =
                    (end + READAHEAD_BLOCKS).min(self.inner.size() / bs).min(end + blocks.cap().get() as u64 / 4);
                while read_end < limit && !blocks.contains(&read_end) {
                    read_end += 1;
                }
            }
            self.next_sequential = read_end;
            let run = ((read_end - block) * bs) as usize;
            self.scratch.resize(run, 0);
            self.inner.read_at(block * bs, &mut self.scratch)?;
            self.counters.misses.fetch_add(end - block, Ordering::Relaxed);
            self.counters.readahead_blocks.fetch_add(read_end - end, Ordering::Relaxed);
            self.counters.bytes_from_storage.fetch_add(run as u64, Ordering::Relaxed);
            for (i, data) in self.scratch.chunks_exact(BLOCK_SIZE).enumerate() {
                let b = block + i as u64;
                if b < end {
                    let (within, at, len) = overlap(b, offset, buf.len());
                    buf[at..at + len].copy_from_slice(&data[within..within + len]);
                }
                Self::insert(blocks, b, data);
            }
            block = end;
        }
        self.counters.cached_blocks.store(blocks.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn write_at(&mut self, offset: u64, data: &[u8]) -> Result<(), BlockError> {
        self.inner.write_at(offset, data)?;
        self.counters.bytes_written.fetch_add(data.len() as u64, Ordering::Relaxed);
        if data.is_empty() {
            return Ok(());
        }
        let bs = BLOCK_SIZE as u64;
        if let Some(written) = self.written.as_mut() {
            written.extend(offset / bs..=(offset + data.len() as u64 - 1) / bs);
        }
        let Some(blocks) = self.blocks.as_mut() else { return Ok(()) };
        for block in offset / bs..=(offset + data.len() as u64 - 1) / bs {
            let (within, at, len) = overlap(block, offset, data.len());
            if len == BLOCK_SIZE {
                Self::insert(blocks, block, &data[at..at + len]);
            } else if let Some(cached) = blocks.get_mut(&block) {
                cached[within..within + len].copy_from_slice(&data[at..at + len]);
            }
        }
        self.counters.cached_blocks.store(blocks.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn flush(&mut self) -> Result<(), BlockError> {
        self.inner.flush()?;
        self.counters.flushes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Storage in memory that counts its reads.
    struct MemDisk {
        bytes: Vec<u8>,
        reads: Arc<AtomicU64>,
    }

    impl Backend for MemDisk {
        fn size(&self) -> u64 {
            self.bytes.len() as u64
        }
        fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), BlockError> {
            check_range(offset, buf.len(), self.size())?;
            self.reads.fetch_add(1, Ordering::Relaxed);
            buf.copy_from_slice(&self.bytes[offset as usize..offset as usize + buf.len()]);
            Ok(())
        }
        fn write_at(&mut self, offset: u64, data: &[u8]) -> Result<(), BlockError> {
            check_range(offset, data.len(), self.size())?;
            self.bytes[offset as usize..offset as usize + data.len()].copy_from_slice(data);
            Ok(())
        }
        fn flush(&mut self) -> Result<(), BlockError> {
            Ok(())
        }
    }

    fn disk(blocks: usize) -> (Box<dyn Backend>, Arc<AtomicU64>) {
        let reads = Arc::new(AtomicU64::new(0));
        let bytes = (0..blocks * BLOCK_SIZE).map(|i| (i / 512) as u8 ^ (i as u8)).collect();
        (Box::new(MemDisk { bytes, reads: reads.clone() }), reads)
    }

    #[test]
    fn hits_misses_and_lru_eviction() {
        let (inner, reads) = disk(16);
        let mut cache = BlockCache::new(inner, 2 * BLOCK_SIZE as u64);
        let mut buf = vec![0; BLOCK_SIZE];
        cache.read_at(0, &mut buf).unwrap();
        cache.read_at(0, &mut buf).unwrap();
        cache.read_at(4096, &mut buf).unwrap();
        let s = cache.stats_handle().get();
        assert_eq!((s.hits, s.misses, s.bytes_from_storage, s.cached_bytes), (1, 2, 8192, 8192));
        // Block 0 was used before block 1: block 2 evicts block 0.
        cache.read_at(0, &mut buf).unwrap(); // hit, 0 is now most recent
        cache.read_at(8192, &mut buf).unwrap(); // evicts 1
        assert_eq!(cache.hot_blocks(10), vec![2, 0]);
        let before = reads.load(Ordering::Relaxed);
        cache.read_at(0, &mut buf).unwrap();
        assert_eq!(reads.load(Ordering::Relaxed), before, "block 0 stayed cached");
        cache.read_at(4096, &mut buf).unwrap();
        assert_eq!(reads.load(Ordering::Relaxed), before + 1, "block 1 was evicted");
    }

    #[test]
    fn a_run_of_misses_is_one_storage_read() {
        let (inner, reads) = disk(16);
        let mut cache = BlockCache::new(inner, 64 * BLOCK_SIZE as u64);
        let mut buf = vec![0; 3 * 512];
        cache.read_at(4096, &mut [0; 512]).unwrap();
        // Blocks 0..=2 around a cached block 1: two runs of one block.
        cache.read_at(4096 - 512, &mut vec![0; 4096 + 1024]).unwrap();
        assert_eq!(reads.load(Ordering::Relaxed), 3);
        cache.read_at(5 * 4096 - 512, &mut buf).unwrap();
        assert_eq!(reads.load(Ordering::Relaxed), 4, "blocks 4 and 5 in one read");
    }

    #[test]
    fn no_capacity_passes_through_and_counts() {
        let (inner, reads) = disk(4);
        let mut cache = BlockCache::new(inner, 100);
        assert_eq!(cache.capacity_bytes(), 0);
        let mut buf = vec![0; 1024];
        cache.read_at(512, &mut buf).unwrap();
        cache.read_at(512, &mut buf).unwrap();
        cache.write_at(0, &buf).unwrap();
        assert_eq!(reads.load(Ordering::Relaxed), 2);
        let s = cache.stats_handle().get();
        assert_eq!((s.hits, s.bytes_from_storage, s.bytes_written), (0, 2048, 1024));
    }

    #[test]
    fn a_sequential_reader_gets_readahead() {
        let (inner, reads) = disk(256);
        let mut cache = BlockCache::new(inner, 400 * BLOCK_SIZE as u64);
        let mut buf = vec![0; 4 * BLOCK_SIZE];
        cache.read_at(0, &mut buf).unwrap(); // first read: no history
        cache.read_at(4 * 4096, &mut buf).unwrap(); // sequential: reads ahead
        assert_eq!(reads.load(Ordering::Relaxed), 2);
        assert_eq!(cache.stats_handle().get().readahead_blocks, READAHEAD_BLOCKS);
        for i in 2..(8 + READAHEAD_BLOCKS / 4) {
            cache.read_at(i * 4 * 4096, &mut buf).unwrap();
        }
        assert_eq!(reads.load(Ordering::Relaxed), 3, "hits until the readahead ran out, then one more");
        assert_eq!(
            buf,
            (((7 + READAHEAD_BLOCKS / 4) * 4 * BLOCK_SIZE as u64) as usize..)
                .take(4 * BLOCK_SIZE)
                .map(|i| (i / 512) as u8 ^ (i as u8))
                .collect::<Vec<_>>()
        );
        cache.read_at(100 * 4096, &mut buf[..4096]).unwrap(); // random: no readahead
        assert_eq!(cache.stats_handle().get().readahead_blocks, 2 * READAHEAD_BLOCKS);
    }

    #[test]
    fn a_sequential_reader_s_oldest_blocks_lead_the_hot_list() {
        let (inner, _) = disk(64);
        let mut cache = BlockCache::new(inner, 64 * BLOCK_SIZE as u64);
        let mut buf = vec![0; 4 * BLOCK_SIZE];
        // Round a 32-block region, then half of it again: the reader comes
        // back to blocks 16.. next, those it read longest ago.
        for i in (0..8).chain(0..4) {
            cache.read_at(i * 4 * 4096, &mut buf).unwrap();
        }
        let hot = cache.hot_blocks(8);
        assert_eq!(hot, (16..24).collect::<Vec<_>>());
        // A random reader's most recent blocks lead.
        for b in [40u64, 3, 50, 9, 45, 1, 60, 20, 33] {
            cache.read_at(b * 4096, &mut buf[..4096]).unwrap();
        }
        assert_eq!(cache.hot_blocks(3), vec![33, 20, 60]);
    }

    #[test]
    fn warmed_blocks_go_behind_the_hot_ones_and_never_evict() {
        let (inner, reads) = disk(16);
        let mut cache = BlockCache::new(inner, 4 * BLOCK_SIZE as u64);
        let mut buf = vec![0; BLOCK_SIZE];
        cache.read_at(5 * 4096, &mut buf).unwrap();
        let block =
            |b: usize| (b * BLOCK_SIZE..(b + 1) * BLOCK_SIZE).map(|i| (i / 512) as u8 ^ (i as u8)).collect::<Vec<_>>();
        assert!(!cache.warm_with(5, &block(5)), "cached already");
        assert!(cache.warm_with(4, &block(4)) && cache.warm_with(6, &block(6)));
        assert_eq!(cache.hot_blocks(10), vec![5, 4, 6], "warmed blocks go behind");
        assert!(cache.warm_with(8, &block(8)));
        assert!(cache.is_full());
        assert!(!cache.warm_with(9, &block(9)), "full: nothing is evicted");
        assert!(!cache.warm_with(99, &block(9)), "past the end");
        assert!(!cache.warm_with(10, &[0; 100]), "not a block");
        let before = reads.load(Ordering::Relaxed);
        cache.read_at(4 * 4096, &mut buf).unwrap();
        cache.read_at(8 * 4096, &mut buf).unwrap();
        assert_eq!(reads.load(Ordering::Relaxed), before, "warmed blocks are hits");
        assert_eq!(buf, block(8));
        assert_eq!(cache.peek(8), Some(&block(8)[..]));
        let s = cache.stats_handle().get();
        assert_eq!((s.warmed_blocks, s.hits), (3, 2));
        cache.invalidate(4);
        cache.invalidate(4);
        assert!(!cache.contains(4));
        assert_eq!(cache.stats_handle().get().invalidated_blocks, 1);
    }

    #[test]
    fn written_blocks_are_tracked_while_asked() {
        let (inner, _) = disk(16);
        let mut cache = BlockCache::new(inner, 0);
        cache.write_at(0, &[1; 512]).unwrap();
        assert!(cache.take_written().is_empty(), "not tracking yet");
        cache.track_writes(true);
        cache.write_at(4096 * 3 - 512, &[1; 1024]).unwrap();
        cache.write_at(4096 * 9, &[1; 512]).unwrap();
        assert_eq!(cache.take_written(), vec![2, 3, 9]);
        assert!(cache.take_written().is_empty());
        cache.track_writes(false);
        cache.write_at(0, &[1; 512]).unwrap();
        assert!(cache.take_written().is_empty());
    }

    proptest! {
        /// Whatever the mix of reads and writes, the cache returns what a
        /// plain disk would, and the disk holds every write (write-through).
        #[test]
        fn cache_agrees_with_storage(ops in proptest::collection::vec((any::<bool>(), 0u64..60, 1usize..20, any::<u8>()), 1..80),
                                     capacity in 0u64..6) {
            let (inner, _) = disk(8);
            let (mut model, _) = disk(8);
            let mut cache = BlockCache::new(inner, capacity * BLOCK_SIZE as u64);
            for (write, sector, sectors, fill) in ops {
                let (offset, len) = (sector * 512, (sectors * 512).min(8 * BLOCK_SIZE - sector as usize * 512));
                if write {
                    let data = vec![fill; len];
                    cache.write_at(offset, &data).unwrap();
                    model.write_at(offset, &data).unwrap();
                } else {
                    let (mut got, mut want) = (vec![0; len], vec![0; len]);
                    cache.read_at(offset, &mut got).unwrap();
                    model.read_at(offset, &mut want).unwrap();
                    prop_assert_eq!(got, want);
                }
            }
            let (mut got, mut want) = (vec![0; 8 * BLOCK_SIZE], vec![0; 8 * BLOCK_SIZE]);
            cache.inner.read_at(0, &mut got).unwrap();
            model.read_at(0, &mut want).unwrap();
            prop_assert_eq!(got, want);
        }
    }
}
