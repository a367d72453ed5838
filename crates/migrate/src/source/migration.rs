//! One migration in progress as every phase sees it: the VM and its
//! options, what the migration reports (progress, statistics, its state),
//! and what the source knows of the guest's pages from one phase to the
//! next (the digest, the far map, the pages the destination may hold).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tsubame_farmem::{FarMemory, FarStats};
use tsubame_vmm::DirtyBitmap;

use super::error::SourceError;
use super::fetch::FarFilter;
use super::vm::SourceVm;
use crate::digest::{self, FarPageHashes};
use crate::options::{MigrateOptions, ProgressCell};
use crate::protocol::far::FarMemory as FarMemoryFrame;
use crate::protocol::SourceState;
use crate::stats::MigrationStats;

/// One migration in progress: what every phase reads and reports to.
pub(super) struct Migration<'a> {
    pub(super) vm: &'a dyn SourceVm,
    pub(super) options: &'a MigrateOptions,
    pub(super) progress: &'a ProgressCell,
    pub(super) stats: MigrationStats,
    pub(super) state: SourceState,
    pub(super) start: Instant,
    /// The memory digest, hashed as pages go rather than during downtime.
    pub(super) digest: Option<digest::BackgroundDigest>,
    /// The VM's far memory map, if it has far memory.
    pub(super) far: Option<FarMap>,
    /// Pages the destination may hold other than zeros (sent with data
    /// last): a zero page outside it needs no record at all.
    pub(super) held_nonzero: DirtyBitmap,
}

/// A far-memory VM's map, taken when the migration started: pages that
/// live far are not sent (unless they come back and change).
pub(super) struct FarMap {
    /// The map's header as FAR_MEMORY carries it.
    pub(super) frame: FarMemoryFrame,
    /// The far pages and their hashes.
    pub(super) pages: Arc<FarPageHashes>,
    /// What the fetcher skips of it.
    pub(super) filter: Arc<FarFilter>,
    /// Far memory's counters when the map was taken.
    pub(super) start: FarStats,
}

impl FarMap {
    /// Takes `far`'s map: its eviction stops for the migration.
    pub(super) fn hand_over(far: &FarMemory) -> Result<FarMap, SourceError> {
        let map = far.hand_over().map_err(|e| SourceError::FarMemory(e.to_string()))?;
        let start = far.stats();
        let frame = FarMemoryFrame { local_bytes: map.local_bytes, far_pages: map.far.count(), stores: map.stores };
        let pages = Arc::new(FarPageHashes { far: map.far, hashes: map.hashes });
        let filter = Arc::new(FarFilter::new(pages.clone()));
        Ok(FarMap { frame, pages, filter, start })
    }
}

impl Migration<'_> {
    /// Moves to `state`, which the progress bar and `query-migrate` show.
    pub(super) fn enter(&mut self, state: SourceState) {
        self.state = state;
        self.progress.update(|p| p.phase = state);
    }

    /// True once COMMIT went out: from then on only the destination may
    /// run the VM.
    pub(super) fn committed(&self) -> bool {
        matches!(
            self.state,
            SourceState::Committing | SourceState::Completed | SourceState::Postcopy | SourceState::PostcopyPaused
        )
    }

    /// Pauses the VM for the switch, noting when on the host's monotonic
    /// clock (for traces) and on the Unix clock (the vCPU's own stop, which
    /// the harness lines up with the destination's resume).
    pub(super) fn pause_vm(&mut self) -> Result<(), SourceError> {
        self.stats.paused_at_monotonic_s = tsubame_vmm::cpu_time::monotonic_seconds();
        self.vm.pause_for_state()?;
        self.stats.paused_at_unix_us = self.vm.paused_at_unix_us();
        Ok(())
    }

    /// The far pages' filter, with far memory.
    pub(super) fn far_filter(&self) -> Option<&Arc<FarFilter>> {
        self.far.as_ref().map(|far| &far.filter)
    }

    /// The source's digest, started (every page to hash) the first time.
    pub(super) fn digest(&mut self) -> &digest::BackgroundDigest {
        let vm = self.vm;
        self.digest.get_or_insert_with(|| {
            let far = self.far.as_ref().map(|far| far.pages.clone());
            digest::BackgroundDigest::start(vm.memory().clone(), self.options.digest_region, far)
        })
    }

    /// Hands the pages just sent to the digest thread, which hashes them
    /// while the next iteration runs — unless the fetch `hashed` them
    /// already; those the fetch found all zeros (`zeros`, of the same
    /// send) it need not read.
    pub(super) fn refresh_digest(&mut self, sent: &DirtyBitmap, zeros: DirtyBitmap, hashed: bool) {
        let read = if hashed { DirtyBitmap::new(sent.pages()) } else { sent.clone() };
        self.digest().mark_read(read, Some(zeros));
    }
}

/// A duration in milliseconds, as the statistics give them.
pub(super) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
