//! Sub-page dirty tracking (the SPP paper, in software): for each dirty
//! page, find which `granularity`-byte sub-pages differ from what the
//! destination holds and send only those.
//!
//! Two ways to know what the destination holds:
//! - `shadow`: a copy of every byte sent (exact; as much memory as the VM,
//!   though pages never sent stay unbacked);
//! - `hash`: a 64-bit xxh3 per sub-page (1/16 of guest memory at 128 B).
//!   A collision would hide a change, so the end-of-migration digest
//!   comparison finds and re-sends any region that differs.
//!
//! Both start from "the destination holds zeros", which is true of fresh
//! destination memory: the hash table stores `hash ^ ZERO_HASH`, so its
//! zero-filled (lazily allocated) start state means "zero sub-page".

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

use tsubame_codec::zero::is_zero;
use tsubame_codec::PAGE_SIZE;

/// How the tracker knows the destination's contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detector {
    /// A copy of what was sent.
    Shadow,
    /// A 64-bit hash per sub-page.
    Hash,
}

impl std::str::FromStr for Detector {
    type Err = String;
    fn from_str(s: &str) -> Result<Detector, String> {
        match s {
            "shadow" => Ok(Detector::Shadow),
            "hash" => Ok(Detector::Hash),
            other => Err(format!("unknown sub-page detector '{other}' (use shadow or hash)")),
        }
    }
}

pub use crate::protocol::check_granularity;

/// What a dirty page turned out to need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Same bytes as the destination holds: send nothing.
    Unchanged,
    /// All zeros now (e.g. cleared with `rep stosq`): a zero record.
    Zero,
    /// Every sub-page changed: the whole page.
    Full,
    /// Only the sub-pages in the mask (bit i = bytes i*g .. (i+1)*g).
    Partial(u64),
}

/// Counters for the `subpage` field of the statistics.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SubpageStats {
    /// Bytes per sub-page.
    pub granularity: u32,
    /// shadow or hash.
    pub detector: String,
    /// Memory the detector reserves (its full size).
    pub memory_bytes: u64,
    /// Of that, what it ever wrote to, in 4 KiB pages: the rest is never
    /// backed by RAM (the tables start as lazily zeroed allocations).
    pub memory_resident_bytes: u64,
    /// Sub-pages sent in partial records.
    pub subpages_sent: u64,
    /// Dirty pages whose every sub-page changed (sent whole).
    pub pages_full: u64,
    /// Dirty pages that turned out identical to the destination's.
    pub pages_unchanged: u64,
    /// Dirty pages now all zeros (sent as zero records).
    pub pages_zeroed: u64,
    /// Digest regions re-sent by the verification pass.
    pub regions_repaired: u64,
    /// Dirty pages sent again (the destination held them non-zero) and
    /// not zero now: what sub-pages can save on.
    pub resent_pages: u64,
    /// Bytes their records took: nothing when unchanged, the mask and the
    /// changed sub-pages, or the whole page.
    pub resent_bytes: u64,
    /// `--granularity auto`: the iteration from which whole pages went out
    /// because sub-pages stopped paying.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub whole_pages_from: Option<u32>,
}

impl SubpageStats {
    /// The same setup with every counter at zero.
    pub fn emptied(&self) -> SubpageStats {
        SubpageStats { granularity: self.granularity, detector: self.detector.clone(), ..Default::default() }
    }

    /// Adds another tracker's counters (one per codec shard).
    pub fn add(&mut self, other: &SubpageStats) {
        self.memory_bytes += other.memory_bytes;
        self.memory_resident_bytes += other.memory_resident_bytes;
        self.subpages_sent += other.subpages_sent;
        self.pages_full += other.pages_full;
        self.pages_unchanged += other.pages_unchanged;
        self.pages_zeroed += other.pages_zeroed;
        self.regions_repaired += other.regions_repaired;
        self.resent_pages += other.resent_pages;
        self.resent_bytes += other.resent_bytes;
        self.whole_pages_from = match (self.whole_pages_from, other.whole_pages_from) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }

    /// The share of the re-sent pages' bytes that sub-pages saved against
    /// sending them whole (None before any page went twice).
    pub fn saved_share(&self) -> Option<f64> {
        (self.resent_pages > 0).then(|| saved_share(self.resent_pages, self.resent_bytes))
    }
}

/// The share of `pages` whole pages' bytes saved by sending `bytes`.
pub fn saved_share(pages: u64, bytes: u64) -> f64 {
    1.0 - bytes as f64 / (pages * PAGE_SIZE as u64) as f64
}

/// Tracks what the destination holds, page by page.
pub struct SubpageTracker {
    granularity: usize,
    per_page: usize,
    detector: Detector,
    shadow: Vec<u8>,
    hashes: Vec<u64>,
    /// Where the table in use starts in its vector: at an OS page, see
    /// [`page_aligned_start`].
    start: usize,
    zero_hash: u64,
    /// Which bits of a hash count (all of them, unless a test forges
    /// collisions).
    hash_mask: u64,
    /// One bit per 4 KiB page of the detector's table ever written.
    written: Vec<u64>,
    /// Counters.
    pub stats: SubpageStats,
}

impl SubpageTracker {
    /// A tracker for `pages` pages of guest memory.
    pub fn new(detector: Detector, granularity: u32, pages: u64, hash_mask: u64) -> SubpageTracker {
        let granularity = granularity as usize;
        let per_page = PAGE_SIZE / granularity;
        // vec![0; n] of this size comes from calloc: lazily zeroed pages,
        // one more than the table needs, to start it at an OS page.
        let (shadow, hashes, start) = match detector {
            Detector::Shadow => {
                let shadow = vec![0u8; (pages as usize + 1) * PAGE_SIZE];
                let start = page_aligned_start(&shadow);
                (shadow, Vec::new(), start)
            }
            Detector::Hash => {
                let hashes = vec![0u64; pages as usize * per_page + PAGE_SIZE / 8];
                let start = page_aligned_start(&hashes);
                (Vec::new(), hashes, start)
            }
        };
        let memory_bytes = match detector {
            Detector::Shadow => pages * PAGE_SIZE as u64,
            Detector::Hash => pages * per_page as u64 * 8,
        };
        let table_pages = memory_bytes.div_ceil(PAGE_SIZE as u64);
        SubpageTracker {
            granularity,
            per_page,
            detector,
            shadow,
            hashes,
            start,
            zero_hash: xxh3_64(&vec![0u8; granularity]) & hash_mask,
            hash_mask,
            written: vec![0u64; table_pages.div_ceil(64) as usize],
            stats: SubpageStats {
                granularity: granularity as u32,
                detector: match detector {
                    Detector::Shadow => "shadow".into(),
                    Detector::Hash => "hash".into(),
                },
                memory_bytes,
                ..Default::default()
            },
        }
    }

    /// Bytes per sub-page.
    pub fn granularity(&self) -> usize {
        self.granularity
    }

    /// Compares `page` (now in guest memory) with what the destination
    /// holds, records it as sent, and says what to send.
    pub fn diff(&mut self, index: u64, page: &[u8; PAGE_SIZE]) -> Change {
        let g = self.granularity;
        let mut mask = 0u64;
        // A table page never written holds zeros and is not even read: a
        // read maps the kernel's shared zero page, and the first write then
        // shoots that mapping down on every CPU of the process, the vCPU's
        // too (a 4 GiB VM's first iteration took 150-250 ms longer).
        let fresh = !self.is_written(index);
        let resent;
        match self.detector {
            Detector::Shadow => {
                let held = self.held_bytes(index);
                resent = !fresh && !is_zero((&*held).try_into().expect("a page"));
                let was_zero = [0u8; PAGE_SIZE];
                let was: &[u8] = if fresh { &was_zero } else { held };
                for (i, (now, was)) in page.chunks_exact(g).zip(was.chunks_exact(g)).enumerate() {
                    if now != was {
                        mask |= 1 << i;
                    }
                }
                if mask != 0 {
                    held.copy_from_slice(page);
                    self.mark_written(index);
                }
            }
            Detector::Hash => {
                let mut now = [0u64; PAGE_SIZE / 64];
                let now = &mut now[..self.per_page];
                for (h, bytes) in now.iter_mut().zip(page.chunks_exact(g)) {
                    *h = (xxh3_64(bytes) & self.hash_mask) ^ self.zero_hash;
                }
                let held = self.held_hashes(index);
                resent = !fresh && held.iter().any(|&h| h != 0);
                for (i, &h) in now.iter().enumerate() {
                    if h != if fresh { 0 } else { held[i] } {
                        mask |= 1 << i;
                    }
                }
                if mask != 0 {
                    held.copy_from_slice(now);
                    self.mark_written(index);
                }
            }
        }
        let all = if self.per_page == 64 { u64::MAX } else { (1u64 << self.per_page) - 1 };
        let change = if mask == 0 {
            Change::Unchanged
        } else if is_zero(page) {
            Change::Zero
        } else if mask == all {
            Change::Full
        } else {
            Change::Partial(mask)
        };
        let bytes = match change {
            Change::Unchanged => {
                self.stats.pages_unchanged += 1;
                0
            }
            Change::Zero => {
                self.stats.pages_zeroed += 1;
                return change;
            }
            Change::Full => {
                self.stats.pages_full += 1;
                PAGE_SIZE
            }
            Change::Partial(m) => {
                self.stats.subpages_sent += m.count_ones() as u64;
                8 + m.count_ones() as usize * g
            }
        };
        if resent {
            self.stats.resent_pages += 1;
            self.stats.resent_bytes += bytes as u64;
        }
        change
    }

    /// Like [`SubpageTracker::diff`] for a page known to read as zeros
    /// (never populated), without hashing or comparing its bytes.
    pub fn diff_zero(&mut self, index: u64) -> Change {
        let held_zero = !self.is_written(index)
            || match self.detector {
                Detector::Shadow => is_zero((&*self.held_bytes(index)).try_into().expect("a page")),
                Detector::Hash => self.held_hashes(index).iter().all(|&h| h == 0),
            };
        if held_zero {
            self.stats.pages_unchanged += 1;
            Change::Unchanged
        } else {
            self.set(index, &[0u8; PAGE_SIZE]);
            self.stats.pages_zeroed += 1;
            Change::Zero
        }
    }

    /// The shadow's copy of guest page `index`.
    fn held_bytes(&mut self, index: u64) -> &mut [u8] {
        &mut self.shadow[self.start + index as usize * PAGE_SIZE..][..PAGE_SIZE]
    }

    /// The hashes of guest page `index`'s sub-pages.
    fn held_hashes(&mut self, index: u64) -> &mut [u64] {
        &mut self.hashes[self.start + index as usize * self.per_page..][..self.per_page]
    }

    /// The `written` word and bit of guest page `index`'s table page.
    fn written_bit(&self, index: u64) -> (usize, u64) {
        let bytes_per_page = match self.detector {
            Detector::Shadow => PAGE_SIZE,
            Detector::Hash => self.per_page * 8,
        } as u64;
        let table_page = index * bytes_per_page / PAGE_SIZE as u64;
        ((table_page / 64) as usize, 1u64 << (table_page % 64))
    }

    /// Whether the table page holding guest page `index`'s entry was ever
    /// written (if not, it holds zeros: "the destination holds zeros").
    fn is_written(&self, index: u64) -> bool {
        let (word, bit) = self.written_bit(index);
        self.written[word] & bit != 0
    }

    /// Notes that the table entry of guest page `index` was written.
    fn mark_written(&mut self, index: u64) {
        let (word, bit) = self.written_bit(index);
        if self.written[word] & bit == 0 {
            self.written[word] |= bit;
            self.stats.memory_resident_bytes += PAGE_SIZE as u64;
        }
    }

    /// Records that the destination now holds `page` (sent whole, e.g. by
    /// the verification pass).
    pub fn set(&mut self, index: u64, page: &[u8; PAGE_SIZE]) {
        self.mark_written(index);
        match self.detector {
            Detector::Shadow => self.held_bytes(index).copy_from_slice(page),
            Detector::Hash => {
                let (g, mask, zero) = (self.granularity, self.hash_mask, self.zero_hash);
                for (now, was) in page.chunks_exact(g).zip(self.held_hashes(index)) {
                    *was = (xxh3_64(now) & mask) ^ zero;
                }
            }
        }
    }
}

/// The first index of `table` at an OS page boundary. The tracker counts
/// the table's pages as written or not, and reads an entry only on a
/// written one; an entry across two pages (a calloc'd table starts 16 bytes
/// past one) would read the next, unwritten one and map the kernel's shared
/// zero page there, whose first write then shoots down every CPU's TLB: a
/// kv migration's encoder spent half its time in those 11803 faults.
fn page_aligned_start<T>(table: &[T]) -> usize {
    let past = table.as_ptr() as usize % PAGE_SIZE;
    if past == 0 {
        0
    } else {
        (PAGE_SIZE - past) / std::mem::size_of::<T>()
    }
}

/// Appends the sub-pages in `mask` of `page` after the mask itself: the
/// data of a SUBPAGE record.
pub fn encode_partial(page: &[u8; PAGE_SIZE], granularity: usize, mask: u64, out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(&mask.to_le_bytes());
    let mut bits = mask;
    while bits != 0 {
        let i = bits.trailing_zeros() as usize;
        bits &= bits - 1;
        out.extend_from_slice(&page[i * granularity..(i + 1) * granularity]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page_with(bytes: &[(usize, u8)]) -> [u8; PAGE_SIZE] {
        let mut p = [0u8; PAGE_SIZE];
        for &(i, b) in bytes {
            p[i] = b;
        }
        p
    }

    #[test]
    fn both_detectors_find_the_changed_subpages() {
        for detector in [Detector::Shadow, Detector::Hash] {
            let mut t = SubpageTracker::new(detector, 128, 4, u64::MAX);
            // Fresh destination memory is zeros: an all-zero page is unchanged.
            assert_eq!(t.diff(0, &[0u8; PAGE_SIZE]), Change::Unchanged);
            let p = page_with(&[(5, 1), (300, 2)]);
            assert_eq!(t.diff(1, &p), Change::Partial(0b101));
            assert_eq!(t.diff(1, &p), Change::Unchanged);
            let q = page_with(&[(5, 1), (300, 2), (4095, 9)]);
            assert_eq!(t.diff(1, &q), Change::Partial(1 << 31));
            assert_eq!(t.diff(1, &[0u8; PAGE_SIZE]), Change::Zero);
            assert_eq!(t.diff(2, &[7u8; PAGE_SIZE]), Change::Full);
            assert_eq!(t.stats.pages_unchanged, 2);
            // Sent again: page 1 unchanged, then one sub-page; the zero
            // page is neither's saving.
            assert_eq!((t.stats.resent_pages, t.stats.resent_bytes), (2, 8 + 128));
            // Shadow: pages 1 and 2 are two table pages; hash: they share one.
            let resident = if detector == Detector::Shadow { 8192 } else { 4096 };
            assert_eq!(t.stats.memory_resident_bytes, resident);
        }
    }

    #[test]
    fn tables_start_at_an_os_page() {
        let shadow = SubpageTracker::new(Detector::Shadow, 128, 3, u64::MAX);
        assert_eq!(shadow.shadow[shadow.start..].as_ptr() as usize % PAGE_SIZE, 0);
        assert!(shadow.shadow.len() - shadow.start >= 3 * PAGE_SIZE);
        let hash = SubpageTracker::new(Detector::Hash, 128, 3, u64::MAX);
        assert_eq!(hash.hashes[hash.start..].as_ptr() as usize % PAGE_SIZE, 0);
        assert!(hash.hashes.len() - hash.start >= 3 * 32);
        assert_eq!((shadow.stats.memory_bytes, hash.stats.memory_bytes), (3 * 4096, 3 * 32 * 8));
    }

    #[test]
    fn sixty_four_byte_granularity_uses_all_mask_bits() {
        let mut t = SubpageTracker::new(Detector::Shadow, 64, 1, u64::MAX);
        assert_eq!(t.diff(0, &[1u8; PAGE_SIZE]), Change::Full);
        let mut p = [1u8; PAGE_SIZE];
        p[4095] = 3;
        assert_eq!(t.diff(0, &p), Change::Partial(1 << 63));
    }

    #[test]
    fn a_masked_hash_misses_changes() {
        let mut t = SubpageTracker::new(Detector::Hash, 128, 1, 0);
        assert_eq!(t.diff(0, &[1u8; PAGE_SIZE]), Change::Unchanged, "with every hash 0 nothing looks changed");
    }

    #[test]
    fn partial_encoding() {
        let p = page_with(&[(0, 1), (256, 2)]);
        let mut out = Vec::new();
        encode_partial(&p, 128, 0b101, &mut out);
        assert_eq!(out.len(), 8 + 256);
        assert_eq!(out[8], 1);
        assert_eq!(out[8 + 128], 2);
        assert!(check_granularity(128).is_ok() && check_granularity(100).is_err() && check_granularity(32).is_err());
    }
}
