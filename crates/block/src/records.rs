//! The records the guest's `disk-mixed` workload writes, and the checker
//! that reads an image afterwards (`tsubame disk-check`): every write the
//! guest saw acknowledged must be on storage exactly once and intact.
//!
//! Each write is one 4 KiB record (all fields little-endian u64):
//!
//! | word | field |
//! |---|---|
//! | 0 | magic `TSBREC01` |
//! | 1 | run: random per boot of the workload |
//! | 2 | seq: 1, 2, 3, ... in the order the guest wrote |
//! | 3 | block: where it lies (byte offset / 4096) |
//! | 4, 5 | the log: first block, number of blocks N |
//! | 6..=510 | payload: [`payload_word`]`(run, seq, i)` |
//! | 511 | check: [`checksum`] of words 0..=510 |
//!
//! Record `seq` goes to block `first + ((seq - 1) % N) * P % N` (P a prime
//! above any N): the log is written in a scattered order, and once it wraps
//! the record `seq` replaces `seq - N`. So after a run whose last
//! acknowledged write was A, the image must hold exactly the records
//! `H - N + 1 ..= H` for some H ≥ A (H > A by the writes in flight), each
//! at its block, with a valid checksum and payload. A missing record is a
//! lost write; a stale one (an older seq where a newer belongs) is a lost
//! or reordered write; a record in the wrong block, or a torn one, is
//! corruption. guest/disk.c writes the same format.

use std::collections::HashMap;
use std::io::Read;

use serde::Serialize;

use crate::BLOCK_SIZE;

/// Bytes of one record.
pub const RECORD_SIZE: usize = BLOCK_SIZE;
/// The first word of every record: "TSBREC01".
pub const MAGIC: u64 = u64::from_le_bytes(*b"TSBREC01");
/// Scatters the log: a prime, so every log size below it is coprime.
pub const SCATTER: u64 = 2_654_435_761;
const WORDS: usize = RECORD_SIZE / 8;
const HEADER_WORDS: usize = 6;

/// murmur3's 64-bit finalizer (guest/kv.c's `mix64`).
fn mix64(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    x ^= x >> 33;
    x = x.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    x ^ (x >> 33)
}

/// Word `i` of record `seq`'s payload.
pub fn payload_word(run: u64, seq: u64, i: u64) -> u64 {
    mix64(run.wrapping_add(seq.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_add(i))
}

/// The check word over `words` (all but the last word of a record).
pub fn checksum(words: impl IntoIterator<Item = u64>) -> u64 {
    words.into_iter().fold(0xCBF2_9CE4_8422_2325u64, |h, w| {
        let h = (h ^ w).wrapping_mul(0x0000_0100_0000_01B3);
        h ^ (h >> 32)
    })
}

/// Where the log puts record `seq` (1-based).
pub fn block_of(seq: u64, log_first: u64, log_blocks: u64) -> u64 {
    log_first + ((seq - 1) % log_blocks) * SCATTER % log_blocks
}

/// One record's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// The workload's run.
    pub run: u64,
    /// Its position in the run's writes.
    pub seq: u64,
    /// The block it says it lies in.
    pub block: u64,
    /// The log's first block.
    pub log_first: u64,
    /// The log's size in blocks.
    pub log_blocks: u64,
}

impl Record {
    /// The record's 4 KiB as the guest writes them.
    pub fn encode(&self) -> Vec<u8> {
        let mut words = vec![MAGIC, self.run, self.seq, self.block, self.log_first, self.log_blocks];
        words.extend((HEADER_WORDS..WORDS - 1).map(|i| payload_word(self.run, self.seq, i as u64)));
        words.push(checksum(words.iter().copied()));
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }
}

/// What a 4 KiB block of the image is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Block {
    /// Not a record (zeros, other data).
    Other,
    /// Starts like a record but its check or payload is wrong.
    Torn,
    /// An intact record.
    Record(Record),
}

/// Reads one block of the image.
pub fn parse(block: &[u8]) -> Block {
    let word = |i: usize| u64::from_le_bytes(block[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    if block.len() != RECORD_SIZE || word(0) != MAGIC {
        return Block::Other;
    }
    let record = Record { run: word(1), seq: word(2), block: word(3), log_first: word(4), log_blocks: word(5) };
    let payload_ok = (HEADER_WORDS..WORDS - 1).all(|i| word(i) == payload_word(record.run, record.seq, i as u64));
    if !payload_ok || checksum((0..WORDS - 1).map(word)) != word(WORDS - 1) || record.seq == 0 {
        return Block::Torn;
    }
    Block::Record(record)
}

/// The checker's verdict on an image.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CheckReport {
    /// The run checked (None: the image holds no record).
    pub run: Option<u64>,
    /// Intact records of that run.
    pub records: u64,
    /// The highest seq on the image.
    pub last_seq: u64,
    /// The lowest seq the log should still hold.
    pub first_seq: u64,
    /// Seqs that should be there and are not (the first 20), and how many.
    pub missing: Vec<u64>,
    /// Count of missing seqs.
    pub missing_count: u64,
    /// Blocks that hold a record of the run in the wrong place, or of
    /// another log layout.
    pub misplaced: Vec<u64>,
    /// Blocks that start like a record but are not intact.
    pub torn: Vec<u64>,
    /// Records of other runs (ignored).
    pub other_runs: u64,
    /// The last acknowledged seq given, when it is beyond `last_seq`.
    pub acked_beyond_last: Option<u64>,
}

impl CheckReport {
    /// True when every acknowledged write is there once and intact.
    pub fn ok(&self) -> bool {
        self.missing_count == 0 && self.misplaced.is_empty() && self.torn.is_empty() && self.acked_beyond_last.is_none()
    }
}

/// Reads a whole image and checks the records of `run` (default: the run
/// with the most records). `acked` is the last seq the guest reported as
/// acknowledged (its progress lines' `ack=`), if known.
pub fn check(image: &mut impl Read, run: Option<u64>, acked: Option<u64>) -> std::io::Result<CheckReport> {
    let mut found: Vec<(u64, Record)> = Vec::new();
    let mut torn = Vec::new();
    let mut chunk = vec![0u8; 256 * RECORD_SIZE];
    let mut block_index = 0u64;
    loop {
        let n = read_full(image, &mut chunk)?;
        for block in chunk[..n - n % RECORD_SIZE].chunks_exact(RECORD_SIZE) {
            match parse(block) {
                Block::Other => {}
                Block::Torn => torn.push(block_index),
                Block::Record(r) => found.push((block_index, r)),
            }
            block_index += 1;
        }
        if n < chunk.len() {
            break;
        }
    }
    let mut per_run: HashMap<u64, (u64, u64)> = HashMap::new();
    for (_, r) in &found {
        let e = per_run.entry(r.run).or_default();
        e.0 += 1;
        e.1 = e.1.max(r.seq);
    }
    let run = run.or_else(|| per_run.iter().max_by_key(|(_, &(count, last))| (count, last)).map(|(&run, _)| run));
    let mut report = CheckReport { run, torn, ..CheckReport::default() };
    let Some(run) = run else {
        report.acked_beyond_last = acked.filter(|&a| a > 0);
        return Ok(report);
    };
    let mine: Vec<(u64, Record)> = found.iter().filter(|(_, r)| r.run == run).copied().collect();
    report.other_runs = (found.len() - mine.len()) as u64;
    // The log's layout: what most of the run's records say.
    let mut layouts: HashMap<(u64, u64), u64> = HashMap::new();
    for (_, r) in &mine {
        *layouts.entry((r.log_first, r.log_blocks)).or_default() += 1;
    }
    let (log_first, log_blocks) = layouts.into_iter().max_by_key(|&(_, n)| n).map(|(l, _)| l).unwrap_or((0, 1));
    let mut seqs = std::collections::HashSet::new();
    for (at, r) in mine {
        let placed = r.log_blocks == log_blocks
            && r.log_first == log_first
            && log_blocks > 0
            && r.block == at
            && block_of(r.seq, log_first, log_blocks) == at;
        if placed && seqs.insert(r.seq) {
            report.records += 1;
            report.last_seq = report.last_seq.max(r.seq);
        } else {
            report.misplaced.push(at);
        }
    }
    report.first_seq = report.last_seq.saturating_sub(log_blocks - 1).max(1);
    for seq in report.first_seq..=report.last_seq {
        if !seqs.contains(&seq) {
            report.missing_count += 1;
            if report.missing.len() < 20 {
                report.missing.push(seq);
            }
        }
    }
    report.acked_beyond_last = acked.filter(|&a| a > report.last_seq);
    Ok(report)
}

/// Reads until `buf` is full or the input ends; returns the bytes read.
fn read_full(input: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match input.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An image of `blocks` blocks with the records `seqs` of one run.
    fn image(blocks: u64, first: u64, n: u64, seqs: impl IntoIterator<Item = u64>) -> Vec<u8> {
        let mut img = vec![0u8; blocks as usize * RECORD_SIZE];
        for seq in seqs {
            let block = block_of(seq, first, n);
            let r = Record { run: 7, seq, block, log_first: first, log_blocks: n };
            img[block as usize * RECORD_SIZE..][..RECORD_SIZE].copy_from_slice(&r.encode());
        }
        img
    }

    #[test]
    fn the_log_scatters_over_every_block_once() {
        let n = 1000;
        let mut blocks: Vec<u64> = (1..=n).map(|s| block_of(s, 10, n)).collect();
        blocks.sort();
        assert_eq!(blocks, (10..10 + n).collect::<Vec<_>>());
        assert_eq!(block_of(1 + n, 10, n), block_of(1, 10, n));
    }

    #[test]
    fn a_complete_wrapped_log_passes() {
        let img = image(80, 8, 64, 1..=150);
        let report = check(&mut &img[..], None, Some(149)).unwrap();
        assert!(report.ok(), "{report:?}");
        assert_eq!((report.run, report.records, report.first_seq, report.last_seq), (Some(7), 64, 87, 150));
    }

    #[test]
    fn lost_torn_misplaced_and_unacked_are_found() {
        let mut img = image(80, 8, 64, (1..=40).filter(|&s| s != 17));
        let report = check(&mut &img[..], None, None).unwrap();
        assert_eq!((report.missing_count, report.missing.clone()), (1, vec![17]));
        assert!(!report.ok());
        // A flipped payload byte: torn.
        let b = block_of(5, 8, 64) as usize;
        img[b * RECORD_SIZE + 100] ^= 1;
        let report = check(&mut &img[..], None, None).unwrap();
        assert_eq!(report.torn, vec![b as u64]);
        // A record copied into another block: misplaced.
        let (from, to) = (block_of(6, 8, 64) as usize, 70usize);
        let copy = img[from * RECORD_SIZE..][..RECORD_SIZE].to_vec();
        img[to * RECORD_SIZE..][..RECORD_SIZE].copy_from_slice(&copy);
        let report = check(&mut &img[..], None, None).unwrap();
        assert_eq!(report.misplaced, vec![70]);
        // The guest saw 45 acknowledged but only 40 are there.
        let img = image(80, 8, 64, 1..=40);
        let report = check(&mut &img[..], Some(7), Some(45)).unwrap();
        assert_eq!(report.acked_beyond_last, Some(45));
        assert!(!report.ok());
        assert!(check(&mut &img[..], Some(7), Some(40)).unwrap().ok());
    }

    #[test]
    fn an_empty_image_has_no_run() {
        let img = vec![0u8; 8 * RECORD_SIZE];
        let report = check(&mut &img[..], None, None).unwrap();
        assert_eq!(report.run, None);
        assert!(report.ok());
        assert!(!check(&mut &img[..], None, Some(3)).unwrap().ok());
    }
}
