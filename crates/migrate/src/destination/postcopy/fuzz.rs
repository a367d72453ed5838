//! Post-copy's destination end fed by a peer's bytes, with no VM: the fuzz
//! target `postcopy_destination` and the tests below drive the code a
//! running phase uses on what arrives from the source. Guest memory is
//! plain memory registered for missing-page faults, as in a real phase
//! (nothing touches it, so no fault waits).
//!
//! Input: `region u8` (the digest's region: 4 KiB << (byte % 5)), `len
//! u32`, then `len` bytes of channel 0 (of a VM with the smallest memory,
//! [`memory::MIN_MEMORY`]) —
//! POSTCOPY (the missing set), then page frames (plain or compressed),
//! ERROR or DIGEST, each through [`super::on_frame`] — and last what a
//! reconnecting source sends ([`super::link::answer_resume`] for session
//! [`SESSION`], then channel 0's frames, or the request connection's).

use std::io::{Read, Write};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tsubame_vmm::{memory, PAGE_SIZE};

use super::link::{answer_resume, Answer};
use super::{on_frame, PostcopyShared, Unpacker};
use crate::destination::error::ReceiveError;
use crate::digest::zero_page_hash;
use crate::protocol::{self, FrameKind, PostcopyStart};

/// The migration session a reconnecting source must name.
pub const SESSION: u64 = 7;
/// The request connection's channel number.
pub const URGENT_CHANNEL: u16 = 1;

/// What a fed destination ended with.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Fed {
    /// Pages still missing.
    pub missing: u64,
    /// The source's digest, compared with memory as received: whether it
    /// matched (None: no digest came).
    pub digest_matched: Option<bool>,
    /// What the reconnection was: "refused", "urgent", "channel 0", "done".
    pub resume: Option<&'static str>,
    /// Why the feed stopped before its end, if it did.
    pub failed: Option<String>,
}

/// A peer's bytes to read, and what is written back (dropped).
struct Peer<'a>(&'a [u8]);

impl Read for Peer<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.read(buf)
    }
}

impl Write for Peer<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Feeds `data` (see the module's doc) to a destination's post-copy phase.
pub fn feed(data: &[u8]) -> Result<Fed, ReceiveError> {
    let [region, l0, l1, l2, l3, rest @ ..] = data else { return Ok(Fed::default()) };
    let pages = memory::MIN_MEMORY / PAGE_SIZE as u64;
    let region = (PAGE_SIZE as u32) << (region % 5);
    let len = (u32::from_le_bytes([*l0, *l1, *l2, *l3]) as usize).min(rest.len());
    let (mut channel0, reconnect) = rest.split_at(len);

    let mut frame = Vec::new();
    if protocol::read_frame(&mut channel0, &mut frame)? != FrameKind::Postcopy {
        return Ok(Fed::default());
    }
    let start = PostcopyStart::decode(&frame, pages)?;
    let mem = Arc::new(memory::create(pages * PAGE_SIZE as u64, false).map_err(tsubame_vmm::VmError::from)?);
    let back: super::BackChannel = Arc::new(Mutex::new(Box::new(std::io::sink())));
    let held = vec![zero_page_hash(); pages as usize];
    let shared = PostcopyShared::start(mem, &start.missing, held, back, Duration::ZERO, None, false)?;
    let mut fed = Fed::default();
    let mut unpacker = Unpacker::default();
    let mut theirs = None;
    let mut frames = |from: &mut dyn Read, fed: &mut Fed| {
        while let Ok(kind) = protocol::read_frame(&mut *from, &mut frame) {
            match on_frame(&shared, kind, &frame, &mut unpacker, region) {
                Ok(Some(digest)) => theirs = Some(digest),
                Ok(None) => {}
                Err(why) => {
                    fed.failed = Some(why);
                    return;
                }
            }
        }
    };
    frames(&mut channel0, &mut fed);
    if fed.failed.is_none() && !reconnect.is_empty() {
        let mut peer = Peer(reconnect);
        match answer_resume(&shared, &mut peer, SESSION, URGENT_CHANNEL) {
            Ok(Answer::Channel0) => {
                fed.resume = Some("channel 0");
                frames(&mut peer, &mut fed);
            }
            Ok(Answer::Urgent) => {
                // The request connection carries page frames only.
                fed.resume = Some("urgent");
                while let Ok(kind) = protocol::read_frame(&mut peer, &mut frame) {
                    let installed = match kind {
                        FrameKind::PostcopyPages => shared.install_frame(&frame).map(drop),
                        FrameKind::PostcopyPagesCompressed => {
                            shared.install_compressed(&frame, &mut unpacker).map(drop)
                        }
                        _ => break,
                    };
                    if let Err(e) = installed {
                        fed.failed = Some(e.to_string());
                        break;
                    }
                }
            }
            Ok(Answer::Refused) => fed.resume = Some("refused"),
            Ok(Answer::Done) => fed.resume = Some("done"),
            Err(e) => fed.failed = Some(e.to_string()),
        }
    }
    fed.missing = shared.missing_now().count();
    if let Some(theirs) = theirs {
        fed.digest_matched = Some(fed.missing == 0 && theirs.differing(&shared.digest(region)).is_empty());
    }
    Ok(fed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::digest::{page_hash, region_hashes_by};
    use crate::protocol::pages::{Encoding, PagesBuilder};
    use crate::protocol::{Digest, Resume};
    use tsubame_vmm::DirtyBitmap;

    const PAGES: u64 = memory::MIN_MEMORY / PAGE_SIZE as u64;
    /// The digest's region: 4 KiB << 4.
    const REGION: u32 = 64 << 10;

    fn frame(kind: FrameKind, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        protocol::write_frame(&mut out, kind, payload).unwrap();
        out
    }

    /// POSTCOPY_PAGES with `records`: (page, Some(byte): a page of it, None: zeros).
    fn pages(records: &[(u64, Option<u8>)]) -> Vec<u8> {
        let mut b = PagesBuilder::new(records.len());
        b.reset(0, 0);
        for &(page, byte) in records {
            match byte {
                Some(byte) => b.push(page, Encoding::Raw, &[byte; PAGE_SIZE]),
                None => b.push(page, Encoding::Zero, &[]),
            }
        }
        frame(FrameKind::PostcopyPages, b.payload())
    }

    /// The digest of memory whose page p holds `contents(p)` everywhere.
    fn digest(contents: impl Fn(u64) -> u8) -> Vec<u8> {
        let hashes = region_hashes_by(PAGES as usize, REGION, |p| page_hash(&[contents(p as u64); PAGE_SIZE]));
        frame(FrameKind::Digest, &Digest { region: REGION, hashes }.encode())
    }

    /// Pages 1, 3 and 5 missing; 1 and 3 come on channel 0, which is cut;
    /// the source comes back (`channel` of `session`) with page 5 (of
    /// `byte`s) and the digest (of page 5 holding 0x5c).
    pub(crate) fn input(channel: u16, session: u64, byte: u8) -> Vec<u8> {
        let mut missing = DirtyBitmap::new(PAGES);
        for p in [1, 3, 5] {
            missing.set(p);
        }
        let start = PostcopyStart { last_iteration: None, timeout_ms: 1000, missing };
        let mut ch0 = frame(FrameKind::Postcopy, &start.encode());
        ch0.extend(pages(&[(1, Some(0xab)), (3, None)]));
        let mut again = Vec::new();
        protocol::write_preamble(&mut again, protocol::VERSION).unwrap();
        again.extend(frame(FrameKind::Resume, &Resume { session, channel }.encode()));
        again.extend(pages(&[(5, Some(byte))]));
        if channel == 0 {
            again.extend(digest(|p| match p {
                1 => 0xab,
                5 => 0x5c,
                _ => 0,
            }));
        }
        let mut data = vec![4];
        data.extend((ch0.len() as u32).to_le_bytes());
        data.extend(ch0);
        data.extend(again);
        data
    }

    #[test]
    fn a_cut_phase_resumes_and_every_page_arrives_and_matches() {
        let fed = feed(&input(0, SESSION, 0x5c)).unwrap();
        assert_eq!(fed, Fed { missing: 0, digest_matched: Some(true), resume: Some("channel 0"), failed: None });
    }

    #[test]
    fn the_request_connection_may_come_back_too() {
        let fed = feed(&input(URGENT_CHANNEL, SESSION, 0x5c)).unwrap();
        assert_eq!(fed, Fed { missing: 0, digest_matched: None, resume: Some("urgent"), failed: None });
    }

    #[test]
    fn another_session_is_refused_and_other_bytes_do_not_match() {
        let fed = feed(&input(0, SESSION, 0x5d)).unwrap();
        assert_eq!(fed.digest_matched, Some(false), "{fed:?}");
        let fed = feed(&input(0, SESSION + 1, 0x5c)).unwrap();
        assert_eq!((fed.resume, fed.missing), (Some("refused"), 1), "{fed:?}");
    }

    /// Writes the seeds of the fuzz target `postcopy_destination` into
    /// `$TSUBAME_WRITE_FUZZ_SEEDS` (fuzz/corpus/postcopy_destination).
    #[test]
    fn write_fuzz_seeds() {
        let Some(dir) = std::env::var_os("TSUBAME_WRITE_FUZZ_SEEDS") else { return };
        let dir = std::path::Path::new(&dir);
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("resume-channel0"), input(0, SESSION, 0x5c)).unwrap();
        std::fs::write(dir.join("resume-urgent"), input(URGENT_CHANNEL, SESSION, 0x5c)).unwrap();
        std::fs::write(dir.join("resume-refused"), input(0, SESSION + 1, 0x5c)).unwrap();
    }

    #[test]
    fn short_and_foreign_inputs_are_no_panic() {
        for data in [&[][..], &[1, 2, 3], &[0, 255, 255, 255, 255, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]] {
            let _ = feed(data);
        }
    }
}
