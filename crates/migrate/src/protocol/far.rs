//! Far memory's frames: a VM whose pages partly live on memory hosts moves
//! only its resident pages. Right after ACCEPT, before any page, the source
//! names the exports and the local limit (FAR_MEMORY) and which pages live
//! far, with each far copy's hash (FAR_PAGES, a bitmap run at a time).

use tsubame_vmm::DirtyBitmap;

use super::fields::{put_string, Fields};
use super::kind::{FrameKind, WireError};

/// Most exports (two mirror each other).
pub const MAX_STORES: usize = 2;
/// Longest export name (an NBD URI).
pub const MAX_STORE_NAME: usize = 4096;
/// Pages one FAR_PAGES frame covers: a 64 KiB bitmap and at most 8 MiB of
/// hashes.
pub const PAGES_PER_FRAME: u64 = 1 << 19;

/// FAR_MEMORY: where the VM's far pages live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FarMemory {
    /// The limit on resident memory, in bytes.
    pub local_bytes: u64,
    /// Pages whose only copy is far: the FAR_PAGES frames that follow name
    /// this many.
    pub far_pages: u64,
    /// The exports, as `--far-memory` named them.
    pub stores: Vec<String>,
}

impl FarMemory {
    /// Serializes: `local u64, far_pages u64, count u8, string[count]`.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(32 + self.stores.iter().map(|s| s.len() + 2).sum::<usize>());
        out.extend_from_slice(&self.local_bytes.to_le_bytes());
        out.extend_from_slice(&self.far_pages.to_le_bytes());
        out.push(self.stores.len() as u8);
        for store in &self.stores {
            put_string(&mut out, store, MAX_STORE_NAME);
        }
        out
    }

    /// Parses and checks a payload for a VM of `memory_bytes`.
    pub fn decode(payload: &[u8], memory_bytes: u64) -> Result<FarMemory, WireError> {
        let mut f = Fields::new(FrameKind::FarMemory, payload);
        let local_bytes = f.u64()?;
        let far_pages = f.u64()?;
        let count = f.u8()? as usize;
        if local_bytes == 0 || local_bytes >= memory_bytes {
            return Err(WireError::bad("far_memory.local", format!("{local_bytes} bytes of a {memory_bytes}-byte VM")));
        }
        if far_pages > memory_bytes / 4096 {
            return Err(WireError::bad("far_memory.far_pages", format!("{far_pages} pages")));
        }
        if count == 0 || count > MAX_STORES {
            return Err(WireError::bad("far_memory.stores", format!("{count} (1 to {MAX_STORES})")));
        }
        let stores = (0..count).map(|_| f.string("far_memory.store", MAX_STORE_NAME)).collect::<Result<_, _>>()?;
        f.finish()?;
        Ok(FarMemory { local_bytes, far_pages, stores })
    }
}

/// FAR_PAGES: a run of the far-page bitmap and the hash of each far copy
/// it names, in page order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FarPages {
    /// First page the run covers (a multiple of 64).
    pub first_page: u64,
    /// The bitmap's words from there.
    pub words: Vec<u64>,
    /// One hash per set bit, in order.
    pub hashes: Vec<u128>,
}

impl FarPages {
    /// The frames for `far` with per-page `hashes`, `PAGES_PER_FRAME` pages each.
    pub fn split<'a>(far: &'a DirtyBitmap, hashes: &'a [u128]) -> impl Iterator<Item = FarPages> + 'a {
        let runs = far.chunks((PAGES_PER_FRAME / 64) as usize).filter(|(_, words)| words.iter().any(|&w| w != 0));
        runs.map(|(first_page, words)| FarPages {
            first_page,
            words: words.to_vec(),
            hashes: (0..words.len() as u64 * 64)
                .filter(|&i| words[(i / 64) as usize] >> (i % 64) & 1 == 1)
                .map(|i| hashes[(first_page + i) as usize])
                .collect(),
        })
    }

    /// Serializes: `first u64, words u32, word u64[words], hash u128[set bits]`.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(12 + self.words.len() * 8 + self.hashes.len() * 16);
        out.extend_from_slice(&self.first_page.to_le_bytes());
        out.extend_from_slice(&(self.words.len() as u32).to_le_bytes());
        self.words.iter().for_each(|w| out.extend_from_slice(&w.to_le_bytes()));
        self.hashes.iter().for_each(|h| out.extend_from_slice(&h.to_le_bytes()));
        out
    }

    /// Parses and checks a payload for a VM of `pages` pages.
    pub fn decode(payload: &[u8], pages: u64) -> Result<FarPages, WireError> {
        let mut f = Fields::new(FrameKind::FarPages, payload);
        let first_page = f.u64()?;
        let count = f.u32()? as u64;
        if first_page % 64 != 0 || first_page >= pages {
            return Err(WireError::bad("far_pages.first", format!("page {first_page} of {pages}")));
        }
        if count == 0 || count > PAGES_PER_FRAME / 64 || first_page + count * 64 > pages.div_ceil(64) * 64 {
            return Err(WireError::bad("far_pages.words", format!("{count} words from page {first_page}")));
        }
        let words: Vec<u64> = (0..count).map(|_| f.u64()).collect::<Result<_, _>>()?;
        // Bits past the last page are never set.
        if let Some(past) = (first_page + count * 64).checked_sub(pages).filter(|&p| p > 0) {
            if words[count as usize - 1] >> (64 - past) != 0 {
                return Err(WireError::bad("far_pages.words", "a page past guest memory"));
            }
        }
        let set: u64 = words.iter().map(|w| w.count_ones() as u64).sum();
        let hashes = (0..set)
            .map(|_| f.take(16).map(|b| u128::from_le_bytes(b.try_into().expect("16 bytes"))))
            .collect::<Result<_, _>>()?;
        f.finish()?;
        Ok(FarPages { first_page, words, hashes })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn far_memory_round_trips_and_checks_its_fields() {
        let m = FarMemory { local_bytes: 1 << 30, far_pages: 1000, stores: vec!["nbd://a/x".into(), "nbd://b".into()] };
        assert_eq!(FarMemory::decode(&m.encode(), 4 << 30).unwrap(), m);
        assert!(FarMemory::decode(&m.encode(), 1 << 30).is_err(), "local not below memory");
        let none = FarMemory { stores: vec![], ..m.clone() };
        assert!(FarMemory::decode(&none.encode(), 4 << 30).is_err());
        let many = FarMemory { far_pages: 1 << 30, ..m.clone() };
        assert!(FarMemory::decode(&many.encode(), 4 << 30).is_err());
        assert!(FarMemory::decode(&m.encode()[..20], 4 << 30).is_err());
    }

    #[test]
    fn far_pages_split_and_round_trip() {
        let pages = PAGES_PER_FRAME + 100;
        let mut far = DirtyBitmap::new(pages);
        let hashes: Vec<u128> = (0..pages as u128).map(|i| i * 7919).collect();
        for p in [0, 63, 64, 5000, PAGES_PER_FRAME, pages - 1] {
            far.set(p);
        }
        let frames: Vec<FarPages> = FarPages::split(&far, &hashes).collect();
        assert_eq!(frames.len(), 2);
        assert_eq!(frames[1].hashes, vec![hashes[PAGES_PER_FRAME as usize], hashes[pages as usize - 1]]);
        for frame in &frames {
            assert_eq!(&FarPages::decode(&frame.encode(), pages).unwrap(), frame);
        }
        // A page past memory, a missing hash, a misaligned start.
        let mut past = frames[1].clone();
        *past.words.last_mut().unwrap() |= 1 << 63;
        past.hashes.push(0);
        assert!(FarPages::decode(&past.encode(), pages).is_err());
        let mut short = frames[0].clone();
        short.hashes.pop();
        assert!(FarPages::decode(&short.encode(), pages).is_err());
        let odd = FarPages { first_page: 3, ..frames[0].clone() };
        assert!(FarPages::decode(&odd.encode(), pages).is_err());
    }
}
