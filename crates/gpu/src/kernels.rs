//! The CUDA C sources of the kernels, compiled at run time by NVRTC.

/// The sources, in the order they are concatenated.
pub const SOURCES: [(&str, &str); 6] = [
    ("common.cuh", include_str!("../kernels/common.cuh")),
    ("zero.cu", include_str!("../kernels/zero.cu")),
    ("rle.cu", include_str!("../kernels/rle.cu")),
    ("xbzrle.cu", include_str!("../kernels/xbzrle.cu")),
    ("dedup.cu", include_str!("../kernels/dedup.cu")),
    ("pack.cu", include_str!("../kernels/pack.cu")),
];

/// Every kernel (`extern "C" __global__`) in the sources.
pub const KERNELS: [&str; 27] = [
    "fill_u32",
    "zero_detect",
    "batch_init",
    "rle_size",
    "rle_write",
    "rle_decode",
    "xb_ev_encode",
    "xb_ev_decode",
    "xb_claim",
    "xb_plan",
    "xb_masks",
    "xb_encode",
    "xb_update",
    "xb_apply",
    "dd_hash",
    "dd_plan",
    "dd_encode",
    "dd_finish",
    "dd_update",
    "dd_dec_prep",
    "dd_plan_dec",
    "dd_dec_refs",
    "scan_parts",
    "scan_sums",
    "scan_write",
    "pack",
    "dec_copy",
];

/// One translation unit: the sources concatenated (NVRTC gets no include
/// files).
pub fn source() -> String {
    let mut s = String::new();
    for (name, text) in SOURCES {
        s.push_str(&format!("// ---- {name}\n"));
        s.push_str(text);
        s.push('\n');
    }
    s
}

/// The kernel names declared in the sources, by reading them.
pub fn declared() -> Vec<String> {
    let all = source();
    let mut out = Vec::new();
    for part in all.split("extern \"C\" __global__ void ").skip(1) {
        if let Some(name) = part.split('(').next() {
            out.push(name.trim().to_string());
        }
    }
    out
}
