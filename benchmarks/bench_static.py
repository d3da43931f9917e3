"""asv: per kernel of the default set (forward, and the backward with its preprocess and dQ
conversion kernels) and per architecture, what ptxas and the SASS say: registers, spill bytes,
shared memory, SASS instruction totals per category. Read from the
installed build's ptxas report (the wheel carries ptxas.log) and binary by the fa_tools of the
same commit (installed with it); cuobjdump/nvdisasm are found on sys.path (the PyPI packages,
also those of the interpreter running asv) or in the CUDA toolkit. No GPU needed. Kernels or
architectures the build does not contain are skipped with the reason, and so is everything
when fa_tools or the SASS tools are missing.

Kernels are named as flash_attention.kernels names them now (fwd_sm80_..., fwd_sm90_...,
bwd_sm80_..., bwd_sm90_..., the helpers bwd_sm80_preprocess_<dtype>, bwd_sm80_convert_dq_<dtype>
and bwd_sm90_convert_dq_<dtype>), whatever commit is installed: asv runs this file of the
working tree against older commits, whose package has the old configuration modules
(config_sets, config_bwd) and whose fa_tools reports the old names; those are read as their
current names (kernels/legacy.py, loaded from this tree by path when the installed package
predates it), so a kernel's series goes on across the renaming.

Architectures are named as fa_tools' ptxas report names them: "80" and "90" for the sm80
family, "90a" for the Hopper family (the fwd_sm90 and bwd_sm90 kernels, and the Hopper
backward's dQ conversion bwd_sm90_convert_dq_*, compile for sm_90a alone, whatever the build's
architecture list; Hopper backward kernels are tracked once the default set holds them). On
sm_90a, tensor_mma counts the wgmma (HGMMA); HopperSassInstructions adds the Hopper-only
categories (TMA, mbarrier, the wgmma fences and waits, setmaxnreg) and HopperWgmma whether
ptxas serialized the wgmma and how many MUFU.EX2 it placed under a running wgmma (both pinned
by the static gate too). New parameter values and classes only: the series recorded for 80/90
keep their keys and benchmark versions (the bodies of the classes below stay as they are)."""

import importlib.util
import re
from pathlib import Path

# src/flash_attention/kernels/legacy.py of this tree (standard library only)
LEGACY = Path(__file__).resolve().parents[1] / "src" / "flash_attention" / "kernels" / "legacy.py"


def _legacy():
    """The kernels.legacy module: the installed package's, else this tree's file, loaded by
    path (a commit from before the one name scheme has none)."""
    try:
        from flash_attention.kernels import legacy
    except ImportError:
        spec = importlib.util.spec_from_file_location("fa_bench_kernel_names", LEGACY)
        legacy = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(legacy)
    return legacy


current_name = _legacy().current_name


def _default_kernels() -> list[str]:
    """The `default` set of every kind (forward, then backward) and the backward's helpers,
    the preprocess and each kind's dQ conversion of its dtypes (what the static ratchet pins),
    by their current names; a commit from before the backward has no backward ones."""
    try:
        from flash_attention.kernels import resolve
        from flash_attention.kernels.helpers import helpers
    except ImportError:  # a commit from before flash_attention.kernels
        from flash_attention.config_sets import SETS

        names = [c.short for c in SETS["default"]]
        try:
            from flash_attention.config_bwd import DEFAULT, aux_kernels
        except ImportError:  # ... and from before the backward
            DEFAULT, aux_kernels = (), lambda configs: ()
        names += [c.short for c in DEFAULT] + [a.short for a in aux_kernels(DEFAULT)]
        return [current_name(n) for n in names]
    configs = resolve("default")
    return [c.name for c in (*configs, *helpers(configs))]


KERNELS = _default_kernels()
ARCHS = ["80", "90", "90a"]  # append only: asv keys the recorded results by these values
CATEGORIES = ["total", "tensor_mma", "ldmatrix", "async_copy", "shared_load", "shared_store",
              "local_memory", "mufu", "fp32", "conversion", "int_address", "move", "barrier",
              "branch"]
# the Hopper forward's and backward's main kernels (their helpers, the sm_90a-only
# bwd_sm90_convert_dq_* too, have none of the Hopper-only figures)
HOPPER_PREFIXES = ("fwd_sm90_", "bwd_sm90_")
_HELPER = re.compile(r"bwd_sm\d+_(preprocess|convert_dq)(_varlen)?_(fp16|bf16)")


def is_hopper_kernel(name: str) -> bool:
    """A Hopper main kernel's (current) name: fwd_sm90_* or bwd_sm90_*, not a helper."""
    return name.startswith(HOPPER_PREFIXES) and _HELPER.fullmatch(name) is None


HOPPER_KERNELS = [k for k in KERNELS if is_hopper_kernel(k)]
HOPPER_CATEGORIES = ["tma", "mbarrier", "wgmma_sync", "setmaxnreg"]  # fa_tools' opcodes names


def _analysis():
    """fa_tools' binary-analysis modules: fa_tools.analysis.*, or fa_tools.* in commits from
    before that package existed."""
    try:
        from fa_tools.analysis import binaries, opcodes, ptxas_report, sass
    except ImportError:
        from fa_tools import binaries, opcodes, ptxas_report, sass
    return binaries, opcodes, ptxas_report, sass


def _collect():
    """{(kernel, arch): figures} of the tracked kernels of the installed build, keyed by the
    kernels' current names; the installed fa_tools is asked by the names it reports (an older
    commit's: the old ones)."""
    try:
        binaries, opcodes, ptxas_report, sass = _analysis()
    except ImportError as exc:
        return {"skip": f"fa_tools' analysis is not importable in this environment ({exc})"}
    try:
        binary, log = binaries.extension_path(), binaries.ptxas_log_path()
        records = {(r.kernel, r.arch): r for r in ptxas_report.load(log)}
        out = {}
        for (kernel, arch), rec in records.items():
            name = current_name(kernel)
            if name not in KERNELS or arch not in ARCHS:
                continue
            instrs = sass.instructions(binary, kernel, arch)
            hist = opcodes.histogram(kernel, arch, instrs)
            out[(name, arch)] = {
                "registers": rec.registers,
                "spill_bytes": rec.spill_stores + rec.spill_loads,
                "smem_bytes": rec.static_smem + rec.dynamic_smem,
                "sass": {"total": hist.total, **hist.categories},
                **_wgmma(opcodes, name, rec, instrs),
            }
        return out
    except binaries.ToolError as exc:
        return {"skip": str(exc)}  # asv passes no cache for None


def _wgmma(opcodes, name, rec, instrs) -> dict:
    """The wgmma schedule of a Hopper main kernel (`name`: its current name), as far as this
    commit's fa_tools can tell (a count it cannot make stays out)."""
    if not is_hopper_kernel(name):
        return {}
    out = {}
    if hasattr(rec, "wgmma_serialized"):
        out["wgmma_serialized"] = int(bool(rec.wgmma_serialized))
    if hasattr(opcodes, "ex2_under_wgmma"):
        out["ex2_under_wgmma"] = opcodes.ex2_under_wgmma(instrs)
    return out


class KernelResources:
    params = (KERNELS, ARCHS)
    param_names = ["kernel", "arch"]
    timeout = 600

    def setup_cache(self):
        return _collect()

    setup_cache.timeout = 600

    def setup(self, cache, kernel, arch):
        if (kernel, arch) not in cache:
            raise NotImplementedError(cache.get("skip", f"{kernel} sm_{arch} not in this build"))
        self.r = cache[(kernel, arch)]

    def track_registers(self, cache, kernel, arch):
        return self.r["registers"]

    track_registers.unit = "registers"

    def track_spill_bytes(self, cache, kernel, arch):
        return self.r["spill_bytes"]

    track_spill_bytes.unit = "bytes"

    def track_smem_bytes(self, cache, kernel, arch):
        return self.r["smem_bytes"]

    track_smem_bytes.unit = "bytes"


class SassInstructions:
    params = (KERNELS, ARCHS, CATEGORIES)
    param_names = ["kernel", "arch", "category"]
    timeout = 600

    def setup_cache(self):
        return _collect()

    setup_cache.timeout = 600

    def setup(self, cache, kernel, arch, category):
        if (kernel, arch) not in cache:
            raise NotImplementedError(cache.get("skip", f"{kernel} sm_{arch} not in this build"))
        self.n = cache[(kernel, arch)]["sass"][category]

    def track_count(self, cache, kernel, arch, category):
        return self.n

    track_count.unit = "instructions"


class HopperSassInstructions(SassInstructions):
    """The categories only the Hopper family has, for its kernels on sm_90a (the general ones,
    tensor_mma = HGMMA among them, are SassInstructions' arch 90a rows)."""

    params = (HOPPER_KERNELS, ["90a"], HOPPER_CATEGORIES)


class HopperWgmma:
    """Where this commit's fa_tools cannot tell (older ones lack the serialization notes or the
    EX2 count), nan: what asv records for a skipped case."""

    params = (HOPPER_KERNELS, ["90a"])
    param_names = ["kernel", "arch"]
    timeout = 600
    # KernelResources' own: asv keys the cache by that function, so one collection serves both.
    setup_cache = KernelResources.setup_cache
    setup = KernelResources.setup

    def track_serialized(self, cache, kernel, arch):
        """1 when ptxas serialized the kernel's wgmma (a C75xx note), else 0."""
        return self.r.get("wgmma_serialized", float("nan"))

    track_serialized.unit = "serialized"

    def track_ex2_under_wgmma(self, cache, kernel, arch):
        """MUFU.EX2 placed while a wgmma group may still run (the softmax under P V)."""
        return self.r.get("ex2_under_wgmma", float("nan"))

    track_ex2_under_wgmma.unit = "instructions"
