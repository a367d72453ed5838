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
        Ok(n) => println!("nvCOMP at {} has {:?}", n.path.display(), n.has),
        Err(e) => {
            let line = e.to_string();
            assert!(line.starts_with("nvCOMP unavailable: libnvcomp.so not found"), "{line}");
            tsubame_testkit::skip_unless_required("TSUBAME_REQUIRE_GPU", line);
        }
    }
}
