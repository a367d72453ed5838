//! The far copies: one export, or two mirrored. Every write goes to each
//! live export; a read comes from the first live one. An export that fails
//! once is dropped for good (its copy may now be stale) and reported; with
//! none left, far memory is lost.

use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use tsubame_block::{Backend, DiskSpec};

use crate::FarError;

/// What is known about one export.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct StoreStatus {
    /// As given on the command line.
    pub uri: String,
    /// False once a read or write failed.
    pub ok: bool,
    /// The failure, if any.
    pub error: Option<String>,
}

/// Shared between the fault side and the write-back side, so both stop
/// using an export the moment either sees it fail.
pub(crate) type Health = Arc<Mutex<Vec<StoreStatus>>>;

/// One connection to each export (a side's own: reads and writes do not
/// wait for each other).
pub(crate) struct Stores {
    conns: Vec<Box<dyn Backend>>,
    health: Health,
}

impl Stores {
    /// Opens every export and checks it can hold `bytes`.
    pub(crate) fn open(specs: &[DiskSpec], bytes: u64, health: Health) -> Result<Stores, FarError> {
        let mut conns = Vec::new();
        for spec in specs {
            let conn = tsubame_block::open(spec).map_err(|e| FarError::Store(spec.to_string(), e.to_string()))?;
            if conn.size() < bytes {
                return Err(FarError::TooSmall { uri: spec.to_string(), size: conn.size(), needed: bytes });
            }
            conns.push(conn);
        }
        Ok(Stores { conns, health })
    }

    fn fail(&self, index: usize, error: String) {
        let mut health = self.health.lock().unwrap();
        if health[index].ok {
            health[index].ok = false;
            health[index].error = Some(error);
        }
    }

    fn alive(&self, index: usize) -> bool {
        self.health.lock().unwrap()[index].ok
    }

    /// The error that ended the last export, once none is left.
    fn lost(&self) -> FarError {
        let health = self.health.lock().unwrap();
        let why: Vec<String> =
            health.iter().map(|s| format!("{}: {}", s.uri, s.error.as_deref().unwrap_or("unknown"))).collect();
        FarError::Lost(why.join("; "))
    }

    /// Reads `buf` from `offset` of the first live export whose bytes pass
    /// `check` (each far page against the hash taken when it went away): an
    /// export that returns something else is dropped like a failed one, and
    /// the next is read.
    pub(crate) fn read_checked(
        &mut self,
        offset: u64,
        buf: &mut [u8],
        check: &dyn Fn(&[u8]) -> bool,
    ) -> Result<(), FarError> {
        for i in 0..self.conns.len() {
            if !self.alive(i) {
                continue;
            }
            match self.conns[i].read_at(offset, buf) {
                Ok(()) if check(buf) => return Ok(()),
                Ok(()) => self.fail(i, "it returned a page that differs from what was written there".into()),
                Err(e) => self.fail(i, e.to_string()),
            }
        }
        Err(self.lost())
    }

    /// Writes `data` at `offset` of every live export; succeeds while at
    /// least one took it.
    pub(crate) fn write(&mut self, offset: u64, data: &[u8]) -> Result<(), FarError> {
        let mut written = false;
        for i in 0..self.conns.len() {
            if !self.alive(i) {
                continue;
            }
            match self.conns[i].write_at(offset, data) {
                Ok(()) => written = true,
                Err(e) => self.fail(i, e.to_string()),
            }
        }
        if written {
            Ok(())
        } else {
            Err(self.lost())
        }
    }
}
