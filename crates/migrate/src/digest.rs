//! Per-region hashes of guest memory: the source sends them at
//! stop-and-copy, the destination compares before it says READY.

use tsubame_vmm::{memory, GuestMemory};
use xxhash_rust::xxh3::xxh3_64;

/// Default region size: 1 MiB (16 KiB of hashes per GiB).
pub const DEFAULT_REGION: u32 = 1 << 20;

/// xxh3 of each `region`-byte slice of guest memory, in order. Runs on
/// `threads` threads; the VM must not be running. Regions the kernel never
/// populated are zeros: their hash is computed once, not read.
pub fn memory_digest(mem: &GuestMemory, region: u32, threads: usize) -> Vec<u64> {
    let size = memory::size(mem);
    let pagemap = memory::Pagemap::open().ok();
    let zero_hash = xxh3_64(&vec![0u8; region as usize]);
    let pagemap = &pagemap;
    let count = size.div_ceil(region as u64) as usize;
    let mut hashes = vec![0u64; count];
    let threads = threads.clamp(1, count.max(1));
    let per_thread = count.div_ceil(threads);
    std::thread::scope(|scope| {
        for (t, chunk) in hashes.chunks_mut(per_thread).enumerate() {
            scope.spawn(move || {
                let mut buf = vec![0u8; region as usize];
                for (i, slot) in chunk.iter_mut().enumerate() {
                    let start = ((t * per_thread + i) as u64) * region as u64;
                    let len = (size - start).min(region as u64) as usize;
                    let unpopulated =
                        pagemap.as_ref().is_some_and(|p| p.unpopulated(mem, start, len as u64).unwrap_or(false));
                    *slot = if unpopulated && len == region as usize {
                        zero_hash
                    } else {
                        memory::read(mem, start, &mut buf[..len]).expect("region inside guest memory");
                        xxh3_64(&buf[..len])
                    };
                }
            });
        }
    });
    hashes
}

/// Encodes a DIGEST payload: region size, count, hashes.
pub fn encode(region: u32, hashes: &[u64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + hashes.len() * 8);
    out.extend_from_slice(&region.to_le_bytes());
    out.extend_from_slice(&(hashes.len() as u32).to_le_bytes());
    for h in hashes {
        out.extend_from_slice(&h.to_le_bytes());
    }
    out
}

/// Indices of regions whose hashes differ; the payload must describe
/// `expected_region` and exactly the regions of `ours`.
pub fn compare(payload: &[u8], expected_region: u32, ours: &[u64]) -> Result<Vec<usize>, crate::wire::WireError> {
    use crate::wire::{Fields, FrameKind, WireError};
    let mut f = Fields::new(FrameKind::Digest, payload);
    let region = f.u32()?;
    let count = f.u32()? as usize;
    if region != expected_region {
        return Err(WireError::BadField {
            field: "digest.region",
            detail: format!("{region}, HELLO said {expected_region}"),
        });
    }
    if count != ours.len() {
        return Err(WireError::BadField {
            field: "digest.count",
            detail: format!("{count}, memory has {}", ours.len()),
        });
    }
    let mut mismatched = Vec::new();
    for (i, &h) in ours.iter().enumerate() {
        if f.u64()? != h {
            mismatched.push(i);
        }
    }
    f.finish()?;
    Ok(mismatched)
}

/// Most regions a MISMATCH frame may list.
pub const MAX_MISMATCH: usize = 1 << 20;

/// Encodes a MISMATCH payload: count u32, region indices u32.
pub fn encode_mismatch(regions: &[usize]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + regions.len() * 4);
    out.extend_from_slice(&(regions.len() as u32).to_le_bytes());
    for &r in regions {
        out.extend_from_slice(&(r as u32).to_le_bytes());
    }
    out
}

/// Decodes a MISMATCH payload; every index must be below `regions`.
pub fn decode_mismatch(payload: &[u8], regions: usize) -> Result<Vec<u32>, crate::wire::WireError> {
    use crate::wire::{Fields, FrameKind, WireError};
    let mut f = Fields::new(FrameKind::Mismatch, payload);
    let count = f.u32()? as usize;
    if count == 0 || count > MAX_MISMATCH.min(regions) {
        return Err(WireError::BadField { field: "mismatch.count", detail: format!("{count} of {regions} regions") });
    }
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let r = f.u32()?;
        if r as usize >= regions {
            return Err(WireError::BadField { field: "mismatch.region", detail: format!("{r} of {regions}") });
        }
        out.push(r);
    }
    f.finish()?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_finds_the_changed_region() {
        let mem = memory::create(16 << 20, false).unwrap();
        let before = memory_digest(&mem, 1 << 20, 2);
        assert_eq!(before.len(), 16);
        memory::write(&mem, 5 * (1 << 20) + 123, &[1]).unwrap();
        let after = memory_digest(&mem, 1 << 20, 2);
        assert_eq!(compare(&encode(1 << 20, &before), 1 << 20, &after).unwrap(), vec![5]);
        assert!(compare(&encode(1 << 20, &before[..3]), 1 << 20, &after).is_err());
        assert!(compare(&encode(1 << 19, &before), 1 << 20, &after).is_err());
    }

    #[test]
    fn mismatch_lists_are_bounded() {
        assert_eq!(decode_mismatch(&encode_mismatch(&[1, 5]), 16).unwrap(), vec![1, 5]);
        assert!(decode_mismatch(&encode_mismatch(&[16]), 16).is_err());
        assert!(decode_mismatch(&encode_mismatch(&[]), 16).is_err());
        assert!(decode_mismatch(&encode_mismatch(&[1, 2, 3]), 2).is_err());
    }
}
