"""Opcode histograms of a kernel's SASS: full opcodes (with modifiers), base opcodes, the number
of predicated instructions, and categories a kernel engineer reads first."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .sass import Instruction

# Category of each base opcode (the part before the first dot). Order is the report order.
CATEGORIES: dict[str, tuple[str, ...]] = {
    # mma.sync (HMMA) and wgmma (HGMMA; QGMMA with FP8 operands) alike: the matrix instructions
    # of either family.
    "tensor_mma": ("HMMA", "HGMMA", "IMMA", "QGMMA", "BMMA", "DMMA"),
    "ldmatrix": ("LDSM", "STSM"),
    "async_copy": ("LDGSTS", "LDGDEPBAR", "DEPBAR"),
    # Hopper: TMA bulk tensor copies and their prefetch/control, mbarrier operations, the wgmma
    # fences and waits, setmaxnreg.
    "tma": ("UTMALDG", "UTMASTG", "UBLKCP", "UTMACCTL", "UTMAPF"),
    "mbarrier": ("SYNCS",),
    "wgmma_sync": ("WARPGROUP",),
    "setmaxnreg": ("USETMAXREG",),
    "global_load": ("LDG",),
    "global_store": ("STG", "RED", "ATOMG"),
    "shared_load": ("LDS",),
    "shared_store": ("STS",),
    "local_memory": ("LDL", "STL"),
    "mufu": ("MUFU",),
    "fp32": ("FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP", "FCHK", "FSWZADD", "FRND", "FSET"),
    "conversion": ("F2FP", "F2F", "F2I", "I2F", "I2FP", "F2IP", "HADD2", "HMUL2", "HFMA2"),
    "int_address": ("IADD3", "IADD", "IMAD", "IMUL", "LOP3", "LOP", "SHF", "SHL", "SHR", "LEA",
                    "ISETP", "SEL", "VIADD", "VIMNMX", "IABS", "IMNMX", "PRMT", "POPC", "FLO",
                    "BMSK", "SGXT", "UIADD3", "UIMAD", "ULOP3", "USHF", "ULEA", "USEL", "UISETP",
                    "UPRMT", "UFLO", "UPOPC", "USGXT", "UBMSK", "PLOP3", "UPLOP3", "VOTE",
                    "VOTEU", "P2R", "R2P", "PSETP"),
    "move": ("MOV", "UMOV", "MOV32I", "CS2R", "S2R", "S2UR", "R2UR", "LDC", "ULDC", "SHFL"),
    "barrier": ("BAR", "BSSY", "BSYNC", "WARPSYNC", "MEMBAR", "ERRBAR", "CCTL", "FENCE"),
    "branch": ("BRA", "BRX", "JMP", "JMX", "CALL", "RET", "EXIT", "BREAK", "BPT", "KILL"),
}
_CATEGORY_OF = {op: cat for cat, ops in CATEGORIES.items() for op in ops}
OTHER = "other"


def category(base_opcode: str) -> str:
    return _CATEGORY_OF.get(base_opcode, OTHER)


@dataclass
class Histogram:
    kernel: str
    arch: str
    total: int = 0
    predicated: int = 0
    categories: dict[str, int] = field(default_factory=dict)
    base: dict[str, int] = field(default_factory=dict)
    full: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"kernel": self.kernel, "arch": self.arch, "total": self.total,
                "predicated": self.predicated, "categories": self.categories,
                "base": self.base, "full": self.full}


def _sorted(counter: Counter) -> dict[str, int]:
    """Deterministic order: most frequent first, ties by name."""
    return dict(sorted(counter.items(), key=lambda kv: (-kv[1], kv[0])))


def histogram(kernel: str, arch: str, instrs: list[Instruction],
              include_nops: bool = False) -> Histogram:
    """NOPs (alignment padding after EXIT) are left out unless asked for."""
    kept = [i for i in instrs if include_nops or i.base != "NOP"]
    cats = Counter(category(i.base) for i in kept)
    return Histogram(
        kernel=kernel,
        arch=arch,
        total=len(kept),
        predicated=sum(1 for i in kept if i.predicate),
        categories={c: cats.get(c, 0) for c in [*CATEGORIES, OTHER]},
        base=_sorted(Counter(i.base for i in kept)),
        full=_sorted(Counter(i.opcode for i in kept)),
    )


def ex2_under_wgmma(instrs: list[Instruction]) -> int:
    """MUFU.EX2 placed while a wgmma group may still be running: after an HGMMA and before the
    next wait for all groups (WARPGROUP.DEPBAR.LE gsb0, 0x0), in program order. With the
    intra-warpgroup overlap this is the softmax of S_j under P_{j-1} V_{j-1}; 0 means ptxas
    scheduled the whole softmax after the GEMMs (what it did until the K release was made to
    depend on the softmax, docs/results.md)."""
    pending, count = False, 0
    for i in instrs:
        if i.base in ("HGMMA", "QGMMA"):
            pending = True
        elif i.opcode.startswith("WARPGROUP.DEPBAR") and i.operands.replace(" ", "").endswith(
                ",0x0"):
            pending = False
        elif pending and i.opcode.startswith("MUFU.EX2"):
            count += 1
    return count


def expected_mma_count(cfg) -> int:
    """Matrix instructions a config's kernel body holds. sm80: mma.sync m16n8k16, per KV block
    each warp issues m_tiles x (B_c/8 x d/16) for S = Q K^T and m_tiles x (d/8 x B_c/16) for
    O += P V; the optimised softmax peels the first block, so its body is emitted twice. sm90:
    wgmma m64nNk16, d/16 for S and B_c/16 for O += P V, each at two sites (the peeled first S
    and the last P V outside the loop, both inside it), three with the tile hand-over (the next
    tile's first S and the last P V once more); FP8 (e4m3) kernels step k32, half as many.
    sm90-bwd (the Hopper backward): per query block
    each consumer warpgroup issues d/16 m64nNk16 for S^T = K Q^T and as many for dP^T = V dO^T
    (N = B_r, or B_r/2 at d_head 256, where the warpgroups split d_head), B_r/16 for dV += P^T
    dO and as many for dK += dS^T Q, and for dQ = dS K either B_c/16 m64n64k16 per 64 of its
    d/2 columns (its half of the columns over all keys) or, where dQ is over its own keys
    (Sm90BwdConfig.dq_own_keys), B_c/32 m64n<d>k16 for each m64 tile of its B_r rows; once (the
    loop is neither peeled nor unrolled)."""
    if getattr(cfg, "KIND", None) == "bwd_sm90":
        dq_steps = (cfg.block_c // 32 * (cfg.block_r // 64) if cfg.dq_own_keys
                    else cfg.d_head // 128 * (cfg.block_c // 16))
        return 2 * (cfg.d_head // 16) + 2 * (cfg.block_r // 16) + dq_steps
    if getattr(cfg, "KIND", None) == "fwd_sm90":
        sites = 3 if getattr(cfg, "tile_overlap", False) else 2
        k = 32 if cfg.dtype == "e4m3" else 16
        return sites * (cfg.d_head // k + cfg.block_c // k)
    per_block = cfg.m_tiles * ((cfg.block_c // 8) * (cfg.d_head // 16)
                               + (cfg.d_head // 8) * (cfg.block_c // 16))
    return per_block * (2 if cfg.opt_softmax else 1)
