//! Everything the destination parses from the network before using it:
//! the preamble, frame headers with their CRC, and each payload kind.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tsubame_migrate::protocol::{
    self as wire, pages, ChannelOpen, Digest, DigestUpdate, IterationEnd, Mismatch, PageRequest, PostcopyDone, PostcopyInstalled, PostcopyRunning,
    PostcopyStart, Resume, ResumeAck, Resumed,
};

/// Pages of the memory the post-copy parsers are asked about (4 MiB).
const PAGES: u64 = 1024;

fuzz_target!(|data: &[u8]| {
    let mut input = data;
    let _ = wire::read_preamble(&mut input);
    let mut buf = Vec::new();
    // Frames as they come, CRC and all.
    let mut frames = data;
    for _ in 0..8 {
        let Ok(kind) = wire::read_frame(&mut frames, &mut buf) else { break };
        parse(kind, &buf);
    }
    // And every payload parser on the raw bytes (the CRC would stop most
    // mutations before them otherwise).
    for kind in [
        wire::FrameKind::Hello,
        wire::FrameKind::Pages,
        wire::FrameKind::Digest,
        wire::FrameKind::DigestUpdate,
        wire::FrameKind::Mismatch,
        wire::FrameKind::Channel,
        wire::FrameKind::IterationEnd,
        wire::FrameKind::Resumed,
        wire::FrameKind::Postcopy,
        wire::FrameKind::PostcopyRunning,
        wire::FrameKind::PostcopyInstalled,
        wire::FrameKind::PageRequest,
        wire::FrameKind::PostcopyPages,
        wire::FrameKind::PostcopyDone,
        wire::FrameKind::Resume,
        wire::FrameKind::ResumeAck,
        wire::FrameKind::WarmBlocks,
        wire::FrameKind::DiskWritten,
        wire::FrameKind::WarmData,
        wire::FrameKind::FarMemory,
        wire::FrameKind::FarPages,
    ] {
        parse(kind, data);
    }
});

fn parse(kind: wire::FrameKind, payload: &[u8]) {
    match kind {
        wire::FrameKind::Hello => {
            let _ = wire::Hello::decode(payload);
        }
        wire::FrameKind::Pages | wire::FrameKind::PostcopyPages => {
            for granularity in [128, 4096] {
                let _ = pages::for_each_record(payload, 1 << 18, granularity, |r| {
                    if r.encoding == pages::Encoding::Subpage {
                        pages::for_each_subpage(r.data, granularity, |_, _| {});
                    }
                    Ok(())
                });
            }
        }
        wire::FrameKind::Digest => {
            let _ = Digest::decode(payload, 1 << 20, 64).map(|d| d.differing(&[0u64; 64]));
        }
        wire::FrameKind::DigestUpdate => {
            let _ = DigestUpdate::decode(payload, 1 << 20, 64).map(|d| d.apply(vec![0u64; 64]));
        }
        wire::FrameKind::Mismatch => {
            let _ = Mismatch::decode(payload, 1 << 16);
        }
        wire::FrameKind::Channel => {
            let _ = ChannelOpen::decode(payload);
        }
        wire::FrameKind::IterationEnd => {
            let _ = IterationEnd::decode(payload);
        }
        wire::FrameKind::Resumed => {
            let _ = Resumed::decode(payload);
        }
        wire::FrameKind::Postcopy | wire::FrameKind::PostcopyPrepare => {
            let _ = PostcopyStart::decode(payload, PAGES);
        }
        wire::FrameKind::PostcopyInstalled => {
            let _ = PostcopyInstalled::decode(payload);
        }
        wire::FrameKind::PostcopyRunning => {
            let _ = PostcopyRunning::decode(payload);
        }
        wire::FrameKind::PageRequest => {
            let _ = PageRequest::decode(payload, PAGES);
        }
        wire::FrameKind::PostcopyDone => {
            let _ = PostcopyDone::decode(payload);
        }
        wire::FrameKind::Resume => {
            let _ = Resume::decode(payload);
        }
        wire::FrameKind::ResumeAck => {
            let _ = ResumeAck::decode(payload, PAGES);
        }
        wire::FrameKind::WarmBlocks => {
            let _ = wire::WarmBlocks::decode(payload);
        }
        wire::FrameKind::DiskWritten => {
            let _ = wire::DiskWritten::decode(payload, 1 << 30);
        }
        wire::FrameKind::WarmData => {
            let _ = wire::WarmData::decode(payload, 1 << 30);
        }
        wire::FrameKind::FarMemory => {
            let _ = wire::far::FarMemory::decode(payload, PAGES * 4096);
        }
        wire::FrameKind::FarPages => {
            // A page count that is not whole words, too.
            let _ = wire::far::FarPages::decode(payload, PAGES - 3);
        }
        _ => {}
    }
}
