//! The two ends as explicit state machines: which frames each state
//! accepts and where each leads. The source and the receiver drive their
//! work from these; a frame a state does not accept is an error naming
//! what the state waits for.
//!
//! ```text
//! Source                                  Receiver
//!   Setup ──HELLO/ACCEPT──> Iterating       Hello ──HELLO──> Iterating
//!   Iterating ──(stop)──> StopAndCopy       Iterating ──PAGES, ITERATION_END──> Iterating
//!   (DIGEST before the pause)                Iterating ──DIGEST──> Iterating (kept)
//!   StopAndCopy ──STATE, DIGEST──> Verifying Iterating ──STATE──> AwaitDigest
//!     (or DIGEST_UPDATE after a DIGEST)      AwaitDigest ──DIGEST or DIGEST_UPDATE──>
//!   Verifying ──MISMATCH──> Verifying          Ready | Repairing
//!   Verifying ──READY──> Committing          Repairing ──PAGES, ITERATION_END──> Repairing
//!   Committing ──RESUMED──> Completed        Repairing ──DIGEST──> Ready | Repairing
//!   any ──error──> Failed                    Ready ──COMMIT──> Committed
//!
//! Post-copy (the source switches instead of stopping):
//!   Iterating ──POSTCOPY_PREPARE──>           Iterating ──POSTCOPY_PREPARE──> Preparing
//!     PostcopyPrepare ──PREPARED──> (again)   Preparing ──POSTCOPY_PREPARE──> Preparing
//!   PostcopyPrepare ──POSTCOPY, STATE──>      Preparing ──POSTCOPY──> Switching
//!     Postcopy                                Iterating ──POSTCOPY──> Switching
//!   Postcopy ──PAGE_REQUEST*──> Postcopy      Switching ──STATE──> Postcopy (runs the VM)
//!   Postcopy ──(link cut)──> PostcopyPaused   Postcopy ──POSTCOPY_PAGES*, DIGEST──> Postcopy
//!   PostcopyPaused ──RESUME_ACK──> Postcopy   Postcopy ──(every page held)──> Committed
//!   Postcopy ──POSTCOPY_DONE──> Completed
//! ```

use serde::{Deserialize, Serialize};

use super::kind::{FrameKind, WireError};

/// Where a migrating source is; also the phase `query-migrate` and the
/// progress bar show.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum SourceState {
    /// Connecting, the handshake, HELLO and ACCEPT.
    #[default]
    #[serde(rename = "setup")]
    Setup,
    /// Pre-copy iterations while the guest runs.
    #[serde(rename = "iterating")]
    Iterating,
    /// Converged, letting the memory digest catch up before the pause.
    #[serde(rename = "hashing before the stop")]
    HashingBeforeStop,
    /// Post-copy is coming while the guest still runs here: the
    /// destination drops the pages that went stale (POSTCOPY_PREPARE),
    /// until few are left for the pause.
    #[serde(rename = "postcopy-prepare")]
    PostcopyPrepare,
    /// The guest is paused: last pages, STATE, DIGEST; waiting for READY
    /// (re-sending regions on MISMATCH).
    #[serde(rename = "stop-and-copy")]
    StopAndCopy,
    /// COMMIT is out: only the destination may run the VM now.
    #[serde(rename = "committing")]
    Committing,
    /// POSTCOPY is out: the destination runs the VM and is sent the pages
    /// it lacks, asked-for pages first; the VM never runs here again.
    #[serde(rename = "postcopy")]
    Postcopy,
    /// The post-copy link was cut: both ends wait for it to come back.
    #[serde(rename = "postcopy-paused")]
    PostcopyPaused,
    /// The destination runs the VM.
    #[serde(rename = "completed")]
    Completed,
    /// The migration failed (before COMMIT: the VM runs here again).
    #[serde(rename = "failed")]
    Failed,
}

impl SourceState {
    /// The frames the destination may send in this state.
    pub fn accepts(self, kind: FrameKind) -> bool {
        use FrameKind::*;
        matches!(
            (self, kind),
            (_, Error)
                | (SourceState::Setup, Accept)
                | (SourceState::Iterating, CaughtUp)
                | (SourceState::PostcopyPrepare, PostcopyPrepared)
                | (SourceState::StopAndCopy, Ready | Mismatch)
                | (SourceState::Committing, Resumed)
                | (SourceState::Postcopy, PostcopyRunning | PageRequest | PostcopyInstalled | PostcopyDone)
                | (SourceState::PostcopyPaused, ResumeAck)
        )
    }

    /// What the state waits for, for error messages.
    pub fn expects(self) -> &'static str {
        match self {
            SourceState::Setup => "ACCEPT",
            SourceState::Iterating => "CAUGHT_UP",
            SourceState::PostcopyPrepare => "POSTCOPY_PREPARED",
            SourceState::StopAndCopy => "READY or MISMATCH",
            SourceState::Committing => "RESUMED",
            SourceState::Postcopy => "POSTCOPY_RUNNING, PAGE_REQUEST, POSTCOPY_INSTALLED or POSTCOPY_DONE",
            SourceState::PostcopyPaused => "RESUME_ACK",
            _ => "nothing from the destination",
        }
    }

    /// Checks that the destination's `kind` fits this state.
    pub fn check(self, kind: FrameKind) -> Result<(), WireError> {
        if self.accepts(kind) {
            Ok(())
        } else {
            Err(WireError::Unexpected { got: kind, expected: self.expects() })
        }
    }
}

/// Where a receiving destination is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReceiverState {
    /// Waiting for HELLO.
    Hello,
    /// ACCEPT went out to a VM with far memory: FAR_MEMORY, then its
    /// FAR_PAGES.
    FarMap,
    /// Pre-copy: page frames and ITERATION_END until STATE.
    Iterating,
    /// STATE arrived; waiting for DIGEST.
    AwaitDigest,
    /// MISMATCH went out: repair pages, then the DIGEST again.
    Repairing,
    /// READY went out: waiting for COMMIT.
    Ready,
    /// POSTCOPY_PREPARE arrived: memory is registered for faults and its
    /// stale pages dropped; more of them, or POSTCOPY, come next.
    Preparing,
    /// POSTCOPY arrived: STATE comes next, then the VM runs here.
    Switching,
    /// Post-copy: the VM runs here while its missing pages arrive.
    Postcopy,
    /// COMMIT arrived (or post-copy holds every page): the VM runs here.
    Committed,
}

impl ReceiverState {
    /// The frames the source may send in this state (ERROR is always
    /// accepted: it ends the migration with the source's reason).
    pub fn accepts(self, kind: FrameKind) -> bool {
        use FrameKind::*;
        use ReceiverState as R;
        kind == Error
            || match self {
                R::Hello => kind == Hello,
                R::FarMap => matches!(kind, FarMemory | FarPages),
                R::Iterating => {
                    kind.carries_pages()
                        || matches!(
                            kind,
                            IterationEnd
                                | State
                                | Digest
                                | Postcopy
                                | PostcopyPrepare
                                | WarmBlocks
                                | DiskWritten
                                | WarmData
                        )
                }
                R::AwaitDigest => matches!(kind, Digest | DigestUpdate),
                // Repairs go out whole and plain (never compressed).
                R::Repairing => matches!(kind, Pages | IterationEnd | Digest),
                R::Ready => kind == Commit,
                R::Preparing => matches!(kind, PostcopyPrepare | Postcopy | DiskWritten),
                R::Switching => kind == State,
                R::Postcopy => matches!(kind, PostcopyPages | PostcopyPagesCompressed | Digest),
                R::Committed => false,
            }
    }

    /// What the state waits for, for error messages.
    pub fn expects(self) -> &'static str {
        match self {
            ReceiverState::Hello => "HELLO",
            ReceiverState::FarMap => "FAR_MEMORY or FAR_PAGES",
            ReceiverState::Iterating => {
                "PAGES, ITERATION_END, STATE, DIGEST, POSTCOPY_PREPARE, POSTCOPY or a disk frame"
            }
            ReceiverState::Preparing => "POSTCOPY_PREPARE, POSTCOPY or DISK_WRITTEN",
            ReceiverState::AwaitDigest => "DIGEST or DIGEST_UPDATE",
            ReceiverState::Repairing => "PAGES or DIGEST",
            ReceiverState::Ready => "COMMIT",
            ReceiverState::Switching => "STATE",
            ReceiverState::Postcopy => "POSTCOPY_PAGES or DIGEST",
            ReceiverState::Committed => "nothing (the VM runs here)",
        }
    }

    /// Checks that the source's `kind` fits this state.
    pub fn check(self, kind: FrameKind) -> Result<(), WireError> {
        if self.accepts(kind) {
            Ok(())
        } else {
            Err(WireError::Unexpected { got: kind, expected: self.expects() })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [FrameKind; 30] = [
        FrameKind::Hello,
        FrameKind::Accept,
        FrameKind::Pages,
        FrameKind::IterationEnd,
        FrameKind::State,
        FrameKind::Digest,
        FrameKind::Ready,
        FrameKind::Commit,
        FrameKind::Resumed,
        FrameKind::Error,
        FrameKind::Mismatch,
        FrameKind::PagesCompressed,
        FrameKind::Channel,
        FrameKind::PagesZeroCopy,
        FrameKind::Postcopy,
        FrameKind::PostcopyRunning,
        FrameKind::PageRequest,
        FrameKind::PostcopyPages,
        FrameKind::PostcopyDone,
        FrameKind::Resume,
        FrameKind::ResumeAck,
        FrameKind::WarmBlocks,
        FrameKind::DiskWritten,
        FrameKind::WarmData,
        FrameKind::PostcopyPrepare,
        FrameKind::PostcopyPrepared,
        FrameKind::PostcopyPagesCompressed,
        FrameKind::DigestUpdate,
        FrameKind::PostcopyInstalled,
        FrameKind::CaughtUp,
    ];

    #[test]
    fn receiver_accepts_only_its_frames() {
        use ReceiverState as R;
        let accepted = |s: R| ALL.iter().filter(|&&k| s.accepts(k)).count();
        assert_eq!(accepted(R::Hello), 2);
        assert_eq!(accepted(R::Iterating), 12);
        assert_eq!(accepted(R::AwaitDigest), 3);
        assert!(!R::Repairing.accepts(FrameKind::DigestUpdate));
        assert_eq!(accepted(R::Preparing), 4);
        assert_eq!(accepted(R::Postcopy), 4);
        assert_eq!(accepted(R::Repairing), 4);
        assert_eq!(accepted(R::Committed), 1);
        assert!(R::Iterating.check(FrameKind::Commit).unwrap_err().to_string().contains("STATE"));
        assert!(!R::Repairing.accepts(FrameKind::PagesCompressed));
        assert!(!R::Ready.accepts(FrameKind::Pages));
    }

    #[test]
    fn source_accepts_only_its_replies() {
        assert!(SourceState::Setup.accepts(FrameKind::Accept));
        assert!(!SourceState::Iterating.accepts(FrameKind::Ready));
        assert!(SourceState::StopAndCopy.accepts(FrameKind::Mismatch));
        assert!(SourceState::Postcopy.accepts(FrameKind::PostcopyInstalled));
        assert!(!ReceiverState::Postcopy.accepts(FrameKind::PostcopyInstalled));
        assert!(SourceState::Iterating.accepts(FrameKind::CaughtUp));
        assert!(!SourceState::StopAndCopy.accepts(FrameKind::CaughtUp));
        assert!(!ReceiverState::Iterating.accepts(FrameKind::CaughtUp));
        assert!(SourceState::Committing.check(FrameKind::Ready).is_err());
        assert!(ALL.iter().all(|&k| k != FrameKind::Error || SourceState::Completed.accepts(k)));
    }

    #[test]
    fn phases_serialize_as_before() {
        let names: Vec<String> = [
            SourceState::Setup,
            SourceState::Iterating,
            SourceState::HashingBeforeStop,
            SourceState::StopAndCopy,
            SourceState::Committing,
            SourceState::Postcopy,
            SourceState::PostcopyPaused,
            SourceState::Completed,
            SourceState::Failed,
        ]
        .iter()
        .map(|s| serde_json::to_string(s).unwrap())
        .collect();
        assert_eq!(
            names,
            [
                "\"setup\"",
                "\"iterating\"",
                "\"hashing before the stop\"",
                "\"stop-and-copy\"",
                "\"committing\"",
                "\"postcopy\"",
                "\"postcopy-paused\"",
                "\"completed\"",
                "\"failed\""
            ]
        );
    }
}
