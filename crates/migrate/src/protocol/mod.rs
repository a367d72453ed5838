//! The migration protocol, the one module both ends import: the framing,
//! every message with its encoder and decoder side by side, the page
//! record layout, the shard layout, and the two ends' states.
//! docs/stream-format.md describes the bytes; docs/architecture.md where
//! each part lives.
//!
//! ```text
//! source                                   destination
//!   | preamble (magic, version)  --->         |
//!   |         <---  preamble (magic, version) |
//!   | HELLO (memory, page size, options) -->  |  checks, creates the VM
//!   |         <---  ACCEPT | ERROR            |
//!   | (channels 1..N: preamble, CHANNEL)      |
//!   | PAGES ... ITERATION_END  (xN)  --->     |  writes pages
//!   | [pause] PAGES ... STATE DIGEST --->     |  verifies memory digest
//!   |         <---  MISMATCH (regions)        |  (at most MAX_REPAIR_ROUNDS)
//!   | PAGES ... ITERATION_END DIGEST --->     |
//!   |         <---  READY | ERROR             |
//!   | COMMIT  --->                            |  restores state, resumes
//!   |         <---  RESUMED                   |
//! ```
//!
//! The states of each end and the frames each accepts are in [`state`].
//! What comes next lands here as new frame kinds, messages and states:
//! post-copy (a return path carrying page requests, the switch with the
//! set of stale pages, the background push, a "holds every page" reply,
//! reconnecting a cut link), far memory (the map of pages that live on a
//! memory host), and warm storage caches (the source's hot block list).

pub mod disk;
pub mod far;
pub mod fields;
pub mod frame;
pub mod kind;
pub mod limits;
pub mod messages;
pub mod pages;
pub mod postcopy;
pub mod shard;
pub mod state;

pub use disk::{DiskWritten, WarmBlocks, WarmData};
pub use fields::Fields;
pub use frame::{
    frame_header, parse_header, read_frame, read_frame_reserving, read_preamble, write_frame, write_preamble,
    zero_copy_frame_header, FRAME_HEADER_LEN, PREAMBLE_LEN,
};
pub use kind::{FrameKind, WireError, MAGIC, MAX_PAYLOAD, SECURE_MAGIC, VERSION};
pub use limits::{check_granularity, MAX_CHANNELS, MAX_REPAIR_ROUNDS, MAX_SHARDS};
pub use messages::{
    ChannelOpen, Digest, DigestUpdate, ErrorMessage, Hello, IterationEnd, Mismatch, Resumed, HELLO_FAR_MEMORY,
    HELLO_POSTCOPY,
};
pub use postcopy::{
    PageRequest, PostcopyDone, PostcopyInstalled, PostcopyRunning, PostcopyStart, Resume, ResumeAck, MAX_REQUEST,
};
pub use shard::{shard_codecs, ShardLayout};
pub use state::{ReceiverState, SourceState};
