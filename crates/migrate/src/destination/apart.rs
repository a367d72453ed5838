//! The stop's threads on a destination, kept apart from the vCPU's.
//!
//! In the stop the vCPU thread loads the state (~0.08 ms of ioctls here)
//! while the decoders apply the last pages and the digest answers. This
//! host's scheduler queued whichever of them woke behind the loading vCPU
//! thread while the other CPU idled (0.08-0.09 ms late in 3 of 6 idle
//! stops, docs/results.md). From the digest before the stop until
//! RESUMED, the vCPU thread runs on the CPUs other than the receiving
//! thread's, and the decoders and the digest on its; the receiving thread
//! too until the memory is verified. (Held there to COMMIT, it waited
//! for the source's thread, on that CPU too and spinning for RESUMED,
//! the source's 1 ms spin: both ends share this host's two CPUs.) An
//! iteration the source sends after that digest (its last look found
//! the dirty set grown) is received so too. A stop whose pages pass
//! [`FEW_BYTES`] on channel 0 lets them all use every CPU again: held on
//! one, the decoders of a kv guest's stops of hundreds of pages made
//! them 1.2× as long.

use std::os::unix::thread::JoinHandleExt;

use tsubame_vmm::cpu_time::{set_thread_cpus, this_pthread, CpuSplit};

use super::landing::Landing;
use crate::digest::BackgroundDigest;

/// Page frames on channel 0 after which a stop is not a few pages' (64
/// whole pages: a source runs such a stop in turn).
const FEW_BYTES: usize = 64 * 4096;

/// Every CPU the receiving thread could use before: undone with
/// [`Apart::end`]. The decoders and the digest stay where they were put
/// (they end with the migration) unless the stop is large.
pub(super) struct Apart {
    all: Vec<usize>,
    /// Page frame bytes received since.
    received: usize,
}

impl Apart {
    /// Keeps the vCPU thread of `landing` off this thread's CPU, and
    /// `threads` and `digest` on it. None with one CPU.
    pub(super) fn start<'t>(
        threads: impl Iterator<Item = &'t std::thread::JoinHandle<()>>,
        digest: &BackgroundDigest,
        landing: &dyn Landing,
    ) -> Option<Apart> {
        let cpus = CpuSplit::here()?;
        place(&[cpus.here], threads, digest);
        landing.vcpu_run_on(&cpus.others);
        Some(Apart { all: cpus.all, received: 0 })
    }

    /// Counts a page frame of `bytes`; past [`FEW_BYTES`] lets this thread,
    /// `threads` and `digest` use every CPU again (the vCPU's stays apart).
    pub(super) fn received<'t>(
        &mut self,
        bytes: usize,
        threads: impl Iterator<Item = &'t std::thread::JoinHandle<()>>,
        digest: &BackgroundDigest,
    ) {
        let before = self.received;
        self.received += bytes;
        if before <= FEW_BYTES && self.received > FEW_BYTES {
            place(&self.all, threads, digest);
        }
    }

    /// Lets this thread use every CPU again (if `apart` held it).
    pub(super) fn free_this_thread(apart: &Option<Apart>) {
        if let Some(apart) = apart {
            set_thread_cpus(this_pthread(), &apart.all);
        }
    }

    /// Lets this thread and the vCPU's use every CPU again (if `apart`
    /// held them).
    pub(super) fn end(apart: Option<Apart>, landing: &dyn Landing) {
        if let Some(apart) = apart {
            set_thread_cpus(this_pthread(), &apart.all);
            landing.vcpu_run_on(&apart.all);
        }
    }
}

/// Lets this thread, `threads` and `digest` run only on `cpus`.
fn place<'t>(
    cpus: &[usize],
    threads: impl Iterator<Item = &'t std::thread::JoinHandle<()>>,
    digest: &BackgroundDigest,
) {
    set_thread_cpus(this_pthread(), cpus);
    threads.for_each(|thread| set_thread_cpus(thread.as_pthread_t(), cpus));
    digest.run_on(cpus);
}
