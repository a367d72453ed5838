//! The disk's frames: a warm migration names the blocks of the source's
//! host block cache so the destination reads them from the shared storage
//! before the VM arrives (WARM_BLOCKS), and names the blocks the guest
//! wrote since, whose early copies went stale (DISK_WRITTEN).

use super::fields::{put_string, Fields};
use super::kind::{FrameKind, WireError};

/// Most blocks one frame names (512 KiB of payload); longer lists go in
/// several frames.
pub const MAX_BLOCKS_PER_FRAME: usize = 65_536;
/// Longest storage name (a path or an NBD URI).
pub const MAX_DISK_NAME: usize = 4096;

/// WARM_BLOCKS: blocks of the source's cache, those the guest likely reads next first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WarmBlocks {
    /// The storage, as `--disk` names it.
    pub disk: String,
    /// Its size in bytes.
    pub size_bytes: u64,
    /// The source's cache capacity in bytes (the destination's will be the
    /// same).
    pub cache_bytes: u64,
    /// Block numbers (byte offset / 4 KiB), each inside the storage.
    pub blocks: Vec<u64>,
}

impl WarmBlocks {
    /// Serializes: `disk string, size u64, cache u64, count u32, block u64[count]`.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(32 + self.disk.len() + self.blocks.len() * 8);
        put_string(&mut out, &self.disk, MAX_DISK_NAME);
        out.extend_from_slice(&self.size_bytes.to_le_bytes());
        out.extend_from_slice(&self.cache_bytes.to_le_bytes());
        put_blocks(&mut out, &self.blocks);
        out
    }

    /// Parses and checks a payload.
    pub fn decode(payload: &[u8]) -> Result<WarmBlocks, WireError> {
        let mut f = Fields::new(FrameKind::WarmBlocks, payload);
        let disk = f.string("warm_blocks.disk", MAX_DISK_NAME)?;
        let size_bytes = f.u64()?;
        let cache_bytes = f.u64()?;
        let blocks = take_blocks(&mut f, "warm_blocks", size_bytes / 4096)?;
        f.finish()?;
        Ok(WarmBlocks { disk, size_bytes, cache_bytes, blocks })
    }
}

/// Most blocks one WARM_DATA frame carries (1 MiB of contents).
pub const MAX_DATA_BLOCKS: usize = 256;

/// WARM_DATA: contents of cached blocks, sent so the destination's cache
/// does not wait for storage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WarmData {
    /// (block number, its 4 KiB).
    pub blocks: Vec<(u64, Vec<u8>)>,
}

impl WarmData {
    /// Serializes: `count u32, (block u64, 4096 bytes)[count]`.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(4 + self.blocks.len() * (8 + BLOCK));
        out.extend_from_slice(&(self.blocks.len() as u32).to_le_bytes());
        for (block, data) in &self.blocks {
            out.extend_from_slice(&block.to_le_bytes());
            out.extend_from_slice(data);
        }
        out
    }

    /// Parses a payload about storage of `size_bytes`.
    pub fn decode(payload: &[u8], size_bytes: u64) -> Result<WarmData, WireError> {
        let mut f = Fields::new(FrameKind::WarmData, payload);
        let count = f.u32()? as usize;
        if count > MAX_DATA_BLOCKS {
            return Err(WireError::bad("warm_data", format!("{count} blocks (at most {MAX_DATA_BLOCKS})")));
        }
        let mut blocks = Vec::with_capacity(count);
        for _ in 0..count {
            let block = f.u64()?;
            if block >= size_bytes / BLOCK as u64 {
                return Err(WireError::bad("warm_data", format!("block {block} of a {size_bytes}-byte disk")));
            }
            blocks.push((block, f.take(BLOCK)?.to_vec()));
        }
        f.finish()?;
        Ok(WarmData { blocks })
    }
}

const BLOCK: usize = 4096;

/// DISK_WRITTEN: blocks the guest wrote at the source since WARM_BLOCKS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskWritten {
    /// Block numbers.
    pub blocks: Vec<u64>,
}

impl DiskWritten {
    /// Serializes: `count u32, block u64[count]`.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(4 + self.blocks.len() * 8);
        put_blocks(&mut out, &self.blocks);
        out
    }

    /// Parses a payload about storage of `size_bytes`.
    pub fn decode(payload: &[u8], size_bytes: u64) -> Result<DiskWritten, WireError> {
        let mut f = Fields::new(FrameKind::DiskWritten, payload);
        let blocks = take_blocks(&mut f, "disk_written", size_bytes / 4096)?;
        f.finish()?;
        Ok(DiskWritten { blocks })
    }
}

fn put_blocks(out: &mut Vec<u8>, blocks: &[u64]) {
    out.extend_from_slice(&(blocks.len() as u32).to_le_bytes());
    for b in blocks {
        out.extend_from_slice(&b.to_le_bytes());
    }
}

fn take_blocks(f: &mut Fields<'_>, what: &'static str, limit: u64) -> Result<Vec<u64>, WireError> {
    let count = f.u32()? as usize;
    if count > MAX_BLOCKS_PER_FRAME {
        return Err(WireError::bad(what, format!("{count} blocks (at most {MAX_BLOCKS_PER_FRAME})")));
    }
    let mut blocks = Vec::with_capacity(count);
    for _ in 0..count {
        let b = f.u64()?;
        if b >= limit {
            return Err(WireError::bad(what, format!("block {b} of a {limit}-block disk")));
        }
        blocks.push(b);
    }
    Ok(blocks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_limits() {
        let warm = WarmBlocks {
            disk: "nbd://h/x".into(),
            size_bytes: 1 << 20,
            cache_bytes: 4096 * 8,
            blocks: vec![3, 1, 255],
        };
        assert_eq!(WarmBlocks::decode(&warm.encode()).unwrap(), warm);
        let outside = WarmBlocks { blocks: vec![256], ..warm.clone() };
        assert!(WarmBlocks::decode(&outside.encode()).is_err());
        let written = DiskWritten { blocks: vec![0, 7] };
        assert_eq!(DiskWritten::decode(&written.encode(), 1 << 20).unwrap(), written);
        assert!(DiskWritten::decode(&written.encode(), 4096).is_err(), "block 7 of 1");
        let mut long = written.encode();
        long[..4].copy_from_slice(&(MAX_BLOCKS_PER_FRAME as u32 + 1).to_le_bytes());
        assert!(DiskWritten::decode(&long, 1 << 40).is_err());
        let data = WarmData { blocks: vec![(2, vec![7; 4096]), (0, vec![1; 4096])] };
        assert_eq!(WarmData::decode(&data.encode(), 1 << 20).unwrap(), data);
        assert!(WarmData::decode(&data.encode(), 8192).is_err(), "block 2 of 2");
        assert!(WarmData::decode(&data.encode()[..100], 1 << 20).is_err(), "short");
        let mut trailing = written.encode();
        trailing.push(0);
        assert!(DiskWritten::decode(&trailing, 1 << 20).is_err());
    }
}
