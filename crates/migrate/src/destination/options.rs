//! What a receiver may insist on.

use std::time::Duration;

/// What the receiver may insist on.
#[derive(Debug, Clone)]
pub struct ReceiveOptions {
    /// Refuse a VM whose memory size differs.
    pub expect_memory: Option<u64>,
    /// Give up when the source is silent this long.
    pub io_timeout: Duration,
    /// Back guest memory with transparent huge pages.
    pub hugepages: bool,
    /// What the source's extra channels must pass (channel 0 is
    /// protected by whoever accepted it).
    pub security: crate::transport::Security,
    /// Frame bytes held at once across all channels and decoders; a peer
    /// that sends faster than they decode waits (docs/security.md).
    pub in_flight_limit: usize,
}

impl Default for ReceiveOptions {
    fn default() -> Self {
        ReceiveOptions {
            expect_memory: None,
            io_timeout: Duration::from_secs(30),
            hugepages: true,
            security: Default::default(),
            in_flight_limit: crate::buffer_budget::IN_FLIGHT_LIMIT,
        }
    }
}
