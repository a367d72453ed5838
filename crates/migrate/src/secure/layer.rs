//! Both directions of a secured connection.

use std::sync::Mutex;

use super::psk::Keys;
use super::record::{Opener, Sealer};

/// Both directions of a secured connection; shared by its handles, each
/// direction under its own lock (one thread reads, another writes).
pub struct RecordLayer {
    /// Receiving side.
    pub rx: Mutex<Opener>,
    /// Sending side.
    pub tx: Mutex<Sealer>,
}

impl std::fmt::Debug for RecordLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RecordLayer(..)")
    }
}

impl RecordLayer {
    /// A channel for a pre-shared-key session's keys.
    pub fn new(keys: &Keys) -> RecordLayer {
        RecordLayer::from_halves(Opener::new(&keys.receive), Sealer::new(&keys.send))
    }

    /// A channel of two directions' states.
    pub fn from_halves(rx: Opener, tx: Sealer) -> RecordLayer {
        RecordLayer { rx: Mutex::new(rx), tx: Mutex::new(tx) }
    }
}
