//! The test guest, built from `guest/` by build.rs and embedded here so the
//! binary needs no file next to it.

/// The multiboot v1 ELF32 image of the test guest.
pub static GUEST_ELF: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/guest.elf"));

/// Workloads the guest knows (guest/README.md describes each).
pub const WORKLOADS: &[&str] = &[
    "idle",
    "fill-zero",
    "fill-random",
    "kv",
    "bwmem",
    "sparse",
    "zero-clear",
    "stream",
    "disk-seq",
    "disk-random",
    "disk-mixed",
];

/// Parameters a user may pass to a workload (`tsc_khz` is ours to fill).
pub const WORKLOAD_PARAMS: &[&str] = &["wss", "rate", "seed", "disk"];

/// Builds the guest command line, checking names before the guest sees them.
pub fn cmdline(workload: &str, args: &[(String, String)], tsc_khz: u32) -> Result<String, String> {
    if !WORKLOADS.contains(&workload) {
        return Err(format!("unknown workload '{workload}' (known: {})", WORKLOADS.join(", ")));
    }
    let mut line = format!("workload={workload}");
    for (key, value) in args {
        if !WORKLOAD_PARAMS.contains(&key.as_str()) {
            return Err(format!("unknown workload parameter '{key}' (known: {})", WORKLOAD_PARAMS.join(", ")));
        }
        if value.is_empty() || value.contains(char::is_whitespace) {
            return Err(format!("workload parameter '{key}' needs a value without spaces"));
        }
        line.push_str(&format!(" {key}={value}"));
    }
    line.push_str(&format!(" tsc_khz={tsc_khz}"));
    Ok(line)
}

/// A progress line of the guest (guest/README.md): `tsb ops=<u64>
/// pass=<u64>`, followed by more `key=value` fields (`gap_us`, and the
/// disk workloads' counters) that this parser leaves to its callers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProgressLine {
    /// The workload's operations so far.
    pub ops: u64,
    /// Its passes over the working set.
    pub pass: u64,
}

/// Reads a progress line; None for any other line.
pub fn parse_progress(line: &str) -> Option<ProgressLine> {
    let mut fields = line.strip_prefix("tsb ")?.split_ascii_whitespace();
    let ops = fields.next()?.strip_prefix("ops=")?.parse().ok()?;
    let pass = fields.next()?.strip_prefix("pass=")?.parse().ok()?;
    Some(ProgressLine { ops, pass })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cmdline_checks_names() {
        let args = vec![("wss".to_string(), "64M".to_string())];
        assert_eq!(cmdline("kv", &args, 2000).unwrap(), "workload=kv wss=64M tsc_khz=2000");
        assert!(cmdline("nope", &[], 1).unwrap_err().contains("unknown workload 'nope'"));
        let bad = vec![("foo".to_string(), "1".to_string())];
        assert!(cmdline("kv", &bad, 1).unwrap_err().contains("unknown workload parameter 'foo'"));
    }

    #[test]
    fn progress_lines() {
        assert_eq!(parse_progress("tsb ops=12 pass=3"), Some(ProgressLine { ops: 12, pass: 3 }));
        assert_eq!(parse_progress("tsb ops=12 pass=3 rd=4096 wr=0"), Some(ProgressLine { ops: 12, pass: 3 }));
        assert_eq!(parse_progress("tsb ops=12 pass=3 gap_us=812 rd=1"), Some(ProgressLine { ops: 12, pass: 3 }));
        assert_eq!(parse_progress("tsb ops=x pass=3"), None);
        assert_eq!(parse_progress("tsb ops=1"), None);
        assert_eq!(parse_progress("tsubame-guest: workload=kv"), None);
    }
}
