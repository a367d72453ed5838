//! The replayed guest during one pre-copy iteration: it walks the trace on
//! its [`GuestClock`] while the sender's bytes are on the wire, and leaves
//! behind what is dirty at the end.
//!
//! A trace short next to an iteration is walked many times over (a lap:
//! `loop_from` to the end). Once a whole lap has been walked in an
//! iteration every page it writes has faulted, so each further lap takes
//! the same wall time and writes the same pages; such laps are applied in
//! one pass, each write counted once per lap that finds its page past its
//! turn. An iteration so costs a few laps' work however many laps fit in
//! it (a guest that barely ran while traced fits hundreds in a second).

use crate::clock::GuestClock;
use crate::format::{PageChange, Trace};
use tsubame_codec::PAGE_SIZE;

/// What one page costs to send once it is dirty.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Dirty {
    pub mask: u64,
    pub xbzrle: u32,
    pub zero: bool,
}

/// XBZRLE bytes past which a page goes whole anyway.
const XBZRLE_CAP: u64 = PAGE_SIZE as u64 + 1;

impl Dirty {
    /// `c` written `times` over: the deltas add up, the last contents win.
    fn add(&mut self, c: &PageChange, times: u64) {
        self.mask |= c.mask;
        let xbzrle = (c.xbzrle_bytes as u64).saturating_mul(times).saturating_add(self.xbzrle as u64);
        self.xbzrle = xbzrle.min(XBZRLE_CAP) as u32;
        self.zero = c.zero;
    }
}

/// The pages dirty after an iteration, one slot per page: a replay
/// writes the same pages lap after lap, and an array indexed by page
/// costs no search per write.
pub(crate) struct DirtySet {
    slots: Vec<Dirty>,
    present: Vec<u64>,
}

impl DirtySet {
    fn new(pages: u64) -> DirtySet {
        DirtySet { slots: vec![Dirty::default(); pages as usize], present: vec![0; pages.div_ceil(64) as usize] }
    }

    fn clear(&mut self) {
        self.present.fill(0);
    }

    /// The entry of `page`, `fresh` when it had none.
    fn entry(&mut self, page: u64, fresh: Dirty) -> &mut Dirty {
        let (w, bit) = ((page / 64) as usize, 1u64 << (page % 64));
        if self.present[w] & bit == 0 {
            self.present[w] |= bit;
            self.slots[page as usize] = fresh;
        }
        &mut self.slots[page as usize]
    }

    /// The dirty pages, ascending.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, &Dirty)> + '_ {
        self.present.iter().enumerate().flat_map(move |(w, &word)| {
            let mut bits = word;
            std::iter::from_fn(move || {
                (bits != 0).then(|| {
                    let page = w as u64 * 64 + bits.trailing_zeros() as u64;
                    bits &= bits - 1;
                    (page, &self.slots[page as usize])
                })
            })
        })
    }
}

/// Pages per 2 MiB piece.
const HUGE: u64 = 512;

/// Which 2 MiB pieces KVM still maps whole (one bit each).
struct HugeMaps {
    whole: Vec<u64>,
}

impl HugeMaps {
    fn new(pages: u64, huge: bool) -> HugeMaps {
        let pieces = pages.div_ceil(HUGE);
        let word = if huge { u64::MAX } else { 0 };
        HugeMaps { whole: vec![word; pieces.div_ceil(64) as usize] }
    }

    /// A write dirtied `page`: if its piece was mapped whole, it is split
    /// now and the piece's first page returned.
    fn split(&mut self, page: u64) -> Option<u64> {
        let piece = page / HUGE;
        let (w, bit) = ((piece / 64) as usize, 1u64 << (piece % 64));
        (self.whole[w] & bit != 0).then(|| {
            self.whole[w] &= !bit;
            piece * HUGE
        })
    }
}

/// Where the replay stands: the next interval, and the work-seconds
/// added to the trace's own for the laps already replayed. Interval 0 is
/// never replayed: it holds what the guest dirtied while the tracer first
/// read all memory, over a stretch of work the trace cannot place (the
/// ops counter starts at its end).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Cursor {
    base: f64,
    next: usize,
}

impl Default for Cursor {
    fn default() -> Cursor {
        Cursor { base: 0.0, next: 1 }
    }
}

/// What the replay carries from one iteration to the next, and what an
/// iteration leaves dirty.
pub(crate) struct ReplayState {
    cursor: Cursor,
    /// Pages faulted in the current iteration (one bit each).
    faulted: Vec<u64>,
    huge: HugeMaps,
    /// Dirty after the last iteration.
    pub dirty: DirtySet,
}

impl ReplayState {
    /// Before iteration 0, with the memory in 2 MiB pieces if `huge`.
    pub(crate) fn new(trace: &Trace, huge: bool) -> ReplayState {
        let pages = trace.setup.pages();
        ReplayState {
            cursor: Cursor::default(),
            faulted: vec![0u64; pages.div_ceil(64) as usize],
            huge: HugeMaps::new(pages, huge),
            dirty: DirtySet::new(pages),
        }
    }
}

/// One iteration's fixed terms: when a write at a given point of the
/// guest's work happens, in wall seconds into the iteration.
struct Walk<'a> {
    trace: &'a Trace,
    clock: &'a GuestClock,
    speed: f64,
    start_work: f64,
    wall_s: f64,
    send_at: &'a [f64],
}

impl Walk<'_> {
    fn elapsed(&self, at_work: f64, fault_time: f64) -> f64 {
        (at_work - self.start_work) / self.speed + fault_time
    }

    /// `c` dirties its page `times` over; a piece still mapped whole is
    /// split, and reads as dirty throughout though unchanged.
    fn write(&self, huge: &mut HugeMaps, dirty: &mut DirtySet, c: &PageChange, times: u64) {
        if let Some(first) = huge.split(c.page) {
            for p in first..(first + HUGE).min(self.trace.setup.pages()) {
                dirty.entry(p, Dirty { mask: 0, xbzrle: 0, zero: !self.trace.is_nonzero(p) });
            }
        }
        dirty.entry(c.page, Dirty::default()).add(c, times);
    }

    /// Applies the whole laps from `cursor` (at `loop_from`) that end by
    /// `wall_s`, none of them faulting; returns how many.
    fn skip_laps(&self, cursor: &mut Cursor, fault_time: f64, huge: &mut HugeMaps, dirty: &mut DirtySet) -> u64 {
        let (work, from) = (&self.clock.work, self.clock.loop_from);
        let last = work.len() - 1;
        let lap = work[last] - work[from - 1];
        // Lap j's interval k ends at this work.
        let at = |j: u64, k: usize| cursor.base + j as f64 * lap + work[k];
        let room = (self.wall_s - fault_time) * self.speed - (cursor.base + work[from - 1] - self.start_work);
        let mut laps = (room / lap).floor().max(0.0) as u64;
        while laps > 0 && self.elapsed(at(laps - 1, last), fault_time) > self.wall_s {
            laps -= 1;
        }
        if laps == 0 {
            return 0;
        }
        for k in from..=last {
            for c in &self.trace.intervals[k].changes {
                let turn = self.send_at[c.page as usize];
                // Laps whose write comes before the page's turn (and goes
                // out with it): the first few, as time only grows.
                let mut early = 0;
                if !turn.is_nan() {
                    let guess = ((turn - fault_time) * self.speed + self.start_work - at(0, k)) / lap;
                    early = (guess.ceil().max(0.0) as u64).min(laps);
                    while early > 0 && self.elapsed(at(early - 1, k), fault_time) >= turn {
                        early -= 1;
                    }
                    while early < laps && self.elapsed(at(early, k), fault_time) < turn {
                        early += 1;
                    }
                }
                if early < laps {
                    self.write(huge, dirty, c, laps - early);
                }
            }
        }
        cursor.base += laps as f64 * lap;
        laps
    }
}

/// One iteration of the guest running while the sender's bytes go out:
/// walks the trace from where the last iteration stopped until `wall_s`
/// seconds of the guest's time are used, leaves what is dirty in
/// `state.dirty`, and returns the guest's work-seconds. A page with a
/// turn in `send_at` (seconds into the iteration; NaN: none) written
/// before it goes out with that write, as it does when the sender clears
/// each chunk's dirty bits just before reading its pages; any other write
/// dirties the page for the next iteration.
pub(crate) fn run_guest(
    trace: &Trace,
    clock: &GuestClock,
    speed: f64,
    state: &mut ReplayState,
    wall_s: f64,
    send_at: &[f64],
) -> f64 {
    let ReplayState { cursor, faulted, huge, dirty } = state;
    dirty.clear();
    faulted.fill(0);
    let intervals = trace.intervals.len();
    if clock.span <= 0.0 || intervals < 2 {
        return 0.0;
    }
    let start_work = cursor.base + clock.work[cursor.next - 1];
    let walk = Walk { trace, clock, speed, start_work, wall_s, send_at };
    let mut faults = 0u64;
    let mut work = 0.0;
    // Whether the lap under way began at `loop_from` in this iteration.
    let mut whole_lap = cursor.next == clock.loop_from;
    loop {
        let i = cursor.next;
        let at_work = cursor.base + clock.work[i];
        let elapsed = walk.elapsed(at_work, clock.fault_s * faults as f64);
        if elapsed > wall_s {
            break;
        }
        work = at_work - start_work;
        for c in &trace.intervals[i].changes {
            let (w, bit) = ((c.page / 64) as usize, 1u64 << (c.page % 64));
            if faulted[w] & bit == 0 {
                faulted[w] |= bit;
                faults += 1;
            }
            let turn = send_at[c.page as usize];
            if turn.is_nan() || elapsed >= turn {
                walk.write(huge, dirty, c, 1);
            }
        }
        cursor.next += 1;
        if cursor.next == intervals {
            // On from `loop_from`, whose predecessor lines up with the end.
            cursor.base += clock.work[intervals - 1] - clock.work[clock.loop_from - 1];
            cursor.next = clock.loop_from;
            if whole_lap && walk.skip_laps(cursor, clock.fault_s * faults as f64, huge, dirty) > 0 {
                work = cursor.base + clock.work[clock.loop_from - 1] - start_work;
            }
            whole_lap = true;
        }
    }
    work
}

#[cfg(test)]
#[path = "replay_tests.rs"]
mod tests;
