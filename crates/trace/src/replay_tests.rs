//! The replay against the walk it replaced, which took every lap in turn.

use std::collections::BTreeMap;

use super::*;
use crate::format::{Interval, Setup};

/// What the old walk carried between iterations.
struct Old {
    cursor: Cursor,
    faulted: Vec<u64>,
    huge: HugeMaps,
}

/// a4f42e5's `run_guest`: every interval of every lap, into a map.
fn old_run_guest(
    trace: &Trace,
    clock: &GuestClock,
    speed: f64,
    old: &mut Old,
    wall_s: f64,
    send_at: &[f64],
) -> (BTreeMap<u64, Dirty>, f64) {
    let Old { cursor, faulted, huge } = old;
    let mut next = BTreeMap::new();
    faulted.fill(0);
    if clock.span <= 0.0 || trace.intervals.len() < 2 {
        return (next, 0.0);
    }
    let start_work = cursor.base + clock.work[cursor.next - 1];
    let mut faults = 0u64;
    let mut work = 0.0;
    loop {
        let i = cursor.next;
        let at_work = cursor.base + clock.work[i];
        let elapsed = (at_work - start_work) / speed + clock.fault_s * faults as f64;
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
            if !turn.is_nan() && elapsed < turn {
                continue;
            }
            if let Some(first) = huge.split(c.page) {
                for p in first..(first + HUGE).min(trace.setup.pages()) {
                    next.entry(p).or_insert(Dirty { mask: 0, xbzrle: 0, zero: !trace.is_nonzero(p) });
                }
            }
            let d = next.entry(c.page).or_insert_with(Dirty::default);
            d.mask |= c.mask;
            d.xbzrle = (d.xbzrle + c.xbzrle_bytes).min(PAGE_SIZE as u32 + 1);
            d.zero = c.zero;
        }
        cursor.next += 1;
        if cursor.next == trace.intervals.len() {
            cursor.base += clock.work[clock.work.len() - 1] - clock.work[clock.loop_from - 1];
            cursor.next = clock.loop_from;
        }
    }
    (next, work)
}

/// xorshift64.
fn rng(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// 8 MiB; 60 ticks of 10 ms writing up to 30 pages of a hot 200 (and now
/// and then a cold one). With `ops` the guest works 10 % of the time, a
/// lap is 30 ms of work and a fault costs ~0.5 ms; without, the replay is
/// on wall time.
fn random_trace(seed: u64, huge_pages: bool, ops: bool) -> Trace {
    let setup = Setup {
        memory_bytes: 8 << 20,
        granularity: 128,
        interval_us: 10_000,
        workload: "t".into(),
        native_ops_per_sec: if ops { 1_000_000 } else { 0 },
        huge_pages,
    };
    let pages = setup.pages();
    let mut state = seed;
    let hot: Vec<u64> = (0..200).map(|_| rng(&mut state) % pages).collect();
    let intervals = (1..=60u64)
        .map(|i| {
            let n = rng(&mut state) % 30;
            let mut changes: Vec<PageChange> = (0..n)
                .map(|_| {
                    let r = rng(&mut state);
                    let page = if r.is_multiple_of(16) { r % pages } else { hot[(r % 200) as usize] };
                    let (mask, xbzrle_bytes) = (rng(&mut state) & 0xFFFF_FFFF, (r >> 20) as u32 % 3000);
                    PageChange { page, mask, xbzrle_bytes, zero: r.is_multiple_of(7) }
                })
                .collect();
            changes.sort_by_key(|c| c.page);
            changes.dedup_by_key(|c| c.page);
            Interval { at_us: i * 10_000, ops: if ops { i / 3 * 3 * 1000 } else { 0 }, changes }
        })
        .collect();
    let nonzero = (0..pages / 64).map(|_| rng(&mut state)).collect();
    Trace { setup, nonzero, intervals }
}

#[test]
fn skipping_laps_replays_as_walking_every_lap() {
    let mut seed = 0x5EED_u64;
    for case in 0..24 {
        let trace = random_trace(case + 1, case % 2 == 0, case % 3 != 0);
        let clock = GuestClock::of(&trace);
        let pages = trace.setup.pages();
        let mut new = ReplayState::new(&trace, trace.setup.huge_pages);
        let mut old = Old {
            cursor: Cursor::default(),
            faulted: vec![0; pages.div_ceil(64) as usize],
            huge: HugeMaps::new(pages, trace.setup.huge_pages),
        };
        for iteration in 0..10 {
            // From under a tick to some hundred laps of the trace.
            let wall_s =
                [0.004, 0.05, 0.3, 1.0, 4.0][(rng(&mut seed) % 5) as usize] * (1.0 + rng(&mut seed) as f64 / 2e19);
            let speed = [0.5, 1.0, 2.0][(rng(&mut seed) % 3) as usize];
            let send_at: Vec<f64> = (0..pages)
                .map(|_| match rng(&mut seed) % 3 {
                    0 => f64::NAN,
                    _ => wall_s * (rng(&mut seed) % 1_000_000) as f64 / 1e6,
                })
                .collect();
            let work = run_guest(&trace, &clock, speed, &mut new, wall_s, &send_at);
            let (expected, old_work) = old_run_guest(&trace, &clock, speed, &mut old, wall_s, &send_at);
            let got: BTreeMap<u64, Dirty> = new.dirty.iter().map(|(p, d)| (p, *d)).collect();
            let at = format!("case {case}, iteration {iteration}, {wall_s} s at speed {speed}");
            assert_eq!(got, expected, "{at}");
            assert!((work - old_work).abs() <= 1e-9 * old_work.max(1.0), "{at}: {work} against {old_work}");
            assert_eq!(new.cursor.next, old.cursor.next, "{at}");
            assert!((new.cursor.base - old.cursor.base).abs() <= 1e-9 * old.cursor.base.max(1.0), "{at}");
        }
    }
}

#[test]
fn a_guest_that_laps_a_trace_a_million_times_costs_one_lap() {
    // A 30 ms lap of work with no fault cost at 100 times the speed:
    // 10 s of wall time is ~33 000 laps, each writing the hot pages again.
    let trace = random_trace(7, false, true);
    let clock = GuestClock { fault_s: 0.0, ..GuestClock::of(&trace) };
    let mut state = ReplayState::new(&trace, false);
    let send_at = vec![f64::NAN; trace.setup.pages() as usize];
    let work = run_guest(&trace, &clock, 100.0, &mut state, 10.0, &send_at);
    let lap = clock.work[clock.work.len() - 1] - clock.work[clock.loop_from - 1];
    assert!(work <= 1000.0 && work > 1000.0 - lap, "{work}");
    // Every page the lap writes, its deltas summed past a whole page.
    let lap_pages: std::collections::BTreeSet<u64> =
        trace.intervals[clock.loop_from..].iter().flat_map(|i| i.changes.iter().map(|c| c.page)).collect();
    let dirty: Vec<(u64, Dirty)> = state.dirty.iter().map(|(p, d)| (p, *d)).collect();
    assert!(dirty.len() >= lap_pages.len() && lap_pages.iter().all(|p| dirty.iter().any(|(q, _)| q == p)));
    for (page, d) in dirty.iter().filter(|(p, _)| lap_pages.contains(p)) {
        let xbzrle = trace.intervals[clock.loop_from..]
            .iter()
            .flat_map(|i| &i.changes)
            .filter(|c| c.page == *page)
            .map(|c| c.xbzrle_bytes);
        assert!(xbzrle.sum::<u32>() == 0 || d.xbzrle == XBZRLE_CAP as u32, "{page}: {d:?}");
    }
}

#[test]
fn a_write_repeated_is_its_deltas_summed() {
    let c = PageChange { page: 3, mask: 0b101, xbzrle_bytes: 700, zero: false };
    let (mut once, mut many) = (Dirty::default(), Dirty::default());
    for _ in 0..4 {
        once.add(&c, 1);
    }
    many.add(&c, 4);
    assert_eq!(once, many);
    many.add(&c, u64::MAX);
    assert_eq!(many.xbzrle, PAGE_SIZE as u32 + 1);
}

#[test]
fn dirty_pages_come_out_ascending() {
    let mut set = DirtySet::new(300);
    for page in [299, 3, 64, 65, 0, 3] {
        set.entry(page, Dirty::default()).mask += 1;
    }
    let got: Vec<(u64, u64)> = set.iter().map(|(p, d)| (p, d.mask)).collect();
    assert_eq!(got, [(0, 1), (3, 2), (64, 1), (65, 1), (299, 1)]);
    set.clear();
    assert_eq!(set.iter().count(), 0);
}
