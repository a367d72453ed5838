//! Replays of synthetic traces whose results were taken from the replay
//! before it skipped whole laps (commit a4f42e5): skipping must not change
//! them. The traces loop many times per iteration (a short lap of guest
//! work, a slow link), the case the skipping is for.

use tsubame_trace::format::{Interval, PageChange, Setup, Trace};
use tsubame_trace::simulate::{simulate, simulate_with_spread, Method, SimOptions, SimResult};

/// xorshift64: the same pseudo-random trace on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// 32 MiB, half of it non-zero; 2 s of 10 ms ticks, each writing 40
/// pages of a hot set of 1500, while the guest works 5 % of the time
/// (1M ops/s undisturbed, a counter step every 50 ms): a lap is 0.05 s
/// of work, and a write-protect fault costs ~240 us.
fn looping_trace(huge_pages: bool, seed: u64) -> Trace {
    let setup = Setup {
        memory_bytes: 32 << 20,
        granularity: 128,
        interval_us: 10_000,
        workload: "synthetic".into(),
        native_ops_per_sec: 1_000_000,
        huge_pages,
    };
    let pages = setup.pages();
    let mut rng = Rng(seed);
    let hot: Vec<u64> = (0..1500).map(|_| rng.below(pages)).collect();
    let intervals = (1..=200u64)
        .map(|i| {
            let mut changes: Vec<PageChange> = (0..40)
                .map(|_| {
                    let page = hot[rng.below(hot.len() as u64) as usize];
                    let mask = rng.next() & 0xFFFF_FFFF;
                    let xbzrle_bytes = rng.below(5000) as u32;
                    PageChange { page, mask, xbzrle_bytes, zero: rng.below(10) == 0 }
                })
                .collect();
            changes.sort_by_key(|c| c.page);
            changes.dedup_by_key(|c| c.page);
            Interval { at_us: i * 10_000, ops: i / 5 * 5 * 500, changes }
        })
        .collect();
    let nonzero = (0..pages / 64).map(|w| if w % 2 == 0 { u64::MAX } else { 0x5555 }).collect();
    Trace { setup, nonzero, intervals }
}

fn options(bandwidth: f64) -> SimOptions {
    SimOptions {
        bandwidth,
        downtime_limit: 0.05,
        max_iterations: 12,
        guest_speed: 1.0,
        huge_pages: None,
        auto_converge: false,
    }
}

/// Pages per iteration, bytes, total seconds, converged.
fn summary(r: &SimResult) -> (Vec<u64>, f64, f64, bool) {
    (r.iterations.iter().map(|i| i.pages).collect(), r.bytes_total, r.total_time_s, r.converged)
}

/// Trace (huge pages or not), method, bandwidth, auto-converge, guest
/// speed => pages per iteration, bytes, total seconds, converged.
type Case = (bool, Method, f64, bool, f64, &'static [u64], f64, f64, bool);

const CASES: &[Case] = &[
    (
        false,
        Method::Page,
        10e6,
        false,
        1.0,
        &[8192, 1265, 1236, 1256, 1247, 1248, 1243, 1248, 1247, 1248, 1243, 1248, 1247],
        74094720.0,
        7.409472,
        false,
    ),
    (
        false,
        Method::Page,
        4e6,
        false,
        1.0,
        &[8192, 1268, 1259, 1257, 1255, 1260, 1255, 1254, 1260, 1260, 1261, 1258, 1260],
        74649383.0,
        18.66234575,
        false,
    ),
    (
        false,
        Method::Page,
        10e6,
        true,
        1.0,
        &[8192, 1265, 1236, 1256, 1223, 1224, 1240, 1223, 1211, 1218, 1179, 1171, 1103],
        72794833.0,
        7.279483299999999,
        false,
    ),
    (
        false,
        Method::Page,
        10e6,
        false,
        0.3,
        &[8192, 1245, 1013, 917, 841, 768, 735, 711, 663, 643, 656, 638, 627],
        53866557.0,
        5.3866557,
        false,
    ),
    (
        false,
        Method::PageXbzrle,
        10e6,
        false,
        1.0,
        &[8192, 1265, 1231, 1234, 1225, 1228, 1225, 1227, 1229, 1231, 1234, 1231, 1232],
        70766384.0,
        7.076638400000001,
        false,
    ),
    (
        false,
        Method::PageXbzrle,
        4e6,
        false,
        1.0,
        &[8192, 1268, 1257, 1255, 1264, 1261, 1265, 1261, 1255, 1254, 1259, 1261, 1262],
        74030170.0,
        18.507542500000003,
        false,
    ),
    (
        false,
        Method::PageXbzrle,
        10e6,
        true,
        1.0,
        &[8192, 1265, 1231, 1234, 1237, 1220, 1184, 1116, 953, 805, 628, 457, 337],
        56382230.0,
        5.638223,
        false,
    ),
    (
        false,
        Method::PageXbzrle,
        10e6,
        false,
        0.3,
        &[8192, 1245, 944, 684, 504, 351, 240, 202],
        31102086.0,
        3.1102086,
        true,
    ),
    (
        false,
        Method::Subpage,
        10e6,
        false,
        1.0,
        &[8192, 1265, 1226, 1127, 979, 708, 529, 377, 267, 191],
        36489921.0,
        3.6489921000000005,
        true,
    ),
    (
        false,
        Method::Subpage,
        4e6,
        false,
        1.0,
        &[8192, 1268, 1255, 1252, 1256, 1252, 1255, 1254, 1252, 1256, 1250, 1254, 1255],
        63933895.0,
        15.983473750000002,
        false,
    ),
    (
        false,
        Method::Subpage,
        10e6,
        true,
        1.0,
        &[8192, 1265, 1226, 1127, 945, 685, 500, 331, 224],
        35745363.0,
        3.5745363,
        true,
    ),
    (false, Method::Subpage, 10e6, false, 0.3, &[8192, 1245, 827, 522, 333, 218], 27060085.0, 2.7060085000000003, true),
    (
        true,
        Method::Page,
        10e6,
        false,
        1.0,
        &[8192, 8192, 1282, 1256, 1278, 1268, 1271, 1268, 1261, 1277, 1268, 1282, 1261],
        90994052.0,
        9.0994052,
        false,
    ),
    (
        true,
        Method::Page,
        4e6,
        false,
        1.0,
        &[8192, 8192, 1290, 1284, 1283, 1282, 1283, 1278, 1286, 1282, 1285, 1286, 1282],
        91589909.0,
        22.897477249999994,
        false,
    ),
    (
        true,
        Method::Page,
        10e6,
        true,
        1.0,
        &[8192, 8192, 1282, 1256, 1278, 1257, 1252, 1264, 1256, 1238, 1237, 1199, 1192],
        90019907.0,
        9.001990699999999,
        false,
    ),
    (
        true,
        Method::Page,
        10e6,
        false,
        0.3,
        &[8192, 8192, 1263, 1057, 960, 893, 827, 785, 737, 716, 695, 659, 666],
        73651746.0,
        7.3651746,
        false,
    ),
    (
        true,
        Method::PageXbzrle,
        10e6,
        false,
        1.0,
        &[8192, 8192, 1242, 1248, 1257, 1259, 1244, 1257, 1252, 1253, 1252, 1262, 1258],
        71575828.0,
        7.157582799999999,
        false,
    ),
    (
        true,
        Method::PageXbzrle,
        4e6,
        false,
        1.0,
        &[8192, 8192, 1270, 1281, 1278, 1282, 1281, 1280, 1282, 1284, 1284, 1282, 1284],
        75053516.0,
        18.763379,
        false,
    ),
    (
        true,
        Method::PageXbzrle,
        10e6,
        true,
        1.0,
        &[8192, 8192, 1242, 1248, 1255, 1239, 1228, 1194, 1107, 903, 732, 589, 441],
        59137495.0,
        5.913749500000001,
        false,
    ),
    (
        true,
        Method::PageXbzrle,
        10e6,
        false,
        0.3,
        &[8192, 8192, 982, 755, 518, 357, 284, 223],
        31965500.0,
        3.19655,
        true,
    ),
    (
        true,
        Method::Subpage,
        10e6,
        false,
        1.0,
        &[8192, 1296, 1249, 1113, 895, 652, 460, 314, 230],
        35078101.0,
        3.5078101,
        true,
    ),
    (
        true,
        Method::Subpage,
        4e6,
        false,
        1.0,
        &[8192, 1296, 1274, 1274, 1282, 1275, 1277, 1274, 1279, 1273, 1276, 1271, 1282],
        64281737.0,
        16.07043425,
        false,
    ),
    (
        true,
        Method::Subpage,
        10e6,
        true,
        1.0,
        &[8192, 1296, 1249, 1113, 873, 605, 410, 257, 194],
        34539617.0,
        3.4539617000000002,
        true,
    ),
    (true, Method::Subpage, 10e6, false, 0.3, &[8192, 1273, 849, 515, 338, 210], 27034109.0, 2.7034109, true),
];

/// Trace, method => the ±10 % spread at 10 MB/s: iterations, seconds, bytes.
type SpreadCase = (bool, Method, (usize, usize), (f64, f64), (f64, f64));

const SPREADS: &[SpreadCase] = &[
    (false, Method::Page, (13, 13), (7.375692400000001, 7.4192374), (73756924.0, 74192374.0)),
    (false, Method::PageXbzrle, (13, 13), (7.011846099999999, 7.134643099999999), (70118461.0, 71346431.0)),
    (false, Method::Subpage, (9, 10), (3.449619, 3.7630274999999993), (34496190.0, 37630275.0)),
    (true, Method::Page, (13, 13), (9.0747239, 9.0994052), (90747239.0, 90994052.0)),
    (true, Method::PageXbzrle, (13, 13), (7.1176677999999995, 7.231862100000001), (71176678.0, 72318621.0)),
    (true, Method::Subpage, (9, 10), (3.3946362, 3.8097219), (33946362.0, 38097219.0)),
];

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1.0)
}

fn trace(huge: bool) -> Trace {
    if huge {
        looping_trace(true, 2)
    } else {
        looping_trace(false, 1)
    }
}

#[test]
fn replays_are_those_of_the_replay_that_walked_every_lap() {
    let traces = [trace(false), trace(true)];
    for &(huge, method, bandwidth, auto_converge, guest_speed, pages, bytes, seconds, converged) in CASES {
        let options = SimOptions { auto_converge, guest_speed, ..options(bandwidth) };
        let r = simulate(&traces[huge as usize], method, &options);
        let case =
            format!("huge {huge}, {method:?} at {bandwidth}, auto-converge {auto_converge}, speed {guest_speed}");
        let (got_pages, got_bytes, got_seconds, got_converged) = summary(&r);
        assert_eq!(got_pages, pages, "{case}");
        assert!(close(got_bytes, bytes) && close(got_seconds, seconds), "{case}: {got_bytes} B, {got_seconds} s");
        assert_eq!(got_converged, converged, "{case}");
    }
    for &(huge, method, iterations, seconds, bytes) in SPREADS {
        let r = simulate_with_spread(&traces[huge as usize], method, &options(10e6), 0.1);
        let s = r.spread.unwrap();
        assert_eq!(s.iterations, iterations, "huge {huge}, {method:?}");
        assert!(close(s.total_time_s.0, seconds.0) && close(s.total_time_s.1, seconds.1), "{:?}", s.total_time_s);
        assert!(close(s.bytes_total.0, bytes.0) && close(s.bytes_total.1, bytes.1), "{:?}", s.bytes_total);
    }
}
