//! The watch's looks against marked dirty logs, and the strided order.

use super::*;

#[test]
fn runs_are_told_from_scattered_pages_at_any_density() {
    let run = |n: u32| (1u64 << n) - 1;
    assert!(in_runs([run(8); 4].into_iter()), "runs of 8");
    assert!(in_runs([run(60); 4].into_iter()), "dense runs");
    assert!(!in_runs([0x0101_0101_0101_0101; 4].into_iter()), "every 8th page");
    assert!(!in_runs([0xAAAA_AAAA_AAAA_AAAA; 4].into_iter()), "every other page");
    // Random at half density: neighbours dirtied about half the time.
    assert!(!in_runs([0x5A3C_96E1_0FF0_C33C, 0x1234_5678_9ABC_DEF0].into_iter()), "random");
    assert!(!in_runs([run(3)].into_iter()), "too few to tell");
}

#[test]
fn strided_order_visits_every_chunk_once() {
    let order: Vec<usize> = strided(40).collect();
    assert_eq!(order.len(), 40);
    assert_eq!(&order[..4], &[0, 32, 16, 8]);
    // The first eight already hit every eighth of memory but the last
    // (40 of 64 slots exist).
    let eighths: std::collections::BTreeSet<usize> = order[..8].iter().map(|c| c * 8 / 40).collect();
    assert!(eighths.len() >= 5, "{:?}", &order[..8]);
    assert_eq!(strided(1).collect::<Vec<_>>(), vec![0]);
    assert_eq!(strided(0).count(), 0);
    let mut sorted = order.clone();
    sorted.sort();
    assert_eq!(sorted, (0..40).collect::<Vec<_>>());
}

#[test]
fn handover_when_sent_pages_are_dirtied_as_fast_as_the_link_carries() {
    let long_ago = std::time::Instant::now() - Duration::from_millis(1500);
    // 16 runs of 1024 pages went out 1.5 s ago, from 64 Ki pages.
    let mut watch = runs_sent_at(long_ago);
    watch.last_check = long_ago;
    let mut dirty = DirtyBitmap::new(65536);
    // A quarter of each run dirtied again: 16 Ki pages of memory per
    // 1.5 s, ~44 MB/s.
    let mark = first_of_each_run(256);
    assert!(watch.handover(40e6, 65536, &mut dirty, mark, |_| false, |_| 1.0), "44 MB/s against a 40 MB/s link");
    watch.last_check = long_ago;
    assert!(!watch.handover(100e6, 65536, &mut dirty, mark, |_| false, |_| 1.0), "44 MB/s against 100 MB/s");
    watch.last_check = long_ago;
    assert!(!watch.handover(40e6, 65536, &mut dirty, |_| false, |_| false, |_| 1.0), "no look at the log, no handover");
}

#[test]
fn handover_after_a_short_look_only_when_far_from_converging() {
    let lately = std::time::Instant::now() - Duration::from_millis(300);
    let mut watch = runs_sent_at(lately);
    let mark = first_of_each_run;
    // Everything out 0.3 s ago dirtied again: 256 MiB per 0.3 s.
    watch.last_check = lately;
    assert!(
        watch.handover(100e6, 65536, &mut DirtyBitmap::new(65536), mark(1024), |_| false, |_| 1.0),
        "~900 MB/s vs 100 MB/s"
    );
    // A quarter of it: ~220 MB/s, not twice a 150 MB/s link; the long
    // look has nothing to say yet.
    watch.last_check = lately;
    assert!(
        !watch.handover(150e6, 65536, &mut DirtyBitmap::new(65536), mark(256), |_| false, |_| 1.0),
        "~220 MB/s vs 150 MB/s"
    );
}

#[test]
fn handover_at_the_first_look_when_the_guest_dirties_more_than_the_limit_carries() {
    // 256 MiB of memory, a 100 MB/s link, 300 ms: 30 MB go out in the
    // limit. The probes were cleared 40 ms ago (less than a look:
    // only a guest that no stop could keep up with counts); `share` of
    // each unsent one's pages is dirty again.
    let watch = |limit_ms: u64| probes_out(limit_ms, 40);
    let mark = first_of_each_probe;
    // Half of them: 134 MB in 40 ms.
    let mut w = watch(300);
    assert!(w.handover(100e6, 65536, &mut DirtyBitmap::new(65536), mark(32), |_| false, |_| 1.0), "134 MB in 40 ms");
    assert!(w.why().contains("over 40 ms"), "{}", w.why());
    // A twentieth, scattered: 12 MB, which the limit carries in under half
    // of it. (In runs it would go: a guest writing in runs hands over from
    // far less.) A tenth, 25 MB, would take most of the limit: it goes.
    let scattered = |n: u32| {
        move |d: &mut DirtyBitmap| {
            for w in (0..1024).step_by(PROBE_EVERY) {
                d.words_mut()[w] = (0..n).fold(0, |word, i| word | 1 << (9 * i));
            }
            true
        }
    };
    let mut w = watch(300);
    assert!(
        !w.handover(100e6, 65536, &mut DirtyBitmap::new(65536), scattered(3), |_| false, |_| 1.0),
        "12 MB in 40 ms"
    );
    assert!(watch(300).handover(100e6, 65536, &mut DirtyBitmap::new(65536), scattered(6), |_| false, |_| 1.0), "25 MB");
    assert!(watch(300).handover(100e6, 65536, &mut DirtyBitmap::new(65536), mark(3), |_| false, |_| 1.0), "in runs");
    // Probes sent since say nothing: half of them out, their bits
    // (dirtied since) not counted, too few left dirty to count.
    let mut w = watch(300);
    w.sent(0, 32768);
    let few = |d: &mut DirtyBitmap| {
        for word in (0..1024).step_by(PROBE_EVERY) {
            d.words_mut()[word] = if word < 512 { u64::MAX } else { 0 };
        }
        true
    };
    assert!(!w.handover(100e6, 65536, &mut DirtyBitmap::new(65536), few, |_| false, |_| 1.0), "sent probes");
    // Under a 30 ms limit 40 ms say nothing of what 30 ms would show.
    let mut w = watch(30);
    assert!(!w.handover(100e6, 65536, &mut DirtyBitmap::new(65536), mark(32), |_| false, |_| 1.0), "a 30 ms limit");
}

#[test]
fn handover_after_a_look_at_data_written_about_as_fast_as_the_link_carries() {
    // As above, the probes out 120 ms: 7 pages in 64 dirtied, 29 MB,
    // ~245 MB/s against 100 MB/s, as 60 ms before. A stop could carry
    // it, but pages sent meanwhile would go twice. Not against 300 MB/s.
    let watch_after = |early_rate: f64| {
        let mut watch = HandoverWatch::new(Duration::from_millis(300));
        watch.probe(&DirtyBitmap::full(65536));
        watch.probed_at = std::time::Instant::now() - Duration::from_millis(120);
        watch.last_check = watch.probed_at;
        watch.probe_looks.push((0.06, early_rate, 500));
        watch
    };
    let watch = || watch_after(245e6);
    let tenth = |d: &mut DirtyBitmap| {
        for w in (0..1024).step_by(PROBE_EVERY) {
            d.words_mut()[w] = (1u64 << 7) - 1;
        }
        true
    };
    // The same pages dirtied, scattered over each probe word.
    let scattered = |d: &mut DirtyBitmap| {
        for w in (0..1024).step_by(PROBE_EVERY) {
            d.words_mut()[w] = (0..7).fold(0, |word, i| word | 1 << (9 * i));
        }
        true
    };
    assert!(watch().handover(100e6, 65536, &mut DirtyBitmap::new(65536), tenth, |_| false, |_| 1.0), "data");
    assert!(
        !watch().handover(300e6, 65536, &mut DirtyBitmap::new(65536), scattered, |_| false, |_| 1.0),
        "a faster link"
    );
    // Scattered at 1.2 times the link: post-copy's faults would cost more
    // than pre-copy's second sends. In runs it goes.
    assert!(!watch().handover(200e6, 65536, &mut DirtyBitmap::new(65536), scattered, |_| false, |_| 1.0), "1.2×");
    assert!(watch().handover(200e6, 65536, &mut DirtyBitmap::new(65536), tenth, |_| false, |_| 1.0), "1.2×, runs");
    // Scattered pages that compress to a twentieth cost the link a
    // twentieth; pages written in runs count whole.
    let look = |share: f64, mark: &dyn Fn(&mut DirtyBitmap) -> bool| {
        watch().handover(100e6, 65536, &mut DirtyBitmap::new(65536), mark, |_| false, |_| share)
    };
    assert!(look(1.0, &scattered), "data");
    assert!(!look(0.05, &scattered), "compressed");
    assert!(look(0.05, &tenth), "runs");
    // A codec saving under 1/8 is off: its pages go whole.
    assert!(look(0.9, &scattered), "raw");
    // A quarter of a faster link's rate: enough for a guest writing in
    // runs, not for a scattered one.
    let on_fast_link = |mark: &dyn Fn(&mut DirtyBitmap) -> bool| {
        watch().handover(1e9, 65536, &mut DirtyBitmap::new(65536), mark, |_| false, |_| 1.0)
    };
    assert!(on_fast_link(&tenth), "runs");
    assert!(!on_fast_link(&scattered), "scattered");
    // Zeros written: a record each, not a page.
    assert!(!watch().handover(100e6, 65536, &mut DirtyBitmap::new(65536), scattered, |_| true, |_| 1.0), "zeros");
    // One page in four holds data: ~60 MB/s.
    let quarter = |p: u64| !p.is_multiple_of(4);
    assert!(!watch().handover(100e6, 65536, &mut DirtyBitmap::new(65536), scattered, quarter, |_| 1.0), "mostly zeros");
    // Twice the rate 60 ms before: a hot set, whose pages count once, and
    // which a stop carries in under half a 1-s limit (in 300 ms, not).
    let mut hot = watch_after(490e6);
    hot.limit = Duration::from_secs(1);
    assert!(!hot.handover(100e6, 65536, &mut DirtyBitmap::new(65536), scattered, |_| false, |_| 1.0), "a hot set");
    let mut big = watch_after(490e6);
    assert!(big.handover(100e6, 65536, &mut DirtyBitmap::new(65536), scattered, |_| false, |_| 1.0), "29 MB");
    // Without a look at half of it, none (under the 1-s limit).
    let mut unseen = watch();
    unseen.probe_looks.clear();
    unseen.limit = Duration::from_secs(1);
    assert!(
        !unseen.handover(100e6, 65536, &mut DirtyBitmap::new(65536), scattered, |_| false, |_| 1.0),
        "no earlier look"
    );
}

#[test]
fn handover_after_half_a_second_when_the_rate_holds() {
    // Runs out 0.3 s ago (pages 0..16k) and 0.6 s ago (16k..32k).
    let now = std::time::Instant::now();
    let mut watch = HandoverWatch::new(Duration::from_millis(300));
    for i in 0..16u64 {
        watch.sent.push((now - Duration::from_millis(600), 16384 + i * 1024, 1024));
        watch.sent.push((now - Duration::from_millis(300), i * 1024, 1024));
    }
    // A share of each run dirtied again: `short` of the recent ones,
    // `mid` of the older ones.
    let mark = |short: u64, mid: u64| {
        move |d: &mut DirtyBitmap| {
            for i in 0..16u64 {
                (0..short).for_each(|p| d.set(i * 1024 + p));
                (0..mid).for_each(|p| d.set(16384 + i * 1024 + p));
            }
            true
        }
    };
    // 65536 pages of 4 KiB: 30 % of memory in 0.3 s, 60 % in 0.6 s is
    // ~270 MB/s either way, above 0.9 of a 250 MB/s link.
    watch.last_check = now - Duration::from_secs(1);
    assert!(
        watch.handover(250e6, 65536, &mut DirtyBitmap::new(65536), mark(307, 614), |_| false, |_| 1.0),
        "a steady 270 MB/s"
    );
    // A hot set: the same share in 0.3 s and in 0.6 s (the rate halves).
    watch.last_check = now - Duration::from_secs(1);
    assert!(
        !watch.handover(250e6, 65536, &mut DirtyBitmap::new(65536), mark(307, 307), |_| false, |_| 1.0),
        "a hot set"
    );
}

/// A watch (300 ms limit) whose 16 runs of 1024 pages, one every 4096
/// pages of 64 Ki, went out `at`.
fn runs_sent_at(at: std::time::Instant) -> HandoverWatch {
    let mut watch = HandoverWatch::new(Duration::from_millis(300));
    for i in 0..16 {
        watch.sent.push((at, i * 4096, 1024));
    }
    watch
}

/// A watch (`limit_ms` limit) over 64 Ki pages whose probes were cleared
/// `out_ms` ago (a sixteenth of the log's 1024 words).
fn probes_out(limit_ms: u64, out_ms: u64) -> HandoverWatch {
    let mut watch = HandoverWatch::new(Duration::from_millis(limit_ms));
    let mask = watch.probe(&DirtyBitmap::full(65536));
    assert_eq!(mask.iter().filter(|&&w| w == u64::MAX).count(), 1024 / PROBE_EVERY);
    watch.probed_at = std::time::Instant::now() - Duration::from_millis(out_ms);
    watch.last_check = watch.probed_at;
    watch
}

/// A look at the log that finds the first `pages` of each probe word
/// dirtied, in a run.
fn first_of_each_probe(pages: u32) -> impl Fn(&mut DirtyBitmap) -> bool + Copy {
    move |d: &mut DirtyBitmap| {
        for w in (0..1024).step_by(PROBE_EVERY) {
            d.words_mut()[w] = (1u64 << pages) - 1;
        }
        true
    }
}

/// A look at the log that finds the first `pages` of each of those runs
/// dirtied.
fn first_of_each_run(pages: u64) -> impl Fn(&mut DirtyBitmap) -> bool + Copy {
    move |d: &mut DirtyBitmap| {
        for i in 0..16u64 {
            for p in 0..pages {
                d.set(i * 4096 + p);
            }
        }
        true
    }
}

#[test]
fn a_guest_writing_in_runs_far_above_its_share_is_handed_over_at_the_first_look() {
    // 256 MiB, probes out 12 ms, each with its first 8 pages dirtied in a
    // run: ~1.4 GB/s of all memory against a 1 GB/s link, three times a
    // tenth of it and more; no earlier look to call it steady.
    let watch = |ms: u64| probes_out(300, ms);
    let runs = first_of_each_probe;
    let mut w = watch(12);
    assert!(w.before_first_look(1e9), "no look yet");
    assert!(!w.before_first_look(0.0), "the link's rate unknown: no look to wait for");
    assert!(w.handover(1e9, 65536, &mut DirtyBitmap::new(65536), runs(8), |_| false, |_| 1.0), "in runs");
    assert!(!w.before_first_look(1e9), "looked");
    assert!(w.why().contains("in runs"), "{}", w.why());
    // Before the look's 10 ms, or under three tenths of the link, it waits.
    let mut early = watch(6);
    assert!(!early.handover(1e9, 65536, &mut DirtyBitmap::new(65536), runs(8), |_| false, |_| 1.0), "6 ms");
    assert!(early.before_first_look(1e9), "a look of 6 ms is not the first");
    assert!(!watch(25).before_first_look(1e9), "out twice the look: no longer waiting");
    assert!(!watch(12).handover(1e10, 65536, &mut DirtyBitmap::new(65536), runs(8), |_| false, |_| 1.0), "10 GB/s");
    // The same pages scattered over each word: no early look.
    let scattered = |d: &mut DirtyBitmap| {
        for w in (0..1024).step_by(PROBE_EVERY) {
            d.words_mut()[w] = (0..8).fold(0, |word, i| word | 1 << (8 * i));
        }
        true
    };
    assert!(!watch(12).handover(1e9, 65536, &mut DirtyBitmap::new(65536), scattered, |_| false, |_| 1.0), "scattered");
}

#[test]
fn zeros_rewritten_in_sent_runs_do_not_hand_over() {
    // Everything out 0.3 s ago dirtied again, as in the short look above,
    // and the probes (out 200 ms) dirtied too: zeros, or data.
    let lately = std::time::Instant::now() - Duration::from_millis(300);
    let watch = || {
        let mut watch = runs_sent_at(lately);
        watch.probe(&DirtyBitmap::full(65536));
        watch.probed_at = std::time::Instant::now() - Duration::from_millis(200);
        watch.last_check = lately;
        watch
    };
    let mark = first_of_each_run(1024);
    assert!(!watch().handover(100e6, 65536, &mut DirtyBitmap::new(65536), mark, |_| true, |_| 1.0), "zeros");
    assert!(watch().handover(100e6, 65536, &mut DirtyBitmap::new(65536), mark, |_| false, |_| 1.0), "data");
}
