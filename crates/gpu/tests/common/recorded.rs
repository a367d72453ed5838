//! Pages recorded from the guest's workloads (bench/device/sample_pages.py,
//! packed by bench/device/gpu_prepare.sh), and the two checks the GPU
//! check runs on them and on synthetic pages: byte identity with the CPU
//! codecs, and the same output on every repetition (races).

use std::path::Path;

use tsubame_codec::{CodecList, PageDecoder, PageEncoder, PAGE_SIZE};
use tsubame_gpu::{Backend, EncodedBatch, GpuDecoder, GpuEncoder};

use super::{cpu_decode, cpu_encode, first_difference};

/// Batches of (indices, pages back to back).
pub type Batches = Vec<(Vec<u64>, Vec<u8>)>;

/// Every `WORKLOAD.pages` file in `dir`: records of (index u64 LE, one
/// page), the first save's pages then the same indices from the second;
/// each save becomes one batch.
pub fn recorded(dir: &Path) -> Vec<(String, Batches)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "pages"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no .pages files in {}", dir.display());
    files
        .into_iter()
        .map(|path| {
            let bytes = std::fs::read(&path).unwrap();
            let record = 8 + PAGE_SIZE;
            assert!(bytes.len() % (2 * record) == 0, "{}: not two saves of whole records", path.display());
            let half = bytes.len() / 2;
            let batches = [&bytes[..half], &bytes[half..]]
                .iter()
                .map(|save| {
                    let mut batch = (Vec::new(), Vec::new());
                    for r in save.chunks_exact(record) {
                        batch.0.push(u64::from_le_bytes(r[..8].try_into().unwrap()));
                        batch.1.extend_from_slice(&r[8..]);
                    }
                    batch
                })
                .collect();
            let name = path.file_stem().unwrap().to_string_lossy().into_owned();
            (name, batches)
        })
        .collect()
}

/// Encodes `batches` on `encoder` and on the CPU codecs and demands the
/// same records; decodes each side's records on the other side and
/// demands the pages back. Returns the records and the pages checked.
pub fn identical_to_cpu<B: Backend, D: Backend>(
    encoder: &mut GpuEncoder<B>,
    decoder: &mut GpuDecoder<D>,
    list: &CodecList,
    batches: &Batches,
) -> Result<(Vec<EncodedBatch>, usize), String> {
    let mut cpu = PageEncoder::new(list);
    cpu.keep_codecs_on();
    let mut cpu_dec = PageDecoder::new(list);
    let (mut records, mut pages) = (Vec::new(), 0);
    for (round, (indices, data)) in batches.iter().enumerate() {
        let want = cpu_encode(&mut cpu, indices, data);
        let got = encoder.encode_batch(data, indices).map_err(|e| format!("{list} batch {round}: encode: {e}"))?;
        if let Some(d) = first_difference(&want, &got) {
            return Err(format!("{list} batch {round}: {d}"));
        }
        if cpu_decode(&mut cpu_dec, &got) != *data {
            return Err(format!("{list} batch {round}: the CPU decode of the GPU's records differs"));
        }
        let back = decoder.decode_batch(&want).map_err(|e| format!("{list} batch {round}: decode: {e}"))?;
        if back != *data {
            return Err(format!("{list} batch {round}: the GPU decode of the CPU's records differs"));
        }
        pages += indices.len();
        records.push(got);
    }
    Ok((records, pages))
}

/// The race check: `trials` fresh encoders and decoders on one device run
/// the same batches, and every one must give the first one's records and
/// the original pages, byte for byte. A kernel that races (a claim read
/// while its owner resets it, a write two threads make) shows up as a
/// trial that differs.
pub fn same_every_time<B: Backend>(
    device: &mut B,
    list: &CodecList,
    batches: &Batches,
    max_pages: usize,
    trials: usize,
) -> Result<(), String> {
    let mut first: Option<Vec<EncodedBatch>> = None;
    for trial in 0..trials {
        let mut encoder = GpuEncoder::new(&mut *device, list, max_pages).map_err(|e| e.to_string())?;
        let mut records = Vec::new();
        for (indices, data) in batches {
            records.push(encoder.encode_batch(data, indices).map_err(|e| format!("trial {trial}: {e}"))?);
        }
        drop(encoder);
        match &first {
            None => first = Some(records),
            Some(want) => {
                for (round, (a, b)) in want.iter().zip(&records).enumerate() {
                    if let Some(d) = first_difference(a, b) {
                        return Err(format!("{list}: trial {trial} batch {round} differs from trial 0: {d}"));
                    }
                }
            }
        }
        let mut decoder = GpuDecoder::new(&mut *device, list, max_pages).map_err(|e| e.to_string())?;
        for (round, ((_, data), records)) in batches.iter().zip(first.as_ref().unwrap()).enumerate() {
            let back = decoder.decode_batch(records).map_err(|e| format!("trial {trial}: {e}"))?;
            if back != *data {
                return Err(format!("{list}: trial {trial} batch {round}: the decode differs"));
            }
        }
    }
    Ok(())
}
