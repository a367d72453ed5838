//! Pre-copy: iterations over the dirty set while the guest runs, until
//! the policy says stop, or hand over to post-copy ([`super::policy`]).
//! It ends in the phase that comes next: a [`Stop`] or a [`Postcopy`].

use tsubame_vmm::DirtyBitmap;

use super::choices::postcopy_choice;
use super::error::SourceError;
use super::handover::HandoverWatch;
use super::iteration::{send_dirty, Pass, Sent};
use super::link::Link;
use super::migration::{ms, Migration};
use super::policy::{Decision, Handover, PrecopyPolicy};
use super::postcopy::Postcopy;
use super::send::{DRAINED, DRAIN_LIMIT};
use super::stop::Stop;
use super::warm::{self, WarmUnsent};
use crate::options::{MigrateOptions, PostcopyMode};
use crate::protocol::{self, Digest, ErrorMessage, FrameKind, SourceState};
use crate::stats::StopReason;

/// Unhashed pages (4 MiB) above which a converged pre-copy lets the
/// digest catch up before it pauses the guest: hashing in the downtime ran
/// at ~8 GB/s on this 2-core host (4 GiB in 508 ms), so less than this
/// costs the downtime under a millisecond.
const DIGEST_LAG_PAGES: u64 = 1024;

/// How many times the last look before a converged stop may go back to
/// one more iteration (each sends the digest and drains the link anew).
const LAST_LOOKS: u32 = 2;

/// How pre-copy ended: the phase that comes next.
pub(super) enum PrecopyEnd {
    /// Stop the guest and send the rest.
    StopAndCopy(Stop),
    /// Hand over to post-copy.
    Postcopy(Postcopy),
}

/// The pre-copy phase.
pub(super) struct Precopy {
    /// When to stop iterating.
    policy: PrecopyPolicy,
}

impl Precopy {
    /// Pre-copy before any iteration, with this host's cost of hashing a
    /// page.
    pub(super) fn new() -> Precopy {
        Precopy { policy: PrecopyPolicy::for_this_host() }
    }

    /// Whether auto-converge slowed the guest.
    pub(super) fn throttled(&self) -> bool {
        self.policy.auto_converge.fraction > 0.0
    }

    /// Iterations while the guest runs; returns with the VM still running,
    /// and the pages still dirty in the stop or the post-copy it returns.
    /// `warm`: the disk cache's listed blocks whose contents may still go
    /// (after the first iteration).
    pub(super) fn run(
        &mut self,
        m: &mut Migration,
        link: &mut Link,
        mut warm: Option<WarmUnsent>,
    ) -> Result<PrecopyEnd, SourceError> {
        let (vm, options) = (m.vm, m.options);
        let mut bitmap = vm.dirty_bitmap();
        vm.set_dirty_logging(true)?;
        if let Some(far) = &m.far {
            // Far memory kept the log on since boot: it holds only what
            // changed lately, not every page. Every page but the far ones,
            // which live on the memory host the destination attaches to.
            bitmap.set_all();
            bitmap.words_mut().iter_mut().zip(far.pages.far.words()).for_each(|(b, f)| *b &= !f);
        } else if vm.manual_dirty_protect() {
            vm.dirty_log(&mut bitmap)?; // all ones: logging just started
        } else {
            bitmap.set_all();
        }
        if options.postcopy == PostcopyMode::After(0) {
            chose_postcopy(m, Handover::After(0).why());
            return Ok(self.hand_over(options, bitmap, None));
        }
        let mut iteration = 0u32;
        // Whether the digest caught up before the stop once already.
        let mut caught_up = false;
        // Last looks that found too much dirty to stop.
        let mut last_looks = 0;
        // The digest sent before the pause, if one went.
        let mut digest_sent = None;
        loop {
            m.progress.update(|p| p.iteration = iteration);
            // Auto post-copy watches the first iteration, sent in a strided
            // order, for a guest that outruns the link.
            // (With auto-converge the throttle gets its chance first.)
            let watch = (iteration == 0 && options.postcopy == PostcopyMode::Auto && !options.auto_converge)
                .then(|| HandoverWatch::new(options.downtime_limit));
            let pass = Pass::Running { policy: &mut self.policy, watch };
            let Sent { it, unsent, zeros, hashed, .. } = send_dirty(m, link, &bitmap, iteration, pass)?;
            if let Some((unsent, why)) = unsent {
                chose_postcopy(m, why);
                // Post-copy's senders hash the pages left (the digest would
                // read them a second time: 4 GiB of fill-random, beside the
                // switch); the digest hashes those sent.
                m.digest().await_hashes(unsent.clone());
                let mut sent = bitmap.clone();
                sent.subtract(&unsent);
                m.refresh_digest(&sent, zeros, hashed);
                m.stats.per_iteration.push(it);
                return Ok(self.hand_over(options, unsent, Some(iteration)));
            }
            m.refresh_digest(&bitmap, zeros, hashed);
            let bw = self.policy.observe(&it, options);
            let summary = link.engine.as_ref().map_or_else(String::new, |e| e.summary());
            m.progress.update(|p| {
                p.bandwidth = bw;
                p.pipeline = summary;
            });
            link.set_capacity(self.policy.codec_link_rate(options));
            m.stats.per_iteration.push(it.clone());
            iteration += 1;
            if iteration == 1 {
                // The bulk of memory is across: the disk cache's contents
                // next, before the dirty log says how much is left.
                if let Some(unsent) = warm.take() {
                    warm::send_data(m, link, unsent)?;
                }
            }

            vm.dirty_log(&mut bitmap)?;
            warm::send_disk_written(m, link)?;
            if let Some(rtt) = link.engine().round_trip() {
                self.policy.round_trip = rtt;
            }
            let remaining = bitmap.count();
            m.stats.expected_downtime_ms = ms(self.policy.expected(remaining, options));
            let decision =
                self.policy.decide(&it, remaining, iteration, m.stats.bytes_on_wire, vm.memory_bytes(), options);
            let reason = match decision {
                Decision::Continue { throttle } => {
                    if let Some(fraction) = throttle {
                        vm.set_throttle(fraction);
                    }
                    continue;
                }
                Decision::Postcopy(why) => {
                    chose_postcopy(m, why.why());
                    return Ok(self.hand_over(options, bitmap, Some(iteration - 1)));
                }
                Decision::Stop(reason) if reason.converged() && !caught_up && digest_lags(m) => {
                    caught_up = true;
                    // Hash the backlog while the guest still runs (in the
                    // downtime it took 0.3-0.8 s for a 4 GiB VM that
                    // converged in two quick iterations), then send what it
                    // dirtied meanwhile in one more iteration.
                    m.enter(SourceState::HashingBeforeStop);
                    let _ = m.digest.as_ref().map(|d| d.hashes());
                    m.enter(SourceState::Iterating);
                    vm.add_dirty_log(&mut bitmap)?;
                    continue;
                }
                Decision::Stop(reason) if reason.converged() => {
                    // The digest as it stands goes now (the stop sends only
                    // the regions that change), and what is queued in the
                    // link goes out while the guest still runs: the
                    // destination checks the digest only after it.
                    if let Some(sent) = send_digest_before_stop(m, link)? {
                        digest_sent = Some(sent);
                    }
                    // Then the last look: what the guest dirtied meanwhile
                    // joins the stop, and the expected downtime counts it
                    // (a kv guest at 10 Gbit/s dirtied 1584 pages in those
                    // few milliseconds, after a look that left almost none).
                    vm.add_dirty_log(&mut bitmap)?;
                    let now = bitmap.count();
                    m.stats.expected_downtime_ms = ms(self.policy.expected(now, options));
                    if !self.policy.grew_too_much(remaining, now, options) {
                        reason
                    } else if last_looks < LAST_LOOKS {
                        last_looks += 1;
                        continue;
                    } else if self.policy.expected(now, options) <= options.downtime_limit {
                        reason
                    } else if options.postcopy == PostcopyMode::Auto {
                        // Pre-copy converges only with a stop that fits the
                        // limit: post-copy where allowed, else more
                        // iterations until one fits or there were enough.
                        let expected = self.policy.expected(now, options);
                        let limit = options.downtime_limit;
                        chose_postcopy(m, Handover::OverLimit { expected, limit }.why());
                        return Ok(self.hand_over(options, bitmap, Some(iteration - 1)));
                    } else if iteration < options.max_iterations {
                        continue;
                    } else {
                        StopReason::MaxIterations
                    }
                }
                Decision::Stop(reason) => reason,
            };
            m.stats.stop_reason = reason;
            if reason.converged() && options.postcopy != PostcopyMode::Off {
                let why = match reason {
                    StopReason::NoDirtyPages => "pre-copy left nothing dirty".to_string(),
                    _ => format!("pre-copy converged in {iteration} iteration(s)"),
                };
                postcopy_choice(&mut m.stats.choices, "not needed".into(), why);
            }
            m.stats.converged = reason.converged();
            if !reason.converged() && options.abort_if_not_converged {
                return Err(SourceError::NotConverged(reason.name().into()));
            }
            // Without manual protect, `bitmap` was cleared in KVM: keep
            // it for stop-and-copy, which adds what comes after.
            let throttle = self.policy.auto_converge.fraction;
            return Ok(PrecopyEnd::StopAndCopy(Stop::new(bitmap, digest_sent, throttle)));
        }
    }

    /// Hands over to post-copy: the destination lacks `missing` (stale or
    /// never sent); `last_iteration` is the last one ended on every channel.
    fn hand_over(&self, options: &MigrateOptions, missing: DirtyBitmap, last_iteration: Option<u32>) -> PrecopyEnd {
        PrecopyEnd::Postcopy(Postcopy::new(missing, last_iteration, self.policy.codec_link_rate(options)))
    }
}

/// Sends the digest as it stands (a later DIGEST replaces it), lets the
/// link's queue drain and waits for the destination's CAUGHT_UP (every
/// page before it written and hashed there; the guest still runs here,
/// and the last look after it adds what it dirtied meanwhile); returns
/// the digest sent, if one went.
fn send_digest_before_stop(m: &mut Migration, link: &mut Link) -> Result<Option<Vec<u64>>, SourceError> {
    let digest = m.digest.as_ref().map(|d| Digest { region: m.options.digest_region, hashes: d.hashes() });
    if let Some(digest) = &digest {
        link.write_control(FrameKind::Digest, &digest.encode())?;
    }
    link.engine().drain(DRAINED, DRAIN_LIMIT);
    if digest.is_some() {
        let mut frame = Vec::new();
        let kind = protocol::read_frame(link.reader.as_mut().expect("connected"), &mut frame)?;
        m.state.check(kind)?;
        if kind == FrameKind::Error {
            return Err(SourceError::Refused(ErrorMessage::decode(&frame).0));
        }
    }
    Ok(digest.map(|d| d.hashes))
}

/// Whether the memory digest has so much left to hash that doing it
/// during the downtime would matter.
fn digest_lags(m: &Migration) -> bool {
    m.digest.as_ref().is_some_and(|d| d.backlog_pages() > DIGEST_LAG_PAGES)
}

/// Settles the post-copy choice: handed over now, for `why`.
fn chose_postcopy(m: &mut Migration, why: String) {
    let chose = format!("switched at {:.2} s", m.start.elapsed().as_secs_f64());
    postcopy_choice(&mut m.stats.choices, chose, why);
}
