//! Compiles the kernel emulator (kernels/emu.cpp): the CUDA sources built
//! for the host, so the tests check the kernels' logic without a GPU.

fn main() {
    for f in ["emu.cpp", "common.cuh", "zero.cu", "rle.cu", "xbzrle.cu", "dedup.cu", "pack.cu"] {
        println!("cargo:rerun-if-changed=kernels/{f}");
    }
    cc::Build::new()
        .cpp(true)
        .file("kernels/emu.cpp")
        .include("kernels")
        .flag_if_supported("-std=c++17")
        .flag_if_supported("-O2")
        .flag_if_supported("-fno-strict-aliasing")
        .warnings(true)
        .compile("tsubame_gpu_emu");
}
