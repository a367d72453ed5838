//! `--local-memory` and `--far-memory`, shared by `run` and `demo`, and
//! `--far-memory auto`, which starts a memory host (`nbdkit memory`) here.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::Args;
use tsubame_farmem::{FarConfig, FarSetup};
use tsubame_vmm::Vm;

use crate::units::parse_size;
use crate::usage_error;
use crate::vm_args::VmArgs;

/// Far memory's options.
#[derive(Args, Debug, Clone, Default)]
pub struct FarArgs {
    /// Keep at most this much guest memory resident (with --far-memory):
    /// colder pages live on the memory host and come back on access.
    #[arg(long, value_name = "SIZE", requires = "far_memory")]
    pub local_memory: Option<String>,
    /// Borrow a memory host's RAM: an NBD export at least as large as
    /// guest memory (nbd://HOST[:PORT]/EXPORT, nbd+unix:///EXPORT?socket=PATH,
    /// e.g. served by `nbdkit memory 8G`), or `auto` to start `nbdkit
    /// memory` on this machine. Give two (repeat the flag, or separate with
    /// a comma) to mirror every page to both: losing one pauses nothing;
    /// losing both pauses the VM.
    #[arg(long, value_name = "URI", requires = "local_memory", value_delimiter = ',')]
    pub far_memory: Vec<String>,
}

/// A memory host this process started for `--far-memory auto`: `nbdkit
/// memory` on a unix socket, killed (its memory freed) on drop.
pub struct AutoMemoryHost {
    child: Child,
    dir: PathBuf,
}

impl Drop for AutoMemoryHost {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl AutoMemoryHost {
    /// `nbdkit memory BYTES` on a fresh socket; its URI.
    fn start(bytes: u64) -> anyhow::Result<(AutoMemoryHost, String)> {
        install_nbdkit_if_missing()?;
        let dir = std::env::temp_dir().join(format!("tsubame-memhost-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let socket = dir.join("memory.sock");
        let child = Command::new("nbdkit")
            .args(["-f", "--exit-with-parent", "-U"])
            .arg(&socket)
            .args(["memory", &bytes.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => anyhow::anyhow!(
                    "--far-memory auto starts `nbdkit memory`, which is not installed here: apt-get install nbdkit \
                     (or name a memory host: --far-memory nbd://HOST[:PORT]/EXPORT)"
                ),
                _ => anyhow::anyhow!("--far-memory auto: cannot start nbdkit: {e}"),
            })?;
        let mut host = AutoMemoryHost { child, dir };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            if let Some(status) = host.child.try_wait()? {
                anyhow::bail!("--far-memory auto: nbdkit exited ({status}) before it listened");
            }
            if Instant::now() > deadline {
                anyhow::bail!("--far-memory auto: nbdkit did not listen on {} within 10 s", socket.display());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok((host, format!("nbd+unix:///?socket={}", socket.display())))
    }
}

/// Runs the project's set-up for nbdkit when it is missing and this binary
/// was built from a checkout that has scripts/setup.sh (as README's
/// `cargo run` does): it installs nbdkit as root, or prints the one sudo
/// command and fails.
fn install_nbdkit_if_missing() -> anyhow::Result<()> {
    let present = Command::new("nbdkit")
        .arg("--version")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    let setup = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/setup.sh");
    if present || !setup.exists() {
        return Ok(());
    }
    eprintln!("--far-memory auto needs nbdkit: running {} nbdkit", setup.display());
    let status = Command::new("bash").arg(&setup).arg("nbdkit").status()?;
    if !status.success() {
        anyhow::bail!("--far-memory auto needs nbdkit, which scripts/setup.sh did not install (see above)");
    }
    Ok(())
}

/// A booted VM, not started yet, with far memory prepared when asked for.
pub struct BootedVm {
    /// The VM.
    pub vm: Vm,
    /// Far memory, registered with the VM's memory: start it once the VM
    /// runs.
    pub far: Option<FarSetup>,
    /// With `--far-memory auto`, the memory host: it must live as long as
    /// the VM.
    pub memory_host: Option<AutoMemoryHost>,
}

impl FarArgs {
    /// Boots `vm_args` (without huge pages when far memory moves its
    /// 4 KiB pages) and prepares far memory for it.
    pub fn boot(&self, vm_args: &VmArgs) -> anyhow::Result<BootedVm> {
        let far_config = self.config(vm_args.memory_bytes()?)?;
        let mut vm_args = vm_args.clone();
        if far_config.is_some() {
            vm_args.no_hugepages = true;
        }
        let vm = vm_args.boot()?;
        let (far, memory_host) = match far_config {
            Some((config, host)) => (Some(FarSetup::prepare(&vm, config).map_err(far_error)?), host),
            None => (None, None),
        };
        Ok(BootedVm { vm, far, memory_host })
    }

    /// Far memory's configuration, when asked for, for guest memory of
    /// `memory_bytes`; with `auto`, the memory host started for it.
    fn config(&self, memory_bytes: u64) -> anyhow::Result<Option<(FarConfig, Option<AutoMemoryHost>)>> {
        let Some(local) = &self.local_memory else { return Ok(None) };
        let local_bytes = parse_size(local).map_err(|e| usage_error(format!("--local-memory: {e}")))?;
        let mut auto = None;
        let mut stores = Vec::new();
        for uri in &self.far_memory {
            let uri = if uri == "auto" {
                if auto.is_some() {
                    return Err(usage_error("--far-memory auto: once is enough (it mirrors nothing)"));
                }
                let (host, uri) = AutoMemoryHost::start(memory_bytes)?;
                auto = Some(host);
                uri
            } else {
                uri.clone()
            };
            stores.push(uri.parse().map_err(|e: tsubame_block::BlockError| usage_error(format!("--far-memory: {e}")))?);
        }
        Ok(Some((FarConfig { local_bytes, stores }, auto)))
    }
}

/// A far-memory error as the CLI reports it: a bad setting is a usage
/// error (exit status 2).
pub fn far_error(e: tsubame_farmem::FarError) -> anyhow::Error {
    match e {
        tsubame_farmem::FarError::Config(_) => usage_error(e.to_string()),
        other => anyhow::anyhow!("{other}"),
    }
}
