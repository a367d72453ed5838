//! What a receive keeps until the source heard that the VM runs here.

use std::io::Read;

use super::dispatch::Dispatcher;
use crate::digest::BackgroundDigest;

/// What a receive frees once the source heard that the VM runs: the
/// digest's tables (megabytes), channel 0's dispatcher and the one
/// channel's decoders, to join.
/// Done before READY or RESUMED, it took about a millisecond of the
/// downtime.
pub(super) struct Leftovers {
    pub(super) _digest: Option<BackgroundDigest>,
    /// Channel 0's dispatcher: dropping it frees its pool of frame
    /// buffers and ends the decoders it feeds, which free theirs (0.8-1.3
    /// ms of a bwmem guest's verify).
    pub(super) main: Option<Dispatcher>,
    pub(super) decoders: Vec<std::thread::JoinHandle<()>>,
    /// Channel 0's reader and the last frame's buffer, freed after
    /// RESUMED: freeing them once the vCPU ran took ~0.08 ms of the
    /// 0.2-0.3 ms from its start to RESUMED (timed, 3 runs against 7).
    pub(super) _buffers: Option<(Box<dyn Read + Send>, Vec<u8>)>,
    /// The digests compared in the stop: unmapping their memory at once
    /// took ~0.04 ms of a 4 GiB guest's.
    pub(super) _hashes: Option<[Vec<u64>; 2]>,
}

impl Drop for Leftovers {
    fn drop(&mut self) {
        // With one channel its decoders end once their queues close.
        drop(self.main.take());
        for decoder in self.decoders.drain(..) {
            let _ = decoder.join();
        }
    }
}
