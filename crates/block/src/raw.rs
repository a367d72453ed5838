//! A raw image file opened with `O_DIRECT`, so the host's page cache does
//! not hide what storage costs: every guest read that misses tsubame's own
//! [`crate::BlockCache`] goes to the disk. O_DIRECT wants offsets, lengths
//! and buffer addresses aligned, so I/O goes through an aligned bounce
//! buffer in whole 4 KiB blocks (partial blocks are read, patched and
//! written back).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::{check_range, Backend, BlockError, BLOCK_SIZE};

/// A buffer whose usable part starts on a [`BLOCK_SIZE`] boundary.
#[derive(Default)]
struct AlignedBuffer {
    storage: Vec<u8>,
}

impl AlignedBuffer {
    /// `len` bytes starting on a block boundary (contents unspecified).
    fn get(&mut self, len: usize) -> &mut [u8] {
        if self.storage.len() < len + BLOCK_SIZE {
            self.storage = vec![0; len + BLOCK_SIZE];
        }
        let start = self.storage.as_ptr().align_offset(BLOCK_SIZE);
        &mut self.storage[start..start + len]
    }
}

/// A raw image file.
pub struct RawFile {
    file: File,
    path: PathBuf,
    size: u64,
    direct: bool,
    bounce: AlignedBuffer,
}

impl RawFile {
    /// Opens an existing image read-write, with O_DIRECT where the file
    /// system allows it (else buffered; [`RawFile::direct`] tells).
    pub fn open(path: &Path) -> Result<RawFile, BlockError> {
        let open_err = |source| BlockError::Open { path: path.display().to_string(), source };
        let mut options = OpenOptions::new();
        options.read(true).write(true);
        let (file, direct) = match options.clone().custom_flags(libc::O_DIRECT).open(path) {
            Ok(file) => (file, true),
            // Some file systems (older tmpfs) refuse O_DIRECT.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => (options.open(path).map_err(open_err)?, false),
            Err(e) => return Err(open_err(e)),
        };
        let meta = file.metadata().map_err(open_err)?;
        if !meta.is_file() {
            return Err(open_err(std::io::Error::other("not a regular file")));
        }
        let size = meta.len();
        if size == 0 || !size.is_multiple_of(BLOCK_SIZE as u64) {
            return Err(BlockError::BadSize { path: path.display().to_string(), size });
        }
        Ok(RawFile { file, path: path.to_path_buf(), size, direct, bounce: AlignedBuffer::default() })
    }

    /// Creates (or truncates) an image of `size` bytes of zeros, sparse.
    pub fn create(path: &Path, size: u64) -> Result<(), BlockError> {
        if size == 0 || !size.is_multiple_of(BLOCK_SIZE as u64) {
            return Err(BlockError::BadSize { path: path.display().to_string(), size });
        }
        let open_err = |source| BlockError::Open { path: path.display().to_string(), source };
        let file = File::create(path).map_err(open_err)?;
        file.set_len(size).map_err(open_err)
    }

    /// True when the file was opened with O_DIRECT.
    pub fn direct(&self) -> bool {
        self.direct
    }

    /// The image's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The whole blocks that cover `[offset, offset + len)`.
    fn blocks_around(offset: u64, len: usize) -> (u64, usize) {
        let block = BLOCK_SIZE as u64;
        let start = offset / block * block;
        let end = (offset + len as u64).div_ceil(block) * block;
        (start, (end - start) as usize)
    }
}

fn io_err(what: &'static str) -> impl FnOnce(std::io::Error) -> BlockError {
    move |source| BlockError::Io { what, source }
}

impl Backend for RawFile {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), BlockError> {
        check_range(offset, buf.len(), self.size)?;
        let (start, len) = Self::blocks_around(offset, buf.len());
        let bounce = self.bounce.get(len);
        self.file.read_exact_at(bounce, start).map_err(io_err("read"))?;
        let skip = (offset - start) as usize;
        buf.copy_from_slice(&bounce[skip..skip + buf.len()]);
        Ok(())
    }

    fn write_at(&mut self, offset: u64, data: &[u8]) -> Result<(), BlockError> {
        check_range(offset, data.len(), self.size)?;
        let (start, len) = Self::blocks_around(offset, data.len());
        let end = start + len as u64;
        let bounce = self.bounce.get(len);
        // Blocks only partly written keep their other bytes.
        let first = &mut bounce[..BLOCK_SIZE];
        if offset != start {
            self.file.read_exact_at(first, start).map_err(io_err("read"))?;
        }
        if (offset + data.len() as u64) != end && (len > BLOCK_SIZE || offset == start) {
            let last = &mut bounce[len - BLOCK_SIZE..];
            self.file.read_exact_at(last, end - BLOCK_SIZE as u64).map_err(io_err("read"))?;
        }
        let skip = (offset - start) as usize;
        bounce[skip..skip + data.len()].copy_from_slice(data);
        self.file.write_all_at(bounce, start).map_err(io_err("write"))
    }

    fn flush(&mut self) -> Result<(), BlockError> {
        self.file.sync_data().map_err(io_err("flush"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(name: &str, size: u64) -> PathBuf {
        let path = std::env::temp_dir().join(format!("tsubame-raw-{name}-{}.img", std::process::id()));
        RawFile::create(&path, size).unwrap();
        path
    }

    #[test]
    fn unaligned_sectors_round_trip() {
        let path = image("rt", 64 << 10);
        let mut disk = RawFile::open(&path).unwrap();
        assert_eq!(disk.size(), 64 << 10);
        let data: Vec<u8> = (0..3 * 512).map(|i| (i * 7 % 251) as u8).collect();
        // Starts mid-block, ends mid-block, crosses a block boundary.
        disk.write_at(7 * 512, &data).unwrap();
        let mut back = vec![0; data.len()];
        disk.read_at(7 * 512, &mut back).unwrap();
        assert_eq!(back, data);
        // Neighbours stay zero.
        let mut around = vec![0xAA; 8192];
        disk.read_at(0, &mut around).unwrap();
        assert!(around[..7 * 512].iter().all(|&b| b == 0));
        assert_eq!(&around[7 * 512..10 * 512], &data[..]);
        assert!(around[10 * 512..].iter().all(|&b| b == 0));
        disk.flush().unwrap();
        // What was written is in the file for any other opener.
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[7 * 512..10 * 512], &data[..]);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn out_of_range_and_bad_images_are_errors() {
        let path = image("oor", 8192);
        let mut disk = RawFile::open(&path).unwrap();
        assert!(disk.read_at(8192, &mut [0; 512]).is_err());
        assert!(disk.write_at(4096, &[0; 8192]).is_err());
        assert!(disk.read_at(100, &mut [0; 512]).is_err());
        std::fs::write(&path, [0u8; 1000]).unwrap();
        assert!(matches!(RawFile::open(&path), Err(BlockError::BadSize { size: 1000, .. })));
        std::fs::remove_file(&path).unwrap();
        let err = RawFile::open(&path).err().unwrap();
        assert!(matches!(err, BlockError::Open { .. }), "{err}");
    }
}
