//! What a frame carries ([`FrameKind`]) and what can be wrong with bytes
//! off the wire ([`WireError`]): the vocabulary every other part of the
//! protocol speaks.

/// First 8 bytes of every plain stream, in both directions.
pub const MAGIC: [u8; 8] = *b"TSBMIGR\0";
/// First 8 bytes of a secure handshake (docs/security.md).
pub const SECURE_MAGIC: [u8; 8] = *b"TSBSEC1\0";
/// Version of this format; both ends must speak the same (3 added
/// post-copy: HELLO's flags and the post-copy frames; 4 the disk: its
/// state in STATE's `VmState`, WARM_BLOCKS and DISK_WRITTEN; 5 far
/// memory: FAR_MEMORY, FAR_PAGES, and the digest's page hash became the
/// low half of xxh3-128, what far memory keeps of each far copy; 6
/// POSTCOPY_PREPARE and POSTCOPY_PREPARED: the destination drops stale
/// pages while the guest still runs at the source; and
/// POSTCOPY_PAGES_COMPRESSED; 7 DIGEST before the pause and
/// DIGEST_UPDATE after it; 8 the raw run; 9 POSTCOPY_PAGES_COMPRESSED on
/// the request connection too; 10 POSTCOPY_INSTALLED; 11 CAUGHT_UP).
pub const VERSION: u32 = 11;
/// Largest frame payload accepted.
pub const MAX_PAYLOAD: usize = 16 << 20;

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
    /// vCPU and device state (`VmState`, crates/vmm/src/persist.rs).
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
    /// Post-copy starts: the source paused its VM; the pages the
    /// destination lacks follow, then STATE, and the destination runs the
    /// VM without them.
    Postcopy = 15,
    /// The destination runs the VM (post-copy): the source never may again.
    PostcopyRunning = 16,
    /// Pages a guest faulted on at the destination: send these first.
    PageRequest = 17,
    /// Post-copy pages: a PAGES payload of raw, raw-run and zero records
    /// only, to be installed by whichever channel carries it.
    PostcopyPages = 18,
    /// The destination holds every page; how the digest compared.
    PostcopyDone = 19,
    /// First frame of a reconnection after a cut post-copy link.
    Resume = 20,
    /// The destination knows the session: the pages it still lacks.
    ResumeAck = 21,
    /// Blocks of the source's disk cache, hottest first: the destination
    /// reads them from the shared storage before the VM arrives.
    WarmBlocks = 22,
    /// Blocks the guest wrote since WARM_BLOCKS: their early copies are
    /// stale.
    DiskWritten = 23,
    /// Contents of blocks named in WARM_BLOCKS, from the source's cache.
    WarmData = 24,
    /// The VM has far memory: its exports and local limit.
    FarMemory = 25,
    /// A run of the far-page bitmap, with each far copy's hash.
    FarPages = 26,
    /// Post-copy is coming, the guest still runs at the source: the
    /// destination registers its memory for faults and drops these pages
    /// (a POSTCOPY payload); sent once or more before POSTCOPY.
    PostcopyPrepare = 27,
    /// The destination dropped the pages of the last POSTCOPY_PREPARE.
    PostcopyPrepared = 28,
    /// A POSTCOPY_PAGES payload compressed by lz4 or zstd (the background
    /// push's, while compressing pays).
    PostcopyPagesCompressed = 29,
    /// The regions whose hashes changed since a DIGEST sent before the
    /// pause: with it, the destination's expected digest.
    DigestUpdate = 30,
    /// How many pages of the push the destination took in so far: the
    /// source keeps the push's lead over the installs short.
    PostcopyInstalled = 31,
    /// In reply to a DIGEST sent before the pause: every page sent before
    /// it is written and hashed.
    CaughtUp = 32,
}

impl FrameKind {
    /// The kind with this number, if there is one (0 is never valid).
    pub fn from_u16(v: u16) -> Option<FrameKind> {
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
            15 => Postcopy,
            16 => PostcopyRunning,
            17 => PageRequest,
            18 => PostcopyPages,
            19 => PostcopyDone,
            20 => Resume,
            21 => ResumeAck,
            22 => WarmBlocks,
            23 => DiskWritten,
            24 => WarmData,
            25 => FarMemory,
            26 => FarPages,
            27 => PostcopyPrepare,
            28 => PostcopyPrepared,
            29 => PostcopyPagesCompressed,
            30 => DigestUpdate,
            31 => PostcopyInstalled,
            32 => CaughtUp,
            _ => return None,
        })
    }

    /// True for the three frames that carry page records.
    pub fn carries_pages(self) -> bool {
        matches!(self, FrameKind::Pages | FrameKind::PagesCompressed | FrameKind::PagesZeroCopy)
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

impl WireError {
    /// A field outside its range.
    pub fn bad(field: &'static str, detail: impl Into<String>) -> WireError {
        WireError::BadField { field, detail: detail.into() }
    }
}

/// True when `first` (a connection's first bytes) starts a TLS ClientHello
/// record: a TLS peer talking to a plain or pre-shared-key end.
pub fn is_tls_client_hello(first: &[u8]) -> bool {
    // Record type 22 (handshake), legacy version 3.0 to 3.4.
    first.len() >= 3 && first[0] == 0x16 && first[1] == 0x03 && first[2] <= 0x04
}
