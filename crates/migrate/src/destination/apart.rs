//! The stop's threads on a destination, kept apart from the vCPU's.
//!
//! In the stop the vCPU thread loads the state (~0.08 ms of ioctls here)
//! while the decoders apply the last pages and the digest answers. This
//! host's scheduler queued whichever of them woke behind the loading vCPU
//! thread while the other CPU idled (0.08-0.09 ms late in 3 of 6 idle
//! stops). From the digest before the stop until
//! RESUMED, the vCPU thread runs on one CPU other than the receiving
//! thread's, and the decoders and the digest on every other CPU (on this
//! host's two, the one the data arrives on); the receiving thread too
//! until the memory is verified. (Held there to COMMIT, it waited for the
//! source's thread, on that CPU too and spinning for RESUMED, the
//! source's 1 ms spin: both ends share this host's two CPUs.) On a 16-CPU
//! host, the data's threads held on one CPU made a kv guest's stops wait
//! on fifteen decoders there: 0.7-3.3 ms from the digest to READY,
//! against 0.09-0.27 with no thread placed. An
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
        let (vcpu, rest) = one_apart(&cpus);
        place(&rest, threads, digest);
        landing.vcpu_run_on(&vcpu);
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

/// One CPU other than this thread's (for the vCPU thread), and the rest
/// with this thread's (for the threads the data goes through).
fn one_apart(cpus: &CpuSplit) -> (Vec<usize>, Vec<usize>) {
    let (vcpu, others) = cpus.others.split_first().expect("CpuSplit::others is never empty");
    (vec![*vcpu], std::iter::once(cpus.here).chain(others.iter().copied()).collect())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn split(all: &[usize], here: usize) -> CpuSplit {
        let others = all.iter().copied().filter(|&cpu| cpu != here).collect();
        CpuSplit { all: all.to_vec(), here, others }
    }

    #[test]
    fn two_cpus_split_as_before_one_each() {
        assert_eq!(one_apart(&split(&[0, 1], 1)), (vec![0], vec![1]));
        assert_eq!(one_apart(&split(&[0, 1], 0)), (vec![1], vec![0]));
    }

    #[test]
    fn many_cpus_leave_the_vcpu_one_and_the_rest_every_other() {
        let all: Vec<usize> = (0..16).collect();
        let (vcpu, rest) = one_apart(&split(&all, 5));
        assert_eq!(vcpu, vec![0]);
        assert_eq!(rest.len(), 15);
        assert_eq!(rest[0], 5);
        assert!(!rest.contains(&0));
    }
}
