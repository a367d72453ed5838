//! Per-region hashes of guest memory: the source sends them at
//! stop-and-copy, the destination compares before it says READY.

mod background;
mod incremental;

pub use background::{BackgroundDigest, DigestFeed};
pub use incremental::{
    far_copy_hash, memory_digest, page_hash, page_hash_cost, region_hashes, region_hashes_by, zero_page_hash,
    FarPageHashes, IncrementalDigest, DEFAULT_REGION,
};

/// Pages' hashes a reader hands to the digest at a time (each hand-over
/// wakes its thread). A reader's last few may never be handed over: the
/// digest then reads those pages itself.
pub const HASHES_HANDED: usize = 4096;
