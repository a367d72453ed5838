//! Builds the test guest (guest/*.c, guest/boot.S) with gcc and ld into a
//! multiboot v1 ELF32 image that the crate embeds.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Ring-0 files must not use SSE: this host's KVM emulates ring 0 and
/// cannot emulate vector instructions there.
const RING0_SOURCES: &[&str] = &["ring0.c", "lib.c"];
const RING3_SOURCES: &[&str] = &["main.c", "workloads.c", "kv.c", "math.c", "disk.c"];

fn run(cmd: &mut Command) {
    let status =
        cmd.status().unwrap_or_else(|e| panic!("cannot run {:?}: {e} (install gcc and binutils)", cmd.get_program()));
    assert!(status.success(), "{cmd:?} failed with {status}");
}

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let guest = manifest.join("../../guest").canonicalize().expect("guest/ directory");
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    println!("cargo:rerun-if-changed={}", guest.display());

    let cflags = [
        "-m64",
        "-O2",
        "-ffreestanding",
        "-fno-pic",
        "-fno-pie",
        "-mno-red-zone",
        "-fno-stack-protector",
        "-fno-asynchronous-unwind-tables",
        "-fno-builtin",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-std=gnu11",
    ];
    let mut objects = Vec::new();
    let mut compile = |src: &str, extra: &[&str]| {
        let obj = out.join(Path::new(src).with_extension("o"));
        run(Command::new("gcc").args(cflags).args(extra).arg("-c").arg(guest.join(src)).arg("-o").arg(&obj));
        objects.push(obj);
    };
    for src in RING0_SOURCES {
        compile(src, &["-mgeneral-regs-only"]);
    }
    for src in RING3_SOURCES {
        compile(src, &[]);
    }
    compile("boot.S", &[]);

    let elf64 = out.join("guest64.elf");
    run(Command::new("ld")
        .args(["-m", "elf_x86_64", "-nostdlib", "-z", "max-page-size=4096", "-z", "noexecstack"])
        .arg("--no-warn-rwx-segments")
        .arg("-T")
        .arg(guest.join("guest.ld"))
        .arg("-o")
        .arg(&elf64)
        .args(&objects));
    // QEMU's multiboot loader refuses ELF64; an ELF32 wrapper of the same
    // bytes boots under both QEMU and tsubame.
    run(Command::new("objcopy").args(["-O", "elf32-i386"]).arg(&elf64).arg(out.join("guest.elf")));
}
