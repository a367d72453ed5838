//! `tsubame disk-create` and `tsubame disk-check`: make a raw image for
//! `--disk`, and prove after a run that every write the `disk-mixed` guest
//! saw acknowledged is on it exactly once and intact.

use std::io::Write;
use std::path::PathBuf;

use clap::Args;
use tsubame_block::records;
use tsubame_vmm::DiskStats;

use crate::units::{format_bytes, parse_size};
use crate::usage_error;

/// Options of `tsubame disk-create`.
#[derive(Args, Debug)]
pub struct DiskCreateArgs {
    /// The image file to create (refused if it exists).
    pub file: PathBuf,
    /// Its size (a multiple of 4 KiB), e.g. 1G.
    #[arg(long)]
    pub size: String,
    /// Fill it with pseudo-random data instead of leaving it sparse (zeros
    /// read back from a sparse file cost no storage reads on some hosts).
    #[arg(long)]
    pub random: bool,
}

/// Options of `tsubame disk-check`.
#[derive(Args, Debug)]
pub struct DiskCheckArgs {
    /// The image (or a copy of the NBD export) the disk-mixed guest wrote.
    pub file: PathBuf,
    /// The last write the guest reported acknowledged (its progress
    /// lines' `ack=`): it must be on the image.
    #[arg(long, value_name = "SEQ")]
    pub acked: Option<u64>,
    /// The run to check (default: the one with the most records).
    #[arg(long)]
    pub run: Option<u64>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Creates a raw image.
pub fn create(args: DiskCreateArgs) -> anyhow::Result<()> {
    let size = parse_size(&args.size).map_err(|e| usage_error(format!("--size: {e}")))?;
    if size == 0 || size % tsubame_block::BLOCK_SIZE as u64 != 0 {
        return Err(usage_error("--size must be a non-zero multiple of 4 KiB"));
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&args.file)
        .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", args.file.display()))?;
    if args.random {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut chunk = vec![0u8; 1 << 20];
        let mut left = size;
        while left > 0 {
            for word in chunk.chunks_exact_mut(8) {
                state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = state;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                word.copy_from_slice(&(z ^ (z >> 31)).to_le_bytes());
            }
            let n = left.min(chunk.len() as u64) as usize;
            file.write_all(&chunk[..n])?;
            left -= n as u64;
        }
        file.sync_all()?;
    } else {
        file.set_len(size)?;
    }
    eprintln!("tsubame: created {} ({})", args.file.display(), format_bytes(size));
    Ok(())
}

/// Checks a disk-mixed image; fails when a write was lost, reordered or torn.
pub fn check(args: DiskCheckArgs) -> anyhow::Result<()> {
    let mut image = std::fs::File::open(&args.file)
        .map_err(|e| usage_error(format!("cannot open {}: {e}", args.file.display())))?;
    let report = records::check(&mut std::io::BufReader::with_capacity(1 << 20, &mut image), args.run, args.acked)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    let Some(run) = report.run else {
        anyhow::bail!("{}: no disk-mixed record on it", args.file.display());
    };
    if report.ok() {
        eprintln!(
            "tsubame: {}: run {run:#x}: records {}..={} all present once and intact ({} records)",
            args.file.display(),
            report.first_seq,
            report.last_seq,
            report.records
        );
        Ok(())
    } else {
        anyhow::bail!(
            "{}: run {run:#x}: {} missing (first {:?}), {} misplaced, {} torn{}",
            args.file.display(),
            report.missing_count,
            report.missing,
            report.misplaced.len(),
            report.torn.len(),
            report.acked_beyond_last.map_or(String::new(), |a| format!(
                ", acknowledged write {a} is beyond the last on the image ({})",
                report.last_seq
            ))
        )
    }
}

/// One line on a disk's use, for `run`'s summary.
pub fn disk_summary(d: &DiskStats) -> String {
    let c = &d.cache;
    let lookups = c.hits + c.misses;
    let hit_rate = if lookups == 0 { 0.0 } else { c.hits as f64 * 100.0 / lookups as f64 };
    format!(
        "disk {}: {} read, {} written, {} flushes, {} errors; cache {} of {}, {hit_rate:.0} % hits, {} from storage{}",
        d.disk,
        format_bytes(d.bytes_read),
        format_bytes(d.bytes_written),
        d.flushes,
        d.errors,
        format_bytes(c.cached_bytes),
        format_bytes(c.capacity_bytes),
        format_bytes(c.bytes_from_storage),
        if c.warmed_blocks > 0 { format!(", {} blocks warmed before arrival", c.warmed_blocks) } else { String::new() }
    )
}
