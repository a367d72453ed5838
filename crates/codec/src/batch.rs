//! lz4 and zstd over a whole batch (a buffer of page records or of pages).
//!
//! Batch payload on the wire: `compressor u8, length u32 (decompressed
//! bytes), compressed bytes` — the caller frames it; this module produces
//! and checks the compressed bytes. lz4 is the block format (`lz4_flex`),
//! zstd a single frame. Decompression writes into a buffer of the claimed
//! length, which must not exceed the caller's cap: a peer cannot make us
//! allocate more than that, however the bytes decompress.

use crate::error::CodecError;

/// A general-purpose compressor for batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchCodec {
    /// lz4 (lz4_flex, block format).
    Lz4,
    /// zstd at a level (1 by default).
    Zstd(i32),
}

/// Wire id of lz4 batches.
pub const ID_LZ4: u8 = 1;
/// Wire id of zstd batches.
pub const ID_ZSTD: u8 = 2;

impl BatchCodec {
    /// Wire id: [`ID_LZ4`] or [`ID_ZSTD`].
    pub fn id(self) -> u8 {
        match self {
            BatchCodec::Lz4 => ID_LZ4,
            BatchCodec::Zstd(_) => ID_ZSTD,
        }
    }

    /// Name for statistics.
    pub fn name(self) -> &'static str {
        match self {
            BatchCodec::Lz4 => "lz4",
            BatchCodec::Zstd(_) => "zstd",
        }
    }

    /// Compresses `input` into `out` (cleared first). One-off form of
    /// [`BatchCompressor::compress`] (zstd builds a fresh context).
    pub fn compress(self, input: &[u8], out: &mut Vec<u8>) {
        BatchCompressor::new(self).compress(input, out)
    }
}

/// Longest output of compressing `len` bytes.
pub fn max_compressed_len(codec: BatchCodec, len: usize) -> usize {
    match codec {
        BatchCodec::Lz4 => lz4_flex::block::get_maximum_output_size(len),
        BatchCodec::Zstd(_) => zstd::zstd_safe::compress_bound(len),
    }
}

/// A compressor that keeps its zstd context between batches.
pub struct BatchCompressor {
    codec: BatchCodec,
    zstd: Option<zstd::bulk::Compressor<'static>>,
}

impl BatchCompressor {
    /// A compressor for `codec`.
    pub fn new(codec: BatchCodec) -> BatchCompressor {
        BatchCompressor { codec, zstd: None }
    }

    /// The codec.
    pub fn codec(&self) -> BatchCodec {
        self.codec
    }

    /// Compresses `input` into `out` (cleared first).
    pub fn compress(&mut self, input: &[u8], out: &mut Vec<u8>) {
        out.clear();
        out.resize(max_compressed_len(self.codec, input.len()), 0);
        let n = match self.codec {
            BatchCodec::Lz4 => {
                lz4_flex::block::compress_into(input, out).expect("output sized by get_maximum_output_size")
            }
            BatchCodec::Zstd(level) => {
                let zstd = self
                    .zstd
                    .get_or_insert_with(|| zstd::bulk::Compressor::new(level).expect("zstd levels 1..=19 are valid"));
                zstd.compress_to_buffer(input, &mut out[..]).expect("output sized by compress_bound")
            }
        };
        out.truncate(n);
    }
}

/// A decompressor that keeps its zstd context between batches.
#[derive(Default)]
pub struct BatchDecompressor {
    zstd: Option<zstd::bulk::Decompressor<'static>>,
}

impl BatchDecompressor {
    /// Decompresses a batch of compressor `id` that claims `len` bytes, at
    /// most `cap`, into `out` (exactly `len` bytes on success).
    pub fn decompress(
        &mut self,
        id: u8,
        input: &[u8],
        len: usize,
        cap: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), CodecError> {
        let name = match id {
            ID_LZ4 => "lz4",
            ID_ZSTD => "zstd",
            _ => return Err(CodecError::Batch { codec: "batch", detail: format!("unknown compressor {id}") }),
        };
        let fail = |detail: String| CodecError::Batch { codec: name, detail };
        if len > cap {
            return Err(fail(format!("claims {len} bytes, more than {cap}")));
        }
        out.clear();
        out.resize(len, 0);
        let n = if id == ID_LZ4 {
            lz4_flex::block::decompress_into(input, out).map_err(|e| fail(e.to_string()))?
        } else {
            if self.zstd.is_none() {
                self.zstd = Some(zstd::bulk::Decompressor::new().map_err(|e| fail(e.to_string()))?);
            }
            let zstd = self.zstd.as_mut().expect("just set");
            zstd.decompress_to_buffer(input, &mut out[..]).map_err(|e| fail(e.to_string()))?
        };
        if n != len {
            return Err(fail(format!("gave {n} bytes, claimed {len}")));
        }
        Ok(())
    }
}

/// One-off form of [`BatchDecompressor::decompress`].
pub fn decompress(id: u8, input: &[u8], len: usize, cap: usize, out: &mut Vec<u8>) -> Result<(), CodecError> {
    BatchDecompressor::default().decompress(id, input, len, cap, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_round_trip_and_bombs_are_refused() {
        let input: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        for codec in [BatchCodec::Lz4, BatchCodec::Zstd(1), BatchCodec::Zstd(19)] {
            let mut packer = BatchCompressor::new(codec);
            let mut unpacker = BatchDecompressor::default();
            let mut packed = Vec::new();
            let mut back = Vec::new();
            for _ in 0..2 {
                packer.compress(&input, &mut packed);
                assert!(packed.len() < input.len() / 4);
                unpacker.decompress(codec.id(), &packed, input.len(), 1 << 20, &mut back).unwrap();
                assert_eq!(back, input);
            }
            let e = decompress(codec.id(), &packed, input.len(), 1000, &mut back).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!("{} batch does not decompress: claims 100000 bytes, more than 1000", codec.name())
            );
            assert!(decompress(codec.id(), &packed, input.len() - 1, 1 << 20, &mut back).is_err());
            assert!(decompress(codec.id(), &packed, input.len() + 1, 1 << 20, &mut back).is_err());
            assert!(decompress(codec.id(), &packed[..packed.len() / 2], input.len(), 1 << 20, &mut back).is_err());
        }
        assert!(decompress(9, &[], 0, 10, &mut Vec::new()).is_err());
    }

    #[test]
    fn a_bomb_stays_within_the_claimed_length() {
        // 64 MiB of zeros compresses to a few KiB; claiming 1 MiB must fail
        // without writing past 1 MiB.
        let zeros = vec![0u8; 64 << 20];
        for codec in [BatchCodec::Lz4, BatchCodec::Zstd(1)] {
            let mut packed = Vec::new();
            codec.compress(&zeros, &mut packed);
            let mut out = Vec::new();
            assert!(decompress(codec.id(), &packed, 1 << 20, 1 << 20, &mut out).is_err());
            assert!(out.capacity() < 2 << 20);
        }
    }

    #[test]
    fn zstd_frames_compressed_apart_decode_as_one_batch() {
        // nvCOMP compresses a batch as independent chunks; their frames,
        // back to back, are one zstd batch on the wire.
        let input: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8 ^ (i >> 12) as u8).collect();
        let mut frames = Vec::new();
        for chunk in input.chunks(65536) {
            frames.extend_from_slice(&zstd::bulk::compress(chunk, 1).unwrap());
        }
        let mut back = Vec::new();
        decompress(ID_ZSTD, &frames, input.len(), 1 << 20, &mut back).unwrap();
        assert!(back == input);
    }
}
