//! What runs without a GPU: the driver probe, NVRTC compilation of every
//! kernel (whenever libnvrtc is found), the nvCOMP probe.

use tsubame_gpu::{cuda, kernels, nvrtc::Nvrtc, Cuda, CudaOptions, GpuError};

#[test]
fn asking_for_the_gpu_without_a_driver_is_one_clear_line() {
    if cuda::driver_present() {
        tsubame_testkit::skip("a CUDA driver is present (tests/gpu.rs covers it)");
        return;
    }
    let e = Cuda::open(CudaOptions::default()).err().expect("no driver, no GPU");
    assert!(matches!(e, GpuError::NoDriver));
    let line = e.to_string();
    assert!(line.starts_with("no CUDA driver found"), "{line}");
    assert!(!line.contains('\n'));
}

#[test]
fn nvrtc_compiles_every_kernel() {
    let nvrtc = match Nvrtc::load() {
        Ok(n) => n,
        Err(e) => {
            tsubame_testkit::skip_unless_required("TSUBAME_REQUIRE_GPU", e);
            return;
        }
    };
    println!("NVRTC {:?} from {}", nvrtc.version(), nvrtc.path.display());
    for arch in ["compute_80", "compute_90"] {
        let ptx = nvrtc.compile(&kernels::source(), "tsubame.cu", arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        for k in kernels::KERNELS {
            assert!(ptx.contains(&format!(".entry {k}(")), "{arch}: no entry {k}");
        }
        println!("{arch}: {} kernels, {} bytes of PTX", kernels::KERNELS.len(), ptx.len());
    }
    let bad = nvrtc.compile("extern \"C\" __global__ void k() { undeclared(); }", "bad.cu", "compute_90");
    assert!(matches!(bad, Err(GpuError::Compile { log }) if log.contains("undeclared")));
}

#[test]
fn nvcomp_absent_is_a_clear_error() {
    match tsubame_gpu::nvcomp::Nvcomp::load() {
        Ok(n) => println!("nvCOMP {} at {} has {:?}", n.version_string(), n.path.display(), n.has),
        Err(e) => {
            let line = e.to_string();
            assert!(line.starts_with("nvCOMP unavailable: libnvcomp.so not found"), "{line}");
            tsubame_testkit::skip_unless_required("TSUBAME_REQUIRE_GPU", line);
        }
    }
}

/// The host-only nvCOMP calls, wherever libnvcomp 6 loads (here with
/// `TSUBAME_NVCOMP=…/libnvcomp.so.6`): every symbol is there, the options
/// structs passed by value give sane alignments and output bounds, and a
/// batch without a driver is `NoDriver`.
#[test]
fn nvcomp_loads_and_answers_its_host_only_calls() {
    use tsubame_gpu::nvcomp::{Nvcomp, NvcompAlgo, NvcompBatch, API_MAJOR, SYMBOLS};
    let n = match Nvcomp::load() {
        Ok(n) if n.version.map(|v| v / 1000) == Some(API_MAJOR) => n,
        Ok(n) => {
            tsubame_testkit::skip(format!("{} is nvCOMP {}, not {API_MAJOR}", n.path.display(), n.version_string()));
            return;
        }
        Err(e) => {
            tsubame_testkit::skip(e);
            return;
        }
    };
    assert_eq!(n.has, SYMBOLS.to_vec(), "{}", n.path.display());
    for algo in NvcompAlgo::ALL {
        let (c, d) = n.alignments(algo).unwrap();
        for a in [c.input, c.output, c.temp, d.input, d.output, d.temp] {
            assert!(a.is_power_of_two() && a <= 256, "{algo}: {c:?} {d:?}");
        }
        let max = n.max_compressed_chunk_bytes(algo, 4096).unwrap();
        assert!((4096..4096 + 512).contains(&max), "{algo}: {max}");
        println!(
            "nvCOMP {} {algo}: compress {c:?}, decompress {d:?}, a 4096-byte chunk ≤ {max} bytes",
            n.version_string()
        );
        if !cuda::driver_present() {
            let e = NvcompBatch::open(&n, algo, 0, 16, 4096).err().expect("no driver, no batch");
            assert!(matches!(e, GpuError::NoDriver), "{e}");
        }
    }
}

#[test]
fn nvcomp_names_and_compressed_chunks() {
    use tsubame_gpu::nvcomp::{status_name, Compressed, NvcompAlgo};
    for algo in NvcompAlgo::ALL {
        assert_eq!(algo.to_string().parse::<NvcompAlgo>(), Ok(algo));
    }
    assert!("lz5".parse::<NvcompAlgo>().unwrap_err().contains("lz4, zstd"));
    let e = GpuError::NvcompChunk { call: "nvcompBatchedZstdDecompressAsync", chunk: 7, status: 12 };
    assert_eq!(
        e.to_string(),
        "nvCOMP nvcompBatchedZstdDecompressAsync failed on chunk 7 with status 12 (nvcompErrorCannotDecompress)"
    );
    assert_eq!(status_name(1000), "nvcompErrorCudaError");
    let c =
        Compressed { algo: NvcompAlgo::Lz4, chunk_bytes: 4096, data: b"abcdef".to_vec(), offsets: vec![0, 2, 2, 6] };
    assert_eq!((c.len(), c.compressed_bytes(), c.uncompressed_bytes()), (3, 6, 3 * 4096));
    assert_eq!(c.chunks().collect::<Vec<_>>(), [&b"ab"[..], b"", b"cdef"]);
    assert_eq!(c.chunk(2), b"cdef");
    assert!(Compressed::new(NvcompAlgo::Zstd, 4096).is_empty());
}
