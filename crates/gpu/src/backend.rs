//! What the batch encoder needs from a device: memory, copies, kernel
//! launches, waiting. Two implementations: [`crate::cuda::Cuda`] (a real
//! GPU through the driver API) and [`crate::emu::Emulator`] (the same
//! kernels compiled for the host and run one thread at a time, for tests
//! without a GPU). Work is queued on a *lane* (a CUDA stream); lanes let
//! the copies of one batch overlap the kernels of another.

use crate::GpuError;

/// A device address (a CUdeviceptr, or a host address in the emulator).
pub type DevPtr = u64;

/// A kernel argument, passed by value.
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    /// A device pointer.
    Ptr(DevPtr),
    /// A 32-bit unsigned integer.
    U32(u32),
}

/// The packing of `args` as `cuLaunchKernel` wants it: each argument's
/// bytes at its own address, and an array of those addresses.
pub(crate) struct Packed {
    values: Vec<u64>,
}

impl Packed {
    pub(crate) fn new(args: &[Arg]) -> Packed {
        Packed {
            values: args
                .iter()
                .map(|a| match *a {
                    Arg::Ptr(p) => p,
                    // The low 4 bytes (little-endian) are the u32.
                    Arg::U32(v) => u64::from(v),
                })
                .collect(),
        }
    }

    /// Pointers to each value; valid while `self` lives and is not moved.
    pub(crate) fn pointers(&mut self) -> Vec<*mut std::ffi::c_void> {
        self.values.iter_mut().map(|v| (v as *mut u64).cast()).collect()
    }
}

/// A device that runs the kernels of [`crate::kernels`].
pub trait Backend {
    /// Lanes (streams) this backend has.
    fn lanes(&self) -> usize;
    /// Allocates `bytes` of device memory, zeroed.
    fn alloc(&mut self, bytes: usize) -> Result<DevPtr, GpuError>;
    /// Copies `src` to `dst` on `lane` (staged through pinned memory; the
    /// caller may reuse `src` at once).
    fn upload(&mut self, lane: usize, dst: DevPtr, src: &[u8]) -> Result<(), GpuError>;
    /// Queues a copy of `len` bytes at `src` back to the host on `lane`;
    /// returns where they will be in [`Backend::staged`] after a wait.
    fn download(&mut self, lane: usize, src: DevPtr, len: usize) -> Result<usize, GpuError>;
    /// Queues kernel `name` with `grid` blocks of `block` threads.
    fn launch(&mut self, lane: usize, name: &'static str, grid: u32, block: u32, args: &[Arg]) -> Result<(), GpuError>;
    /// Makes later work on `lane` wait for the work queued so far on
    /// `after` (an event), without the host waiting.
    fn order(&mut self, lane: usize, after: usize) -> Result<(), GpuError>;
    /// Waits until everything queued on `lane` is done (per the wait
    /// policy), then the downloads can be read.
    fn wait(&mut self, lane: usize) -> Result<(), GpuError>;
    /// Downloaded bytes of `lane`, from offset `at` (valid after `wait`
    /// until the next `reset_staging`).
    fn staged(&self, lane: usize, at: usize, len: usize) -> &[u8];
    /// Starts reusing `lane`'s staging buffers (its work is done).
    fn reset_staging(&mut self, lane: usize);
}

/// Threads per block for the one-thread-per-item kernels.
pub const BLOCK: u32 = 256;

/// Blocks for `items` threads of [`BLOCK`].
pub fn blocks(items: usize) -> u32 {
    items.div_ceil(BLOCK as usize).max(1) as u32
}

/// A borrowed backend is a backend: one opened GPU serves encoders made
/// one after another (the race check makes a fresh one per trial; the
/// GPU's module and streams are set up once).
impl<B: Backend + ?Sized> Backend for &mut B {
    fn lanes(&self) -> usize {
        (**self).lanes()
    }
    fn alloc(&mut self, bytes: usize) -> Result<DevPtr, GpuError> {
        (**self).alloc(bytes)
    }
    fn upload(&mut self, lane: usize, dst: DevPtr, src: &[u8]) -> Result<(), GpuError> {
        (**self).upload(lane, dst, src)
    }
    fn download(&mut self, lane: usize, src: DevPtr, len: usize) -> Result<usize, GpuError> {
        (**self).download(lane, src, len)
    }
    fn launch(&mut self, lane: usize, name: &'static str, grid: u32, block: u32, args: &[Arg]) -> Result<(), GpuError> {
        (**self).launch(lane, name, grid, block, args)
    }
    fn order(&mut self, lane: usize, after: usize) -> Result<(), GpuError> {
        (**self).order(lane, after)
    }
    fn wait(&mut self, lane: usize) -> Result<(), GpuError> {
        (**self).wait(lane)
    }
    fn staged(&self, lane: usize, at: usize, len: usize) -> &[u8] {
        (**self).staged(lane, at, len)
    }
    fn reset_staging(&mut self, lane: usize) {
        (**self).reset_staging(lane)
    }
}
