//! The migration stream: a preamble each way, then CRC-checked frames.
//! docs/stream-format.md is the reference; this module is its code.
//!
//! ```text
//! source                                   destination
//!   | preamble (magic, version)  --->         |
//!   |         <---  preamble (magic, version) |
//!   | HELLO (memory, page size, options) -->  |  checks, creates the VM
//!   |         <---  ACCEPT | ERROR            |
//!   | PAGES ... ITERATION_END  (xN)  --->     |  writes pages
//!   | [pause] PAGES ... STATE DIGEST --->     |  verifies memory digest
//!   |         <---  READY | ERROR             |
//!   | COMMIT  --->                            |  restores state, resumes
//!   |         <---  RESUMED                   |
//! ```
//! Receiver states: Hello -> Pages (iterations) -> Final (after STATE and
//! DIGEST) -> Committed. Any other order is an error.

use std::io::{Read, Write};

/// First 8 bytes of every stream, in both directions.
pub const MAGIC: [u8; 8] = *b"TSBMIGR\0";
/// Version of this format; both ends must speak the same.
pub const VERSION: u32 = 2;
/// Bytes of the preamble: magic, version, reserved.
pub const PREAMBLE_LEN: usize = 16;
/// Bytes of a frame header: kind u16, reserved u16, length u32, crc u32.
pub const FRAME_HEADER_LEN: usize = 12;
/// Largest frame payload accepted.
pub const MAX_PAYLOAD: usize = 16 << 20;
/// Longest error message carried.
pub const MAX_ERROR_MESSAGE: usize = 4096;
/// Largest PAGES payload inside a PAGES_COMPRESSED frame: a source packs
/// at most 256 records (~1 MiB) per frame, so 2 MiB bounds what each
/// decoder holds for unpacking.
pub const MAX_UNPACKED: usize = 2 << 20;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum FrameKind {
    /// Never valid: a zeroed header is an error.
    Invalid = 0,
    /// Source's setup: memory layout and options.
    Hello = 1,
    /// Destination agrees to the HELLO.
    Accept = 2,
    /// A batch of page records.
    Pages = 3,
    /// End of one pre-copy iteration.
    IterationEnd = 4,
    /// vCPU and device state (postcard-encoded `VmState`).
    State = 5,
    /// Per-region hashes of the final memory.
    Digest = 6,
    /// Destination holds the same memory and state; waits for COMMIT.
    Ready = 7,
    /// Source gives the VM up; destination resumes it.
    Commit = 8,
    /// Destination runs the VM.
    Resumed = 9,
    /// Either side gives up, with a reason.
    Error = 10,
    /// Destination's memory differs in these digest regions; resend them.
    Mismatch = 11,
    /// A PAGES payload compressed by lz4 or zstd.
    PagesCompressed = 12,
    /// First frame of an extra channel: which migration and channel it is.
    Channel = 13,
    /// A PAGES payload of raw pages sent with `--zero-copy`: its CRC covers
    /// the frame header, the PAGES header and the record headers, not the
    /// pages (the kernel reads them after the CRC is made; the memory
    /// digest checks them).
    PagesZeroCopy = 14,
}

impl FrameKind {
    fn from_u16(v: u16) -> Option<FrameKind> {
        use FrameKind::*;
        Some(match v {
            1 => Hello,
            2 => Accept,
            3 => Pages,
            4 => IterationEnd,
            5 => State,
            6 => Digest,
            7 => Ready,
            8 => Commit,
            9 => Resumed,
            10 => Error,
            11 => Mismatch,
            12 => PagesCompressed,
            13 => Channel,
            14 => PagesZeroCopy,
            _ => return None,
        })
    }
}

/// What can be wrong with bytes off the wire.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The transport failed or closed.
    #[error("connection failed")]
    Io(#[from] std::io::Error),
    /// The peer is not a tsubame migration stream.
    #[error("peer is not a tsubame migration stream (bad magic)")]
    BadMagic,
    /// The peer wants an authenticated connection and this end is plain.
    #[error("the peer started {0}, and this end is plain: give it the peer's security flags (--psk-file, or --tls-cert, --tls-key and --tls-ca)")]
    PeerIsSecure(&'static str),
    /// The peer speaks another version.
    #[error("peer speaks stream version {peer}, this tsubame speaks {VERSION}")]
    VersionMismatch {
        /// The peer's version.
        peer: u32,
    },
    /// A frame kind we do not know.
    #[error("frame has unknown kind {0}")]
    UnknownKind(u16),
    /// A field outside its allowed range.
    #[error("frame field {field} is invalid: {detail}")]
    BadField {
        /// Which field.
        field: &'static str,
        /// What is wrong with it.
        detail: String,
    },
    /// Payload longer than the cap.
    #[error("frame length {0} exceeds the {MAX_PAYLOAD}-byte limit")]
    TooLong(u32),
    /// CRC32C mismatch.
    #[error("frame of kind {kind:?} failed its CRC32C check (corrupted in transit)")]
    BadCrc {
        /// The frame's kind.
        kind: FrameKind,
    },
    /// A frame that is valid but not expected now.
    #[error("unexpected {got:?} frame while waiting for {expected}")]
    Unexpected {
        /// What arrived.
        got: FrameKind,
        /// What the state machine wanted.
        expected: &'static str,
    },
    /// The payload is shorter than its fields.
    #[error("{0:?} frame is truncated")]
    Truncated(FrameKind),
}

/// Writes our preamble.
pub fn write_preamble(w: &mut impl Write, version: u32) -> std::io::Result<()> {
    let mut p = [0u8; PREAMBLE_LEN];
    p[..8].copy_from_slice(&MAGIC);
    p[8..12].copy_from_slice(&version.to_le_bytes());
    w.write_all(&p)?;
    w.flush()
}

/// Reads and checks the peer's preamble.
pub fn read_preamble(r: &mut impl Read) -> Result<(), WireError> {
    let mut p = [0u8; PREAMBLE_LEN];
    r.read_exact(&mut p)?;
    if p[..8] != MAGIC {
        if p[..8] == crate::secure::MAGIC {
            return Err(WireError::PeerIsSecure("a tsubame secure handshake"));
        }
        if crate::secure::tls::is_client_hello(&p) {
            return Err(WireError::PeerIsSecure("a TLS handshake"));
        }
        return Err(WireError::BadMagic);
    }
    let peer = u32::from_le_bytes(p[8..12].try_into().unwrap());
    if peer != VERSION {
        return Err(WireError::VersionMismatch { peer });
    }
    Ok(())
}

/// The header bytes of a frame (CRC over header[..8] then payload).
pub fn frame_header(kind: FrameKind, payload: &[u8]) -> [u8; FRAME_HEADER_LEN] {
    let mut h = [0u8; FRAME_HEADER_LEN];
    h[0..2].copy_from_slice(&(kind as u16).to_le_bytes());
    h[4..8].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    let crc = crc32c::crc32c_append(crc32c::crc32c(&h[..8]), payload);
    h[8..12].copy_from_slice(&crc.to_le_bytes());
    h
}

/// The CRC of a PAGES_ZEROCOPY frame: header[..8], the PAGES header and
/// each record's header, skipping the record data. None when the records
/// run past the payload.
pub fn zero_copy_crc(h: &[u8; FRAME_HEADER_LEN], payload: &[u8]) -> Option<u32> {
    use crate::pages::{PAGES_HEADER, RECORD_HEADER};
    let mut crc = crc32c::crc32c_append(crc32c::crc32c(&h[..8]), payload.get(..PAGES_HEADER)?);
    let count = u32::from_le_bytes(payload[8..12].try_into().unwrap());
    let mut at = PAGES_HEADER;
    for _ in 0..count.min(crate::pages::MAX_RECORDS) {
        let record = payload.get(at..at + RECORD_HEADER)?;
        crc = crc32c::crc32c_append(crc, record);
        at += RECORD_HEADER + u32::from_le_bytes(record[9..13].try_into().unwrap()) as usize;
    }
    Some(crc)
}

/// The header of a PAGES_ZEROCOPY frame whose payload is `payload_len`
/// bytes; `headers` are its PAGES header and record headers, back to back.
pub fn zero_copy_frame_header(payload_len: usize, headers: &[u8]) -> [u8; FRAME_HEADER_LEN] {
    let mut h = [0u8; FRAME_HEADER_LEN];
    h[0..2].copy_from_slice(&(FrameKind::PagesZeroCopy as u16).to_le_bytes());
    h[4..8].copy_from_slice(&(payload_len as u32).to_le_bytes());
    let crc = crc32c::crc32c_append(crc32c::crc32c(&h[..8]), headers);
    h[8..12].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Writes one frame.
pub fn write_frame(w: &mut impl Write, kind: FrameKind, payload: &[u8]) -> std::io::Result<()> {
    debug_assert!(payload.len() <= MAX_PAYLOAD);
    w.write_all(&frame_header(kind, payload))?;
    w.write_all(payload)
}

/// Parses a frame header; returns kind and payload length.
pub fn parse_header(h: &[u8; FRAME_HEADER_LEN]) -> Result<(FrameKind, usize), WireError> {
    let raw_kind = u16::from_le_bytes([h[0], h[1]]);
    let kind = FrameKind::from_u16(raw_kind).ok_or(WireError::UnknownKind(raw_kind))?;
    let reserved = u16::from_le_bytes([h[2], h[3]]);
    if reserved != 0 {
        return Err(WireError::BadField { field: "header.reserved", detail: format!("{reserved} (must be 0)") });
    }
    let len = u32::from_le_bytes(h[4..8].try_into().unwrap());
    if len as usize > MAX_PAYLOAD {
        return Err(WireError::TooLong(len));
    }
    Ok((kind, len as usize))
}

/// Reads one frame into `buf` (reused across calls); checks length cap
/// before allocating and the CRC before returning.
pub fn read_frame(r: &mut impl Read, buf: &mut Vec<u8>) -> Result<FrameKind, WireError> {
    read_frame_reserving(r, buf, |_| Ok(()))
}

/// [`read_frame`], asking `reserve` for the payload's length after the
/// header is checked and before the buffer grows (the destination's cap on
/// the bytes a peer makes it hold).
pub fn read_frame_reserving<E: From<WireError>>(
    r: &mut impl Read,
    buf: &mut Vec<u8>,
    reserve: impl FnOnce(usize) -> Result<(), E>,
) -> Result<FrameKind, E> {
    let mut h = [0u8; FRAME_HEADER_LEN];
    r.read_exact(&mut h).map_err(WireError::from)?;
    let (kind, len) = parse_header(&h)?;
    reserve(len)?;
    buf.resize(len, 0);
    r.read_exact(buf).map_err(WireError::from)?;
    let want = u32::from_le_bytes(h[8..12].try_into().unwrap());
    let got = match kind {
        FrameKind::PagesZeroCopy => zero_copy_crc(&h, buf),
        _ => Some(crc32c::crc32c_append(crc32c::crc32c(&h[..8]), buf)),
    };
    let got = got.unwrap_or(!want);
    // Fuzz builds skip the check so mutations reach the parsers behind it.
    if want != got && !cfg!(fuzzing) {
        return Err(WireError::BadCrc { kind }.into());
    }
    Ok(kind)
}

/// Little-endian field reader over a payload, with named errors.
pub struct Fields<'a> {
    kind: FrameKind,
    bytes: &'a [u8],
}

impl<'a> Fields<'a> {
    /// Reads fields of a `kind` payload.
    pub fn new(kind: FrameKind, bytes: &'a [u8]) -> Self {
        Fields { kind, bytes }
    }

    /// Takes `n` bytes.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.bytes.len() < n {
            return Err(WireError::Truncated(self.kind));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    /// A u8.
    pub fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }

    /// A little-endian u16.
    pub fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap()))
    }

    /// A little-endian u32.
    pub fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }

    /// A little-endian u64.
    pub fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }

    /// A u16-length-prefixed UTF-8 string of at most `max` bytes.
    pub fn string(&mut self, field: &'static str, max: usize) -> Result<String, WireError> {
        let len = self.u16()? as usize;
        if len > max {
            return Err(WireError::BadField { field, detail: format!("{len} bytes (at most {max})") });
        }
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| WireError::BadField { field, detail: "not UTF-8".into() })
    }

    /// Bytes left.
    pub fn rest(&self) -> &'a [u8] {
        self.bytes
    }

    /// Fails unless every byte was consumed.
    pub fn finish(self) -> Result<(), WireError> {
        if self.bytes.is_empty() {
            Ok(())
        } else {
            Err(WireError::BadField { field: "payload", detail: format!("{} trailing bytes", self.bytes.len()) })
        }
    }
}

/// Appends a u16-length-prefixed string (cut at `max` bytes on a char boundary).
pub fn put_string(out: &mut Vec<u8>, s: &str, max: usize) {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    out.extend_from_slice(&(end as u16).to_le_bytes());
    out.extend_from_slice(&s.as_bytes()[..end]);
}

/// The source's setup message.
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
}

/// Most channels of one migration.
pub const MAX_CHANNELS: u16 = 16;
/// Most codec shards of one migration.
pub const MAX_SHARDS: u16 = 64;

/// Longest codec list in a HELLO.
pub const MAX_CODECS: usize = 256;

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
        };
        f.finish()?;
        let bad = |field, detail: String| Err(WireError::BadField { field, detail });
        if hello.page_size != 4096 {
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
        if let Err(detail) = crate::subpage::check_granularity(hello.granularity) {
            return bad("hello.granularity", detail);
        }
        if !(1..=MAX_CHANNELS).contains(&hello.channels) {
            return bad("hello.channels", format!("{} (1 to {MAX_CHANNELS})", hello.channels));
        }
        if !(1..=MAX_SHARDS).contains(&hello.shards) || hello.shards < hello.channels {
            return bad("hello.shards", format!("{} (channels to {MAX_SHARDS})", hello.shards));
        }
        Ok(hello)
    }
}

/// The CHANNEL frame: `session u64, channel u16`.
pub fn encode_channel(session: u64, channel: u16) -> [u8; 10] {
    let mut out = [0u8; 10];
    out[..8].copy_from_slice(&session.to_le_bytes());
    out[8..].copy_from_slice(&channel.to_le_bytes());
    out
}

/// Parses a CHANNEL frame into (session, channel).
pub fn decode_channel(payload: &[u8]) -> Result<(u64, u16), WireError> {
    let mut f = Fields::new(FrameKind::Channel, payload);
    let session = f.u64()?;
    let channel = f.u16()?;
    f.finish()?;
    Ok((session, channel))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_copy_crc_covers_headers_not_data() {
        let mut b = crate::pages::PagesBuilder::new(2);
        b.reset(1, 0);
        b.push_header(7, crate::pages::Encoding::Raw, 4096);
        b.push_header(8, crate::pages::Encoding::Zero, 0);
        let headers = b.payload().to_vec();
        // The payload as it arrives: the page spliced in after its header.
        let mut payload = headers[..crate::pages::PAGES_HEADER + crate::pages::RECORD_HEADER].to_vec();
        payload.extend_from_slice(&[0xAB; 4096]);
        payload.extend_from_slice(&headers[crate::pages::PAGES_HEADER + crate::pages::RECORD_HEADER..]);
        let h = zero_copy_frame_header(payload.len(), &headers);
        let frame = |payload: &[u8]| [&h[..], payload].concat();
        let mut buf = Vec::new();
        assert_eq!(read_frame(&mut frame(&payload).as_slice(), &mut buf).unwrap(), FrameKind::PagesZeroCopy);
        // Page bytes are the digest's business; headers are the CRC's.
        let mut changed_page = payload.clone();
        changed_page[100] ^= 1;
        assert!(read_frame(&mut frame(&changed_page).as_slice(), &mut buf).is_ok());
        let mut changed_index = payload.clone();
        changed_index[crate::pages::PAGES_HEADER] ^= 1;
        assert!(matches!(read_frame(&mut frame(&changed_index).as_slice(), &mut buf), Err(WireError::BadCrc { .. })));
        let mut bad_count = payload;
        bad_count[8] = 200; // records past the payload
        assert!(matches!(read_frame(&mut frame(&bad_count).as_slice(), &mut buf), Err(WireError::BadCrc { .. })));
    }

    #[test]
    fn frame_round_trip_and_crc() {
        let mut wire = Vec::new();
        write_frame(&mut wire, FrameKind::Pages, b"hello").unwrap();
        let mut buf = Vec::new();
        assert_eq!(read_frame(&mut wire.as_slice(), &mut buf).unwrap(), FrameKind::Pages);
        assert_eq!(buf, b"hello");
        for i in 0..wire.len() {
            let mut bad = wire.clone();
            bad[i] ^= 0x40;
            assert!(read_frame(&mut bad.as_slice(), &mut buf).is_err(), "flip at byte {i} not caught");
        }
        assert!(matches!(read_frame(&mut &wire[..wire.len() - 1], &mut buf), Err(WireError::Io(_))));
    }

    #[test]
    fn oversized_and_unknown_frames_rejected_before_reading_payload() {
        let mut h = frame_header(FrameKind::Pages, b"");
        h[4..8].copy_from_slice(&(MAX_PAYLOAD as u32 + 1).to_le_bytes());
        assert!(matches!(parse_header(&h), Err(WireError::TooLong(_))));
        h[0] = 99;
        assert!(matches!(parse_header(&h), Err(WireError::UnknownKind(99))));
        let zero = [0u8; FRAME_HEADER_LEN];
        assert!(matches!(parse_header(&zero), Err(WireError::UnknownKind(0))));
    }

    #[test]
    fn preamble_checks_magic_and_version() {
        let mut ok = Vec::new();
        write_preamble(&mut ok, VERSION).unwrap();
        read_preamble(&mut ok.as_slice()).unwrap();
        let mut other = Vec::new();
        write_preamble(&mut other, VERSION + 1).unwrap();
        assert!(matches!(read_preamble(&mut other.as_slice()), Err(WireError::VersionMismatch { peer: 3 })));
        assert!(matches!(read_preamble(&mut &[0u8; 16][..]), Err(WireError::BadMagic)));
        let mut secure = [0u8; 16];
        secure[..8].copy_from_slice(&crate::secure::MAGIC);
        assert!(matches!(read_preamble(&mut &secure[..]), Err(WireError::PeerIsSecure(_))));
        let client_hello = [0x16, 3, 1, 0, 200, 1, 0, 0, 196, 3, 3, 0, 0, 0, 0, 0];
        assert!(matches!(read_preamble(&mut &client_hello[..]), Err(WireError::PeerIsSecure("a TLS handshake"))));
    }

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
