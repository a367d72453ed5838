//! Page codecs: pure functions and the caches they keep. No KVM, no I/O.
//!
//! Every per-page codec turns one 4 KiB page into a record smaller than
//! the page, or says it cannot and the caller sends the page raw (the
//! overflow case; a dedup record may exceed the page by its 2-byte
//! header). Codecs with a cache (`xbzrle`, `dedup`) have an encoder and a
//! decoder that keep identical caches as long as the decoder sees every
//! page the encoder saw, in the same order, including the pages sent raw
//! or as zeros (`observe`, `observe_zero`). [`chooser`] picks a codec per
//! page and switches codecs off while they do not pay; [`batch`]
//! compresses whole batches with lz4 or zstd. `docs/codec-format.md`
//! describes the bytes.
//!
//! Decoders treat their input as hostile: they return a [`CodecError`],
//! never panic, and allocate nothing sized by the input (batch
//! decompression is bounded by the caller's cap).

#![deny(missing_docs)]

pub mod batch;
pub mod chooser;
mod codec_list;
pub mod dedup;
mod error;
mod payoff;
pub mod rle;
pub mod superfasthash;
mod varint;
pub mod xbzrle;
pub mod zero;

pub use chooser::{Codec, CodecStats, PageDecoder, PageEncoder, StatsTable};
pub use codec_list::{CodecList, DEFAULT_DEDUP_CACHE, DEFAULT_XBZRLE_CACHE};
pub use error::CodecError;

/// Bytes per page.
pub const PAGE_SIZE: usize = 4096;

/// Record tag: the page as it is (4096 bytes).
pub const TAG_RAW: u8 = 0;
/// Record tag: the page is all zeros (no bytes).
pub const TAG_ZERO: u8 = 1;
/// Tag 2 is the migration stream's sub-page record, not a codec's.
pub const TAG_RESERVED_SUBPAGE: u8 = 2;
/// Record tag: a GM-RLE record ([`rle`]).
pub const TAG_RLE: u8 = 3;
/// Record tag: an XBZRLE record against the page cache ([`xbzrle`]).
pub const TAG_XBZRLE: u8 = 4;
/// Record tag: a dedup record against the chunk cache ([`dedup`]).
pub const TAG_DEDUP: u8 = 5;

/// What to send for a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoded {
    /// A zero record ([`TAG_ZERO`], no bytes).
    Zero,
    /// The page as it is ([`TAG_RAW`]).
    Raw,
    /// A codec record with this tag; its bytes are in the output buffer.
    Record(u8),
}

impl Encoded {
    /// The record tag.
    pub fn tag(self) -> u8 {
        match self {
            Encoded::Zero => TAG_ZERO,
            Encoded::Raw => TAG_RAW,
            Encoded::Record(tag) => tag,
        }
    }
}

/// The sending side of a per-page codec (one codec, or the chooser).
pub trait EncodePage {
    /// Encodes page `index`; a record's bytes go into `out` (cleared
    /// first, reused across calls).
    fn encode(&mut self, index: u64, page: &[u8; PAGE_SIZE], out: &mut Vec<u8>) -> Encoded;
    /// The caller sent this page raw without `encode` (a repair, say).
    fn observe_raw(&mut self, _index: u64, _page: &[u8; PAGE_SIZE]) {}
    /// The caller sent this page as a zero record without `encode`.
    fn observe_zero(&mut self, _index: u64) {}
}

/// The receiving side of a per-page codec. Raw and zero records are the
/// caller's, but it must report them here in stream order.
pub trait DecodePage {
    /// Decodes a record with `tag` of page `index` into `out`.
    fn decode(&mut self, index: u64, tag: u8, input: &[u8], out: &mut [u8; PAGE_SIZE]) -> Result<(), CodecError>;
    /// A raw page arrived.
    fn observe(&mut self, _index: u64, _page: &[u8; PAGE_SIZE]) {}
    /// A zero record arrived.
    fn observe_zero(&mut self, _index: u64) {}
}
