//! The post-copy messages: the switch with the set of stale pages, page
//! requests, the destination's replies, and reconnecting a cut link.

use tsubame_vmm::DirtyBitmap;

use super::fields::Fields;
use super::kind::{FrameKind, WireError};
use super::messages::ChannelOpen;

/// POSTCOPY: the source paused its VM and stops pre-copy; the destination
/// discards the pages it lacks or holds stale, runs the VM without them,
/// and is sent them (asked-for pages first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PostcopyStart {
    /// The last pre-copy iteration whose pages came before this frame on
    /// every channel, if any did.
    pub last_iteration: Option<u32>,
    /// How long either end waits for a cut link to come back, ms.
    pub timeout_ms: u32,
    /// The pages the destination must not use: stale or never sent.
    pub missing: DirtyBitmap,
}

impl PostcopyStart {
    /// Serializes the payload: `last_iteration u32` (all ones: none),
    /// `timeout_ms u32`, then the bitmap (`pages u64`, one bit per page in
    /// u64 words).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.missing.words().len() * 8);
        out.extend_from_slice(&self.last_iteration.unwrap_or(u32::MAX).to_le_bytes());
        out.extend_from_slice(&self.timeout_ms.to_le_bytes());
        put_bitmap(&mut out, &self.missing);
        out
    }

    /// Parses a payload about memory of `pages` pages.
    pub fn decode(payload: &[u8], pages: u64) -> Result<PostcopyStart, WireError> {
        let mut f = Fields::new(FrameKind::Postcopy, payload);
        let last = f.u32()?;
        let timeout_ms = f.u32()?;
        let missing = bitmap(&mut f, "postcopy.pages", pages)?;
        f.finish()?;
        Ok(PostcopyStart { last_iteration: (last != u32::MAX).then_some(last), timeout_ms, missing })
    }
}

/// RESUME_ACK: the pages the destination still lacks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResumeAck {
    /// Pages still missing at the destination.
    pub missing: DirtyBitmap,
}

impl ResumeAck {
    /// Serializes the payload: the bitmap.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        put_bitmap(&mut out, &self.missing);
        out
    }

    /// Parses a payload about memory of `pages` pages.
    pub fn decode(payload: &[u8], pages: u64) -> Result<ResumeAck, WireError> {
        let mut f = Fields::new(FrameKind::ResumeAck, payload);
        let missing = bitmap(&mut f, "resume_ack.pages", pages)?;
        f.finish()?;
        Ok(ResumeAck { missing })
    }
}

/// A page set's form on the wire: a bitmap, or (when shorter) a list.
const SET_BITMAP: u8 = 0;
const SET_LIST: u8 = 1;

/// A set of pages: `pages u64`, then either `0u8` and the bitmap
/// (⌈pages/64⌉ u64 words) or `1u8`, `count u32` and that many page
/// indices u64 in increasing order, whichever is shorter (the few pages
/// a pause adds to post-copy's set go in bytes, not in a 128 KiB bitmap).
fn put_bitmap(out: &mut Vec<u8>, pages: &DirtyBitmap) {
    out.extend_from_slice(&pages.pages().to_le_bytes());
    let count = pages.count();
    if 4 + count * 8 < pages.words().len() as u64 * 8 {
        out.push(SET_LIST);
        out.extend_from_slice(&(count as u32).to_le_bytes());
        for p in pages.iter() {
            out.extend_from_slice(&p.to_le_bytes());
        }
    } else {
        out.push(SET_BITMAP);
        for w in pages.words() {
            out.extend_from_slice(&w.to_le_bytes());
        }
    }
}

fn bitmap(f: &mut Fields, field: &'static str, pages: u64) -> Result<DirtyBitmap, WireError> {
    let got = f.u64()?;
    if got != pages {
        return Err(WireError::bad(field, format!("{got}, memory has {pages}")));
    }
    match f.u8()? {
        SET_BITMAP => {
            let words = (0..pages.div_ceil(64)).map(|_| f.u64()).collect::<Result<Vec<_>, _>>()?;
            if !pages.is_multiple_of(64) && words.last().is_some_and(|w| w >> (pages % 64) != 0) {
                return Err(WireError::bad(field, "bits set past the last page"));
            }
            Ok(DirtyBitmap::from_words(words, pages))
        }
        SET_LIST => {
            let count = f.u32()? as u64;
            if count > pages {
                return Err(WireError::bad(field, format!("{count} pages listed, memory has {pages}")));
            }
            let mut set = DirtyBitmap::new(pages);
            let mut next = 0;
            for _ in 0..count {
                let page = f.u64()?;
                if page < next || page >= pages {
                    return Err(WireError::bad(field, format!("page {page} out of order or past the last")));
                }
                set.set(page);
                next = page + 1;
            }
            Ok(set)
        }
        other => Err(WireError::bad(field, format!("form {other} (0 bitmap, 1 list)"))),
    }
}

/// Most pages one PAGE_REQUEST names.
pub const MAX_REQUEST: usize = 4096;

/// PAGE_REQUEST: pages the guest faulted on at the destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageRequest {
    /// Page indices, each below the page count.
    pub pages: Vec<u64>,
}

impl PageRequest {
    /// Serializes the payload: `count u32, page u64[count]`.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(4 + self.pages.len() * 8);
        out.extend_from_slice(&(self.pages.len() as u32).to_le_bytes());
        for p in &self.pages {
            out.extend_from_slice(&p.to_le_bytes());
        }
        out
    }

    /// Parses a request about memory of `page_count` pages.
    pub fn decode(payload: &[u8], page_count: u64) -> Result<PageRequest, WireError> {
        let mut f = Fields::new(FrameKind::PageRequest, payload);
        let count = f.u32()? as usize;
        if count == 0 || count > MAX_REQUEST {
            return Err(WireError::bad("page_request.count", format!("{count} (1 to {MAX_REQUEST})")));
        }
        let mut pages = Vec::with_capacity(count);
        for _ in 0..count {
            let p = f.u64()?;
            if p >= page_count {
                return Err(WireError::bad("page_request.page", format!("{p} of {page_count}")));
            }
            pages.push(p);
        }
        f.finish()?;
        Ok(PageRequest { pages })
    }
}

/// POSTCOPY_RUNNING: the destination runs the VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PostcopyRunning {
    /// CPU time of the destination process from connection to resume, µs.
    pub cpu_micros: u64,
}

impl PostcopyRunning {
    /// Serializes the payload: `cpu_micros u64`.
    pub fn encode(&self) -> [u8; 8] {
        self.cpu_micros.to_le_bytes()
    }

    /// Parses the payload.
    pub fn decode(payload: &[u8]) -> Result<PostcopyRunning, WireError> {
        Ok(PostcopyRunning { cpu_micros: Fields::only_u64(FrameKind::PostcopyRunning, payload)? })
    }
}

/// POSTCOPY_INSTALLED: pages of the push's frames the destination took in
/// (installed, or held already), counted since the phase began.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PostcopyInstalled {
    /// Pages, all links together.
    pub pages: u64,
}

impl PostcopyInstalled {
    /// Serializes the payload: `pages u64`.
    pub fn encode(&self) -> [u8; 8] {
        self.pages.to_le_bytes()
    }

    /// Parses the payload.
    pub fn decode(payload: &[u8]) -> Result<PostcopyInstalled, WireError> {
        Ok(PostcopyInstalled { pages: Fields::only_u64(FrameKind::PostcopyInstalled, payload)? })
    }
}

/// POSTCOPY_DONE: the destination holds every page; how its memory as
/// received compared with the source's digest, and what faults cost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PostcopyDone {
    /// Digest regions that differed (0: verified).
    pub mismatched: u32,
    /// Faults the destination read.
    pub faults: u64,
    /// Pages it asked the source for.
    pub requested: u64,
    /// Fault service time, median, µs.
    pub latency_p50_us: u64,
    /// 99th percentile, µs.
    pub latency_p99_us: u64,
    /// Longest, µs.
    pub latency_max_us: u64,
    /// CPU time of the destination process during post-copy, µs.
    pub cpu_micros: u64,
    /// The guest's ops per second during post-copy, if the destination
    /// could see its progress lines (0 otherwise).
    pub guest_ops_per_sec: f64,
}

impl PostcopyDone {
    /// Serializes the payload: `mismatched u32`, then six u64 and an f64.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(60);
        out.extend_from_slice(&self.mismatched.to_le_bytes());
        for v in [
            self.faults,
            self.requested,
            self.latency_p50_us,
            self.latency_p99_us,
            self.latency_max_us,
            self.cpu_micros,
            self.guest_ops_per_sec.to_bits(),
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out
    }

    /// Parses the payload.
    pub fn decode(payload: &[u8]) -> Result<PostcopyDone, WireError> {
        let mut f = Fields::new(FrameKind::PostcopyDone, payload);
        let done = PostcopyDone {
            mismatched: f.u32()?,
            faults: f.u64()?,
            requested: f.u64()?,
            latency_p50_us: f.u64()?,
            latency_p99_us: f.u64()?,
            latency_max_us: f.u64()?,
            cpu_micros: f.u64()?,
            guest_ops_per_sec: f64::from_bits(f.u64()?),
        };
        f.finish()?;
        Ok(done)
    }
}

/// RESUME: a source reconnects to a cut post-copy migration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resume {
    /// The migration's HELLO session.
    pub session: u64,
    /// Which connection this is: 0 carries control and pages; the
    /// post-copy request connection is `channels` as at setup.
    pub channel: u16,
}

impl Resume {
    /// Serializes the payload: `session u64, channel u16`.
    pub fn encode(&self) -> [u8; 10] {
        ChannelOpen { session: self.session, channel: self.channel }.encode()
    }

    /// Parses the payload.
    pub fn decode(payload: &[u8]) -> Result<Resume, WireError> {
        let mut f = Fields::new(FrameKind::Resume, payload);
        let resume = Resume { session: f.u64()?, channel: f.u16()? };
        f.finish()?;
        Ok(resume)
    }
}
