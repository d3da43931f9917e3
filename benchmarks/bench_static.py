"""asv: per kernel of the default set and per architecture, what ptxas and the SASS say:
registers, spill bytes, shared memory, SASS instruction totals per category. Read from the
installed build's ptxas report (the wheel carries ptxas.log) and binary by the fa_tools of the
same commit (installed with it); cuobjdump/nvdisasm are found on sys.path (the PyPI packages,
also those of the interpreter running asv) or in the CUDA toolkit. No GPU needed. Kernels or
architectures the build does not contain are skipped with the reason, and so is everything
when fa_tools or the SASS tools are missing."""

from flash_attention.config_sets import SETS

KERNELS = [c.short for c in SETS["default"]]
ARCHS = ["80", "90"]
CATEGORIES = ["total", "tensor_mma", "ldmatrix", "async_copy", "shared_load", "shared_store",
              "local_memory", "mufu", "fp32", "conversion", "int_address", "move", "barrier",
              "branch"]


def _analysis():
    """fa_tools' binary-analysis modules: fa_tools.analysis.*, or fa_tools.* in commits from
    before that package existed."""
    try:
        from fa_tools.analysis import binaries, opcodes, ptxas_report, sass
    except ImportError:
        from fa_tools import binaries, opcodes, ptxas_report, sass
    return binaries, opcodes, ptxas_report, sass


def _collect():
    try:
        binaries, opcodes, ptxas_report, sass = _analysis()
    except ImportError as exc:
        return {"skip": f"fa_tools' analysis is not importable in this environment ({exc})"}
    try:
        binary, log = binaries.extension_path(), binaries.ptxas_log_path()
        records = {(r.kernel, r.arch): r for r in ptxas_report.load(log)}
        out = {}
        for (kernel, arch), rec in records.items():
            if kernel not in KERNELS or arch not in ARCHS:
                continue
            hist = opcodes.histogram(kernel, arch, sass.instructions(binary, kernel, arch))
            out[(kernel, arch)] = {
                "registers": rec.registers,
                "spill_bytes": rec.spill_stores + rec.spill_loads,
                "smem_bytes": rec.static_smem + rec.dynamic_smem,
                "sass": {"total": hist.total, **hist.categories},
            }
        return out
    except binaries.ToolError as exc:
        return {"skip": str(exc)}  # asv passes no cache for None


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
