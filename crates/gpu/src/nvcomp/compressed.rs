//! Compressed chunks as nvCOMP's batched calls make them: one buffer and
//! the offsets of its chunks.

use super::library::NvcompAlgo;
use crate::GpuError;

/// Compressed chunks, in order: chunk `i` is
/// `data[offsets[i]..offsets[i + 1]]`. LZ4 chunks are raw LZ4 blocks and
/// zstd chunks zstd frames, each decoding to `chunk_bytes` bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Compressed {
    /// The codec.
    pub algo: NvcompAlgo,
    /// The uncompressed size of every chunk.
    pub chunk_bytes: usize,
    /// The compressed chunks, back to back.
    pub data: Vec<u8>,
    /// Where each chunk starts in `data`, and, last, `data.len()`.
    pub offsets: Vec<usize>,
}

impl Compressed {
    /// No chunks yet.
    pub fn new(algo: NvcompAlgo, chunk_bytes: usize) -> Compressed {
        Compressed { algo, chunk_bytes, data: Vec::new(), offsets: vec![0] }
    }

    /// How many chunks.
    pub fn len(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Chunk `i`'s compressed bytes.
    pub fn chunk(&self, i: usize) -> &[u8] {
        &self.data[self.offsets[i]..self.offsets[i + 1]]
    }

    /// Every chunk's compressed bytes, in order.
    pub fn chunks(&self) -> impl Iterator<Item = &[u8]> + '_ {
        self.offsets.windows(2).map(|w| &self.data[w[0]..w[1]])
    }

    /// The compressed size of all chunks.
    pub fn compressed_bytes(&self) -> usize {
        self.data.len()
    }

    /// The uncompressed size of all chunks.
    pub fn uncompressed_bytes(&self) -> usize {
        self.len() * self.chunk_bytes
    }

    pub(crate) fn push(&mut self, chunk: &[u8]) {
        self.data.extend_from_slice(chunk);
        self.offsets.push(self.data.len());
    }

    pub(crate) fn check_offsets(&self) -> Result<(), GpuError> {
        let ok = self.offsets.first() == Some(&0)
            && self.offsets.last() == Some(&self.data.len())
            && self.offsets.windows(2).all(|w| w[0] <= w[1]);
        if ok {
            Ok(())
        } else {
            Err(GpuError::BadBatch("compressed chunks: offsets do not cover the data in order".into()))
        }
    }
}
