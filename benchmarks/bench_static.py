"""asv: per kernel of the default set and per architecture, what ptxas and the SASS say:
registers, spill bytes, shared memory, SASS instruction totals per category. Read from the
build's ptxas report and the binary (fa_tools); no GPU needed."""

from flash_attention.config_sets import SETS

KERNELS = [c.short for c in SETS["default"]]
ARCHS = ["80", "90"]
CATEGORIES = ["total", "tensor_mma", "ldmatrix", "async_copy", "shared_load", "shared_store",
              "local_memory", "mufu", "fp32", "conversion", "int_address", "move", "barrier",
              "branch"]


def _collect():
    from fa_tools.analysis import opcodes, ptxas_report, sass
    from fa_tools.analysis.binaries import ToolError, extension_path, ptxas_log_path

    try:
        binary, log = extension_path(), ptxas_log_path()
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
    except ToolError as exc:
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
