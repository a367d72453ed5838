//! The sending side: connect, pre-copy iterations while the guest runs,
//! then stop-and-copy, verify, commit (or hand over to post-copy). The
//! phases are values (`precopy::Precopy`, `stop::Stop`,
//! `postcopy::Postcopy`) that take the migration's shared state
//! (`migration::Migration`) and its link (`link::Link`) and return what
//! comes next; `run` strings them together in the order of the sequence
//! diagram in `protocol/mod.rs`. docs/architecture.md follows a page
//! through these files: `precopy` decides what to send, `iteration`
//! walks the dirty set, [`fetch`] reads each page, [`encode`] and
//! [`send`] (run by [`engine`]) put it on the wire, `stop` ends the
//! migration.
//!
//! The VM is never lost: any failure before COMMIT is written resumes the
//! source VM; once COMMIT is written the source never resumes on its own.

pub mod busy;
pub mod choices;
pub mod encode;
pub mod engine;
pub mod error;
pub mod fetch;
pub mod handover;
mod iteration;
mod link;
mod migration;
mod pack;
pub mod policy;
mod postcopy;
mod precopy;
pub mod send;
mod stop;
mod threads;
pub mod vm;
mod warm;
pub mod zerocopy;

use std::time::Instant;

use tsubame_farmem::{FarMemory, FarStats};
use tsubame_vmm::{memory, DirtyBitmap, VcpuStatus, Vm};

pub use error::{PipelineError, SourceError};
pub use vm::SourceVm;

use self::fetch::FarFilter;
use self::link::Link;
use self::migration::{ms, FarMap, Migration};
use self::precopy::{Precopy, PrecopyEnd};
use crate::options::{Granularity, MigrateOptions, ProgressCell};
use crate::protocol::{ShardLayout, SourceState, WireError};
use crate::stats::{process_cpu_seconds, thread_cpu_seconds, FarMigrationStats, MigrationStats, Status};
use crate::transport::Address;

/// Migrates `vm` to `to`. Always returns statistics; `status` says
/// whether it worked. On failure before commit the VM runs again here.
pub fn migrate(vm: &dyn SourceVm, to: &Address, options: &MigrateOptions, progress: &ProgressCell) -> MigrationStats {
    migrate_with(vm, None, to, options, progress)
}

/// Migrates a VM with far memory: only its resident pages move, and the
/// map of the pages that live on its memory hosts, which the destination
/// attaches to (eviction stops here for the migration; on failure it goes
/// on, and after commit this side never writes to the exports again).
pub fn migrate_far(
    vm: &Vm,
    far: &FarMemory,
    to: &Address,
    options: &MigrateOptions,
    progress: &ProgressCell,
) -> MigrationStats {
    migrate_with(vm, Some(far), to, options, progress)
}

fn migrate_with(
    vm: &dyn SourceVm,
    far: Option<&FarMemory>,
    to: &Address,
    options: &MigrateOptions,
    progress: &ProgressCell,
) -> MigrationStats {
    let start = Instant::now();
    let cpu_process = process_cpu_seconds();
    let cpu_thread = thread_cpu_seconds();
    let granularity = options.start_granularity();
    let mut migration = Migration {
        vm,
        options,
        progress,
        stats: MigrationStats {
            destination: to.to_string(),
            memory_bytes: vm.memory_bytes(),
            pages_total: memory::page_count(vm.memory()),
            choices: choices::initial_choices(options, granularity),
            downtime_limit_ms: ms(options.downtime_limit),
            ..Default::default()
        },
        state: SourceState::Setup,
        start,
        digest: None,
        far: None,
        held_nonzero: DirtyBitmap::new(memory::page_count(vm.memory())),
    };
    let mut precopy = Precopy::new();
    // Set once connecting begins.
    let mut link = None;
    progress.update(|p| {
        p.phase = SourceState::Setup;
        p.memory_bytes = vm.memory_bytes();
    });
    let result = run(&mut migration, &mut link, &mut precopy, far, to, granularity);
    // Before a failure's take_back: eviction would make pages far again.
    if let (Some(far), Some(map)) = (far, &migration.far) {
        migration.stats.far_memory = Some(far_stats(far, &map.filter, &map.start));
    }
    // Whatever happened, the guest runs at full speed from here (on
    // failure it goes on here; after commit this copy is done with).
    if precopy.throttled() {
        vm.set_throttle(0.0);
    }
    let committed = migration.committed();
    if let Some(link) = &mut link {
        link.finish_engine(&mut migration.stats, options);
    }
    vm.disk_warm_stop();
    let mut stats = std::mem::take(&mut migration.stats);
    stats.total_time_ms = ms(start.elapsed());
    stats.cpu_seconds.source = process_cpu_seconds() - cpu_process;
    stats.cpu_seconds.source_migration_thread = thread_cpu_seconds() - cpu_thread;
    match result {
        Ok(()) => {
            stats.status = Status::Completed;
            progress.update(|p| p.phase = SourceState::Completed);
        }
        Err(e) => {
            stats.status = Status::Failed;
            // A broken connection often means the destination refused
            // something and hung up: its ERROR frame says what.
            let peer_said = match &e {
                SourceError::Wire(WireError::Io(_)) | SourceError::Pipeline(_) => {
                    link.as_mut().and_then(Link::peer_error)
                }
                _ => None,
            };
            let mut message = match peer_said {
                Some(reason) => format!("destination refused: {reason}"),
                None => error_chain(&e),
            };
            if !committed {
                // Far memory keeps the log on: its evictor reads it.
                if far.is_none() {
                    let _ = vm.set_dirty_logging(false);
                }
                if far.is_some_and(|f| f.stats().error.is_some()) {
                    // Its memory host is gone: far memory paused it, and a
                    // resumed guest would only wait on a lost page.
                    message.push_str("; the VM stays paused here (its far memory is lost)");
                } else if let Err(resume) = vm.resume() {
                    message.push_str(&format!("; resuming the VM here failed too: {resume}"));
                } else {
                    message.push_str("; the VM keeps running here");
                }
                // Eviction goes on only now: it pauses the VM for each
                // batch, and a resume of ours in the middle of one would
                // let the guest write to pages being dropped.
                if let Some(far) = far {
                    far.take_back();
                }
            }
            stats.error = Some(message);
            progress.update(|p| p.phase = SourceState::Failed);
        }
    }
    stats
}

/// What became of the far pages: far memory's counters now against
/// `start`, taken with the map, and what `filter` saw sent.
fn far_stats(far: &FarMemory, filter: &FarFilter, start: &FarStats) -> FarMigrationStats {
    let now = far.stats();
    let at_start = filter.far_at_start();
    FarMigrationStats {
        local_limit_bytes: now.local_limit_bytes,
        far_pages_at_start: at_start,
        pages_left_far: filter.left_far(),
        // Nothing is evicted meanwhile: a page of the map that is not far
        // now came back.
        pages_came_back: at_start.saturating_sub(now.far_pages),
        resident_pages_at_start: start.resident_pages,
        resident_pages_at_end: now.resident_pages,
        faults: now.faults.saturating_sub(start.faults),
        readahead_pages: now.readahead_pages.saturating_sub(start.readahead_pages),
        bytes_read: now.bytes_read.saturating_sub(start.bytes_read),
    }
}

/// "outer: inner: innermost", one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        // `#[error("...: {0}")]` with `#[from]` shows its source already.
        let inner_text = inner.to_string();
        if !text.ends_with(&inner_text) {
            text.push_str(": ");
            text.push_str(&inner_text);
        }
        source = inner.source();
    }
    text
}

/// The migration, in the order of the sequence diagram in
/// `protocol/mod.rs`: the link is set up (HELLO, ACCEPT, the other
/// channels) and its pipeline started, pre-copy iterates while the guest
/// runs, and the phase it ends in finishes the migration: stop-and-copy
/// (the last pages, STATE, DIGEST, COMMIT) or post-copy. `link` is set
/// once connecting begins: after a failure its reader may hold the
/// destination's ERROR frame.
fn run(
    m: &mut Migration,
    link: &mut Option<Link>,
    precopy: &mut Precopy,
    far: Option<&FarMemory>,
    to: &Address,
    granularity: Granularity,
) -> Result<(), SourceError> {
    let options = m.options;
    options.check().map_err(SourceError::BadOptions)?;
    // First: its eviction stops the vCPU for moments, and stops no more
    // once the map is handed over.
    if let Some(far) = far {
        m.far = Some(FarMap::hand_over(far)?);
    }
    match m.vm.status() {
        VcpuStatus::Running => {}
        other => {
            return Err(SourceError::NotRunning(match other {
                VcpuStatus::Paused => "paused",
                VcpuStatus::Halted => "halted",
                _ => "not running",
            }))
        }
    }

    // Setup: every channel, then the pipeline's stages on them.
    let layout = ShardLayout { batch_pages: options.batch_pages, shards: options.shards(), channels: options.channels };
    let link = link.insert(Link::new(to, options));
    let writers = link.connect(m, layout, granularity)?;
    m.stats.setup_time_ms = ms(m.start.elapsed());
    link.start_engine(m, layout, granularity, writers)?;

    // Pre-copy (the disk cache's block list first), then the phase it
    // ends in.
    let warm = warm::send_blocks(m, link)?;
    m.enter(SourceState::Iterating);
    match precopy.run(m, link, warm)? {
        PrecopyEnd::StopAndCopy(stop) => stop.run(m, link),
        PrecopyEnd::Postcopy(postcopy) => postcopy.run(m, link),
    }
}
