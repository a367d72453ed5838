//! Page codecs: pure functions and the caches they keep. No KVM, no I/O.
//!
//! Every per-page codec turns one 4 KiB page into a record no larger than
//! the page (or says it cannot, and the caller sends the page raw). Codecs
//! with a cache (`xbzrle`, `dedup`) have an encoder and a decoder that keep
//! identical caches as long as the decoder sees every page the encoder
//! saw, in the same order. `docs/codec-format.md` describes the bytes.

#![deny(missing_docs)]

pub mod batch;
pub mod chooser;
pub mod dedup;
mod error;
pub mod rle;
pub mod superfasthash;
mod varint;
pub mod xbzrle;
pub mod zero;

pub use chooser::{CodecList, CodecStats, Encoded, PageDecoder, PageEncoder};
pub use error::CodecError;

/// Bytes per page.
pub const PAGE: usize = 4096;
