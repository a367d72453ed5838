"""Case files: the cases and configurations a comparison runs (bench/cases/*.toml)."""
import dataclasses
import tomllib
from dataclasses import dataclass, field

from tsubame_bench import HarnessError
from tsubame_bench.units import parse_rate, parse_size

@dataclass
class VmmConfig:
    """One way to migrate: a VMM plus its options (one line of a case file's [configs])."""

    name: str
    vmm: str  # "qemu" or "tsubame"
    args: list = field(default_factory=list)  # tsubame: extra `tsubame migrate` arguments
    capabilities: list = field(default_factory=list)  # qemu: migrate-set-capabilities names set to true
    parameters: dict = field(default_factory=dict)  # qemu: extra migrate-set-parameters
    # qemu post-copy: migrate-start-postcopy after this many completed pre-copy passes, or
    # seconds, whichever comes first (postcopy-ram is then set on both ends)
    postcopy_after_passes: int | None = None
    postcopy_after_s: float | None = None
    # qemu: the -accel option of both QEMUs instead of -enable-kvm, e.g. "kvm,dirty-ring-size=4096"
    # (the KVM dirty ring, which the dirty-limit capability needs)
    accel: str | None = None

    def qemu_postcopy(self):
        return self.postcopy_after_passes is not None or self.postcopy_after_s is not None


@dataclass
class Case:
    name: str
    workload: str
    args: dict  # workload parameters (wss, rate, seed), in cmdline order
    memory: str
    link: str  # "loopback" or a rate ("1gbit", "10gbit")
    max_bandwidth: str  # "link" (the link's rate; unlimited on loopback), "unlimited", or a rate
    repetitions: int
    time_limit_s: float
    warmup_s: float
    # sweeps over its working set the guest completes before warmup_s starts: a
    # guest that writes all of it (fill-random, fill-zero) is then in the same
    # state under both VMMs (the first sweep's page faults take 3-7 s of 4 GiB,
    # longer under QEMU)
    warmup_passes: int
    watch_s: float
    downtime_limit_ms: int
    configs: list  # config names, in run order
    tsubame_args: list  # extra `tsubame migrate` arguments for every tsubame config of this case

    def link_bits(self):
        """The link's rate in bit/s, or None for loopback."""
        return None if self.link == "loopback" else parse_rate(self.link)

    def bandwidth_bits(self):
        """The migration bandwidth cap in bit/s for both VMMs, or None for unlimited."""
        if self.max_bandwidth == "link":
            return self.link_bits()
        if self.max_bandwidth == "unlimited":
            return None
        return parse_rate(self.max_bandwidth)


CASE_DEFAULTS = {
    "args": {},
    "link": "1gbit",
    "max_bandwidth": "link",
    "repetitions": 1,
    "time_limit_s": 120,
    "warmup_s": 3,
    "warmup_passes": 0,
    "watch_s": 3,
    "downtime_limit_ms": 300,
    "tsubame_args": [],
}


def load_case_file(path):
    """Reads a case file -> (list of Case, dict name -> VmmConfig). Raises HarnessError when malformed."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise HarnessError(f"{path}: {e}") from None
    configs = {}
    for name, spec in doc.get("configs", {}).items():
        keys = {"vmm", "args", "capabilities", "parameters", "postcopy_after_passes", "postcopy_after_s", "accel"}
        unknown = set(spec) - keys
        if unknown or spec.get("vmm") not in ("qemu", "tsubame"):
            raise HarnessError(f"{path}: config {name}: needs vmm = \"qemu\" or \"tsubame\" "
                               f"and only {'/'.join(sorted(keys - {'vmm'}))} (got {sorted(spec)})")
        after_passes, after_s = spec.get("postcopy_after_passes"), spec.get("postcopy_after_s")
        if (after_passes is not None or after_s is not None) and spec["vmm"] != "qemu":
            raise HarnessError(f"{path}: config {name}: postcopy_after_* is for QEMU; tsubame takes "
                               f"args = [\"--postcopy\", \"after=N\"] or [\"--postcopy\", \"auto\"]")
        accel = spec.get("accel")
        if accel is not None and (spec["vmm"] != "qemu" or not str(accel).startswith("kvm")):
            raise HarnessError(f"{path}: config {name}: accel is QEMU's -accel option and must name kvm "
                               f"(e.g. \"kvm,dirty-ring-size=4096\"), got {accel!r} for vmm {spec['vmm']}")
        configs[name] = VmmConfig(name=name, vmm=spec["vmm"], args=[str(a) for a in spec.get("args", [])],
                                  capabilities=list(spec.get("capabilities", [])),
                                  parameters=dict(spec.get("parameters", {})),
                                  postcopy_after_passes=None if after_passes is None else int(after_passes),
                                  postcopy_after_s=None if after_s is None else float(after_s),
                                  accel=None if accel is None else str(accel))
    defaults = dict(CASE_DEFAULTS)
    defaults["configs"] = list(configs)
    defaults.update(doc.get("defaults", {}))
    cases = []
    for raw in doc.get("case", []):
        spec = dict(defaults)
        spec.update(raw)
        for key in ("name", "workload", "memory"):
            if key not in spec:
                raise HarnessError(f"{path}: a [[case]] lacks '{key}'")
        unknown = set(spec) - set(f.name for f in dataclasses.fields(Case))
        if unknown:
            raise HarnessError(f"{path}: case {spec['name']}: unknown keys {sorted(unknown)}")
        for c in spec["configs"]:
            if c not in configs:
                raise HarnessError(f"{path}: case {spec['name']}: config '{c}' is not defined in [configs]")
        case = Case(name=spec["name"], workload=spec["workload"], args={k: str(v) for k, v in spec["args"].items()},
                    memory=str(spec["memory"]), link=str(spec["link"]).lower(),
                    max_bandwidth=str(spec["max_bandwidth"]).lower(), repetitions=int(spec["repetitions"]),
                    time_limit_s=float(spec["time_limit_s"]), warmup_s=float(spec["warmup_s"]),
                    warmup_passes=int(spec["warmup_passes"]),
                    watch_s=float(spec["watch_s"]), downtime_limit_ms=int(spec["downtime_limit_ms"]),
                    configs=list(spec["configs"]), tsubame_args=[str(a) for a in spec["tsubame_args"]])
        case.link_bits()  # validate rates now, not in the middle of a run
        case.bandwidth_bits()
        parse_size(case.memory)
        cases.append(case)
    if not cases:
        raise HarnessError(f"{path}: no [[case]] entries")
    return cases, configs


def guest_cmdline(case, tsc_khz):
    """The guest command line exactly as `tsubame run` builds it: workload=W k=v ... tsc_khz=K."""
    parts = [f"workload={case.workload}"] + [f"{k}={v}" for k, v in case.args.items()]
    return " ".join(parts + [f"tsc_khz={tsc_khz}"])
