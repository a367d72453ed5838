//! What VM to boot: the options `run` and `demo` share, checked, and the
//! boot itself.

use clap::Args;
use tsubame_vmm::{guest_elf, Vm, VmConfig};

use crate::units::parse_size;
use crate::usage_error;

/// What VM to boot.
#[derive(Args, Debug, Clone)]
pub struct VmArgs {
    /// Guest memory, e.g. 512M, 1G, 16G (8 MiB to 64 GiB, a multiple of 2 MiB).
    #[arg(long, default_value = "1G")]
    pub memory: String,
    /// Guest workload: idle, fill-zero, fill-random, kv, bwmem, sparse,
    /// zero-clear, stream; with --disk also disk-seq, disk-random, disk-mixed.
    #[arg(long, default_value = "kv")]
    pub workload: String,
    /// Workload parameter KEY=VALUE (wss=SIZE, rate=MB/s, seed=N,
    /// disk=SIZE: the part of the disk a disk workload uses); repeatable.
    #[arg(long = "workload-arg", value_name = "KEY=VALUE")]
    pub workload_args: Vec<String>,
    /// Back guest memory with 4 KiB pages only (default: ask for transparent
    /// huge pages, as QEMU does).
    #[arg(long)]
    pub no_hugepages: bool,
    /// A virtio-blk disk on this storage: a raw image file (opened with
    /// O_DIRECT; make one with `tsubame disk-create`) or an NBD export,
    /// nbd://HOST[:PORT]/EXPORT. A migrating VM's destination opens the
    /// same storage, so it must be shared.
    #[arg(long, value_name = "FILE|nbd://HOST[:PORT]/EXPORT")]
    pub disk: Option<String>,
    /// The host block cache in front of --disk (LRU, write-through, like
    /// a host's page cache); 0 for none. A migration sends its hottest
    /// blocks' list ahead so the destination's cache is warm too.
    #[arg(long, value_name = "SIZE", default_value = "256M")]
    pub block_cache: String,
}

impl VmArgs {
    /// Memory size in bytes, checked.
    pub fn memory_bytes(&self) -> anyhow::Result<u64> {
        parse_size(&self.memory).map_err(|e| usage_error(format!("--memory: {e}")))
    }

    /// The workload's parameters, checked as far as the host can.
    pub fn parsed_workload_args(&self) -> anyhow::Result<Vec<(String, String)>> {
        let mut out = Vec::new();
        for arg in &self.workload_args {
            let Some((key, value)) = arg.split_once('=') else {
                return Err(usage_error(format!("--workload-arg '{arg}': expected KEY=VALUE")));
            };
            let valid = match key {
                "wss" | "disk" => parse_size(value).is_ok(),
                "rate" | "seed" => value.parse::<u64>().is_ok(),
                _ => true, // unknown names are reported by guest_elf::cmdline
            };
            if !valid {
                return Err(usage_error(format!("--workload-arg {key}: '{value}' is not a valid value")));
            }
            out.push((key.to_string(), value.to_string()));
        }
        Ok(out)
    }

    /// The workload as a guest command line (without tsc_khz).
    pub fn description(&self) -> String {
        let mut d = format!("workload={}", self.workload);
        for a in &self.workload_args {
            d.push(' ');
            d.push_str(a);
        }
        d
    }

    /// Creates the VM and loads the guest with this workload.
    pub fn boot(&self) -> anyhow::Result<Vm> {
        let memory_bytes = self.memory_bytes()?;
        let args = self.parsed_workload_args()?;
        let disk = self.disk_spec()?;
        // Check names before touching KVM, so usage errors come first.
        guest_elf::cmdline(&self.workload, &args, 0).map_err(usage_error)?;
        let mut vm = Vm::create(&VmConfig { memory_bytes, hugepages: !self.no_hugepages }).map_err(crate::vm_error)?;
        let cmdline = guest_elf::cmdline(&self.workload, &args, vm.tsc_khz()).map_err(usage_error)?;
        vm.load_guest(guest_elf::GUEST_ELF, &cmdline).map_err(crate::vm_error)?;
        if let Some((spec, cache_bytes)) = disk {
            vm.attach_disk(&spec, cache_bytes).map_err(crate::vm_error)?;
        }
        Ok(vm)
    }

    /// The disk and its cache's size, checked.
    pub fn disk_spec(&self) -> anyhow::Result<Option<(tsubame_block::DiskSpec, u64)>> {
        let cache_bytes = parse_size(&self.block_cache).map_err(|e| usage_error(format!("--block-cache: {e}")))?;
        match &self.disk {
            None if self.workload.starts_with("disk-") => Err(usage_error(format!(
                "workload {} needs a disk: add --disk FILE or --disk nbd://HOST/EXPORT",
                self.workload
            ))),
            None => Ok(None),
            Some(text) => {
                let spec = text.parse().map_err(|e: tsubame_block::BlockError| usage_error(format!("--disk: {e}")))?;
                Ok(Some((spec, cache_bytes)))
            }
        }
    }
}
