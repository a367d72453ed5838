//! lz4 and zstd over a whole batch of records (a PAGES frame payload).
//! Decompression is bounded: a peer cannot make us allocate more than the
//! caller's cap.

use crate::error::CodecError;

/// A general-purpose compressor for batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchCodec {
    /// lz4 (lz4_flex, block format).
    Lz4,
    /// zstd at a level (1 by default).
    Zstd(i32),
}

impl BatchCodec {
    /// Wire id: 1 = lz4, 2 = zstd.
    pub fn id(self) -> u8 {
        match self {
            BatchCodec::Lz4 => 1,
            BatchCodec::Zstd(_) => 2,
        }
    }

    /// Name for statistics.
    pub fn name(self) -> &'static str {
        match self {
            BatchCodec::Lz4 => "lz4",
            BatchCodec::Zstd(_) => "zstd",
        }
    }

    /// Compresses `input` into `out` (cleared first).
    pub fn compress(self, input: &[u8], out: &mut Vec<u8>) {
        out.clear();
        match self {
            BatchCodec::Lz4 => {
                out.resize(lz4_flex::block::get_maximum_output_size(input.len()), 0);
                let n = lz4_flex::block::compress_into(input, out).expect("output sized by get_maximum_output_size");
                out.truncate(n);
            }
            BatchCodec::Zstd(level) => {
                out.resize(zstd::zstd_safe::compress_bound(input.len()), 0);
                let n = zstd::bulk::compress_to_buffer(input, out, level).expect("output sized by compress_bound");
                out.truncate(n);
            }
        }
    }
}

/// Decompresses a batch of codec `id` that claims `len` bytes, at most
/// `cap`, into `out`.
pub fn decompress(id: u8, input: &[u8], len: usize, cap: usize, out: &mut Vec<u8>) -> Result<(), CodecError> {
    let name = match id {
        1 => "lz4",
        2 => "zstd",
        _ => return Err(CodecError::Batch { codec: "batch", detail: format!("unknown compressor {id}") }),
    };
    if len > cap {
        return Err(CodecError::Batch { codec: name, detail: format!("claims {len} bytes, more than {cap}") });
    }
    out.clear();
    out.resize(len, 0);
    let n = match id {
        1 => lz4_flex::block::decompress_into(input, out).map_err(|e| e.to_string()),
        _ => zstd::bulk::decompress_to_buffer(input, out.as_mut_slice()).map_err(|e| e.to_string()),
    }
    .map_err(|detail| CodecError::Batch { codec: name, detail })?;
    if n != len {
        return Err(CodecError::Batch { codec: name, detail: format!("gave {n} bytes, claimed {len}") });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_round_trip_and_bombs_are_refused() {
        let input: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        for codec in [BatchCodec::Lz4, BatchCodec::Zstd(1)] {
            let mut packed = Vec::new();
            codec.compress(&input, &mut packed);
            assert!(packed.len() < input.len() / 4);
            let mut back = Vec::new();
            decompress(codec.id(), &packed, input.len(), 1 << 20, &mut back).unwrap();
            assert_eq!(back, input);
            assert!(decompress(codec.id(), &packed, input.len(), 1000, &mut back).is_err());
            assert!(decompress(codec.id(), &packed, input.len() - 1, 1 << 20, &mut back).is_err());
            assert!(decompress(codec.id(), &packed[..packed.len() / 2], input.len(), 1 << 20, &mut back).is_err());
        }
        assert!(decompress(9, &[], 0, 10, &mut Vec::new()).is_err());
    }
}
