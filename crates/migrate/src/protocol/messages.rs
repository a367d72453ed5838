//! Every message that is not page records, with its encoder and decoder
//! side by side. Decoders check every field against its range: a peer's
//! bytes are hostile until proven otherwise.

use super::fields::{put_string, Fields};

use super::kind::{FrameKind, WireError};
use super::limits::{check_granularity, MAX_CHANNELS, MAX_SHARDS};

/// Longest codec list in a HELLO.
pub const MAX_CODECS: usize = 256;
/// Longest error message carried.
pub const MAX_ERROR_MESSAGE: usize = 4096;
/// Most regions a MISMATCH frame may list.
pub const MAX_MISMATCH: usize = 1 << 20;

/// HELLO: the source's setup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// Guest memory size in bytes.
    pub memory_bytes: u64,
    /// Page size of the records (4096).
    pub page_size: u32,
    /// vCPUs of the VM.
    pub vcpus: u32,
    /// Bytes per digest region.
    pub digest_region: u32,
    /// Bytes per sub-page of SUBPAGE records (4096: none are sent).
    pub granularity: u32,
    /// Page encodings the source may use, comma-separated.
    pub codecs: String,
    /// Names this migration on its extra channels' CHANNEL frames.
    pub session: u64,
    /// Connections carrying pages (this one included).
    pub channels: u16,
    /// Codec shards: pages are split by index into this many streams,
    /// each with its own codec caches, each on one channel.
    pub shards: u16,
    /// [`HELLO_POSTCOPY`] and future bits.
    pub flags: u16,
}

/// HELLO flag: the source may switch to post-copy; it opens one more
/// connection after the data channels, for the pages a destination asks
/// for (CHANNEL `channels`).
pub const HELLO_POSTCOPY: u16 = 1;
/// HELLO flag: the VM has far memory; FAR_MEMORY and FAR_PAGES follow
/// ACCEPT on channel 0, before the extra channels open.
pub const HELLO_FAR_MEMORY: u16 = 2;

impl Hello {
    /// True when the source may switch to post-copy.
    pub fn postcopy(&self) -> bool {
        self.flags & HELLO_POSTCOPY != 0
    }

    /// True when the VM has far memory.
    pub fn far_memory(&self) -> bool {
        self.flags & HELLO_FAR_MEMORY != 0
    }

    /// Connections the destination accepts after channel 0.
    pub fn extra_connections(&self) -> u16 {
        self.channels - 1 + u16::from(self.postcopy())
    }
}

impl Hello {
    /// Serializes the payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(32);
        out.extend_from_slice(&self.memory_bytes.to_le_bytes());
        out.extend_from_slice(&self.page_size.to_le_bytes());
        out.extend_from_slice(&self.vcpus.to_le_bytes());
        out.extend_from_slice(&self.digest_region.to_le_bytes());
        out.extend_from_slice(&self.granularity.to_le_bytes());
        put_string(&mut out, &self.codecs, MAX_CODECS);
        out.extend_from_slice(&self.session.to_le_bytes());
        out.extend_from_slice(&self.channels.to_le_bytes());
        out.extend_from_slice(&self.shards.to_le_bytes());
        out.extend_from_slice(&self.flags.to_le_bytes());
        out
    }

    /// Parses and range-checks the payload.
    pub fn decode(payload: &[u8]) -> Result<Hello, WireError> {
        let mut f = Fields::new(FrameKind::Hello, payload);
        let hello = Hello {
            memory_bytes: f.u64()?,
            page_size: f.u32()?,
            vcpus: f.u32()?,
            digest_region: f.u32()?,
            granularity: f.u32()?,
            codecs: f.string("hello.codecs", MAX_CODECS)?,
            session: f.u64()?,
            channels: f.u16()?,
            shards: f.u16()?,
            flags: f.u16()?,
        };
        f.finish()?;
        let bad = |field, detail: String| Err(WireError::bad(field, detail));
        if hello.page_size as usize != tsubame_codec::PAGE_SIZE {
            return bad("hello.page_size", format!("{} (only 4096 is supported)", hello.page_size));
        }
        if hello.vcpus != 1 {
            return bad("hello.vcpus", format!("{} (only 1 is supported)", hello.vcpus));
        }
        if !(tsubame_vmm::memory::MIN_MEMORY..=tsubame_vmm::memory::MAX_MEMORY).contains(&hello.memory_bytes)
            || !hello.memory_bytes.is_multiple_of(2 << 20)
        {
            return bad("hello.memory_bytes", format!("{} is out of range", hello.memory_bytes));
        }
        if !hello.digest_region.is_power_of_two() || !(4096..=(64 << 20)).contains(&hello.digest_region) {
            return bad("hello.digest_region", format!("{} (a power of two, 4 KiB to 64 MiB)", hello.digest_region));
        }
        if let Err(detail) = check_granularity(hello.granularity) {
            return bad("hello.granularity", detail);
        }
        if !(1..=MAX_CHANNELS).contains(&hello.channels) {
            return bad("hello.channels", format!("{} (1 to {MAX_CHANNELS})", hello.channels));
        }
        if !(1..=MAX_SHARDS).contains(&hello.shards) || hello.shards < hello.channels {
            return bad("hello.shards", format!("{} (channels to {MAX_SHARDS})", hello.shards));
        }
        if hello.flags & !(HELLO_POSTCOPY | HELLO_FAR_MEMORY) != 0 {
            return bad("hello.flags", format!("{:#x} (unknown bits)", hello.flags));
        }
        Ok(hello)
    }
}

/// CHANNEL: the first frame of an extra connection, naming its migration
/// and its place among the channels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChannelOpen {
    /// The migration's HELLO session.
    pub session: u64,
    /// 1 to channels - 1 (channel 0 is the first connection).
    pub channel: u16,
}

impl ChannelOpen {
    /// Serializes the payload: `session u64, channel u16`.
    pub fn encode(&self) -> [u8; 10] {
        let mut out = [0u8; 10];
        out[..8].copy_from_slice(&self.session.to_le_bytes());
        out[8..].copy_from_slice(&self.channel.to_le_bytes());
        out
    }

    /// Parses the payload.
    pub fn decode(payload: &[u8]) -> Result<ChannelOpen, WireError> {
        let mut f = Fields::new(FrameKind::Channel, payload);
        let open = ChannelOpen { session: f.u64()?, channel: f.u16()? };
        f.finish()?;
        Ok(open)
    }
}

/// ITERATION_END: every page record of this iteration on this channel came
/// before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IterationEnd {
    /// The iteration that ended.
    pub iteration: u32,
    /// Page records the channel carried in it.
    pub records: u64,
}

impl IterationEnd {
    /// Serializes the payload: `iteration u32, records u64`.
    pub fn encode(&self) -> [u8; 12] {
        let mut out = [0u8; 12];
        out[..4].copy_from_slice(&self.iteration.to_le_bytes());
        out[4..].copy_from_slice(&self.records.to_le_bytes());
        out
    }

    /// Parses the payload.
    pub fn decode(payload: &[u8]) -> Result<IterationEnd, WireError> {
        let mut f = Fields::new(FrameKind::IterationEnd, payload);
        let end = IterationEnd { iteration: f.u32()?, records: f.u64()? };
        f.finish()?;
        Ok(end)
    }
}

/// RESUMED: the destination runs the VM, and what receiving it cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resumed {
    /// CPU time of the destination process from connection to resume, µs.
    pub cpu_micros: u64,
}

impl Resumed {
    /// Serializes the payload: `cpu_micros u64`.
    pub fn encode(&self) -> [u8; 8] {
        self.cpu_micros.to_le_bytes()
    }

    /// Parses the payload.
    pub fn decode(payload: &[u8]) -> Result<Resumed, WireError> {
        Ok(Resumed { cpu_micros: Fields::only_u64(FrameKind::Resumed, payload)? })
    }
}

/// ERROR: either side gives up, and says why in one line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorMessage(pub String);

impl ErrorMessage {
    /// Serializes the payload: the UTF-8 text, cut at
    /// [`MAX_ERROR_MESSAGE`] bytes on a character boundary.
    pub fn encode(&self) -> Vec<u8> {
        let mut end = self.0.len().min(MAX_ERROR_MESSAGE);
        while !self.0.is_char_boundary(end) {
            end -= 1;
        }
        self.0.as_bytes()[..end].to_vec()
    }

    /// Reads the payload (invalid UTF-8 is replaced, the rest cut off).
    pub fn decode(payload: &[u8]) -> ErrorMessage {
        ErrorMessage(String::from_utf8_lossy(&payload[..payload.len().min(MAX_ERROR_MESSAGE)]).into_owned())
    }
}

/// DIGEST: the hash of each region of guest memory, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Digest {
    /// Bytes per region.
    pub region: u32,
    /// One hash per region.
    pub hashes: Vec<u64>,
}

impl Digest {
    /// Serializes the payload: `region u32, count u32, hashes u64[count]`.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 + self.hashes.len() * 8);
        out.extend_from_slice(&self.region.to_le_bytes());
        out.extend_from_slice(&(self.hashes.len() as u32).to_le_bytes());
        for h in &self.hashes {
            out.extend_from_slice(&h.to_le_bytes());
        }
        out
    }

    /// Parses a payload that must describe `region`-byte regions, exactly
    /// `regions` of them (what HELLO agreed).
    pub fn decode(payload: &[u8], region: u32, regions: usize) -> Result<Digest, WireError> {
        let mut f = Fields::new(FrameKind::Digest, payload);
        let got_region = f.u32()?;
        let count = f.u32()? as usize;
        if got_region != region {
            return Err(WireError::bad("digest.region", format!("{got_region}, HELLO said {region}")));
        }
        if count != regions {
            return Err(WireError::bad("digest.count", format!("{count}, memory has {regions}")));
        }
        if f.rest().len() != count * 8 {
            return Err(WireError::Truncated(FrameKind::Digest));
        }
        let hashes = (0..count).map(|_| f.u64()).collect::<Result<Vec<_>, _>>()?;
        f.finish()?;
        Ok(Digest { region, hashes })
    }

    /// Indices of the regions whose hashes differ from `ours`.
    pub fn differing(&self, ours: &[u64]) -> Vec<usize> {
        self.hashes.iter().zip(ours).enumerate().filter(|(_, (a, b))| a != b).map(|(i, _)| i).collect()
    }
}

/// DIGEST_UPDATE: the regions whose hashes changed since the DIGEST sent
/// before the pause (the last pages' regions), so that the stop carries a
/// few of them instead of every region's (128 KiB for 4 GiB, a millisecond
/// at 1 Gbit/s).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DigestUpdate {
    /// Bytes per region.
    pub region: u32,
    /// (region index, its hash), each index below the region count.
    pub changed: Vec<(u32, u64)>,
}

impl DigestUpdate {
    /// The regions where `now` differs from `before` (of equal length).
    pub fn between(region: u32, before: &[u64], now: &[u64]) -> DigestUpdate {
        let changed = before.iter().zip(now).enumerate().filter(|(_, (a, b))| a != b);
        DigestUpdate { region, changed: changed.map(|(i, (_, &h))| (i as u32, h)).collect() }
    }

    /// Serializes the payload: `region u32, count u32, (index u32, hash u64)[count]`.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 + self.changed.len() * 12);
        out.extend_from_slice(&self.region.to_le_bytes());
        out.extend_from_slice(&(self.changed.len() as u32).to_le_bytes());
        for (index, hash) in &self.changed {
            out.extend_from_slice(&index.to_le_bytes());
            out.extend_from_slice(&hash.to_le_bytes());
        }
        out
    }

    /// Parses a payload about `region`-byte regions (what HELLO agreed),
    /// `regions` of them: at most that many entries, each index below it.
    pub fn decode(payload: &[u8], region: u32, regions: usize) -> Result<DigestUpdate, WireError> {
        let mut f = Fields::new(FrameKind::DigestUpdate, payload);
        let got_region = f.u32()?;
        let count = f.u32()? as usize;
        if got_region != region {
            return Err(WireError::bad("digest_update.region", format!("{got_region}, HELLO said {region}")));
        }
        if count > regions {
            return Err(WireError::bad("digest_update.count", format!("{count}, memory has {regions} regions")));
        }
        if f.rest().len() != count * 12 {
            return Err(WireError::Truncated(FrameKind::DigestUpdate));
        }
        let mut changed = Vec::with_capacity(count);
        for _ in 0..count {
            let (index, hash) = (f.u32()?, f.u64()?);
            if index as usize >= regions {
                return Err(WireError::bad("digest_update.index", format!("{index}, memory has {regions} regions")));
            }
            changed.push((index, hash));
        }
        f.finish()?;
        Ok(DigestUpdate { region, changed })
    }

    /// `before` (a DIGEST's hashes) with the changed regions applied.
    pub fn apply(&self, mut before: Vec<u64>) -> Vec<u64> {
        for &(index, hash) in &self.changed {
            before[index as usize] = hash;
        }
        before
    }
}

/// MISMATCH: the destination's memory differs in these digest regions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// Region indices, each below the region count.
    pub regions: Vec<u32>,
}

impl Mismatch {
    /// Serializes the payload: `count u32, region u32[count]`.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(4 + self.regions.len() * 4);
        out.extend_from_slice(&(self.regions.len() as u32).to_le_bytes());
        for &r in &self.regions {
            out.extend_from_slice(&r.to_le_bytes());
        }
        out
    }

    /// Parses a payload about memory of `regions` regions: at least one
    /// and at most [`MAX_MISMATCH`] indices, each below `regions`.
    pub fn decode(payload: &[u8], regions: usize) -> Result<Mismatch, WireError> {
        let mut f = Fields::new(FrameKind::Mismatch, payload);
        let count = f.u32()? as usize;
        if count == 0 || count > MAX_MISMATCH.min(regions) {
            return Err(WireError::bad("mismatch.count", format!("{count} of {regions} regions")));
        }
        let mut list = Vec::with_capacity(count);
        for _ in 0..count {
            let r = f.u32()?;
            if r as usize >= regions {
                return Err(WireError::bad("mismatch.region", format!("{r} of {regions}")));
            }
            list.push(r);
        }
        f.finish()?;
        Ok(Mismatch { regions: list })
    }
}

/// Checks that a frame which carries nothing (ACCEPT, READY, COMMIT) is empty.
pub fn expect_empty(kind: FrameKind, payload: &[u8]) -> Result<(), WireError> {
    Fields::new(kind, payload).finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_round_trip_and_limits() {
        let hello = Hello {
            memory_bytes: 1 << 30,
            page_size: 4096,
            vcpus: 1,
            digest_region: 1 << 20,
            granularity: 128,
            codecs: "zero".into(),
            session: 7,
            channels: 2,
            shards: 4,
            flags: HELLO_POSTCOPY,
        };
        assert_eq!(Hello::decode(&hello.encode()).unwrap(), hello);
        let bad = Hello { shards: 1, ..hello.clone() };
        assert!(Hello::decode(&bad.encode()).unwrap_err().to_string().contains("hello.shards"));
        let bad = Hello { channels: 0, ..hello.clone() };
        assert!(Hello::decode(&bad.encode()).unwrap_err().to_string().contains("hello.channels"));
        let bad = Hello { memory_bytes: 3, ..hello.clone() };
        assert!(Hello::decode(&bad.encode()).unwrap_err().to_string().contains("hello.memory_bytes"));
        let bad = Hello { page_size: 8192, ..hello.clone() };
        assert!(Hello::decode(&bad.encode()).is_err());
        let mut trailing = hello.encode();
        trailing.push(0);
        assert!(Hello::decode(&trailing).is_err());
        assert!(Hello::decode(&hello.encode()[..10]).is_err());
    }
}
