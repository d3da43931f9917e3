"""Which kernels a gate case runs, and a case that runs a given kernel: the dispatch table of a
build (flash_attention.ops.dispatch_rows, the rows the extension looks calls up in) read
forwards and backwards, and the backward operator's choice of kernel likewise.

A row (dtype, d_head variant, sequence bucket, mask, local, softcap) names a kernel and its
fallback: on an sm_90 GPU a fixed-length call runs the kernel (a Hopper one where the table has
one), a varlen call the fallback (an sm80-family one); on any other GPU every call runs the
fallback. The extension also falls back for tensors TMA cannot address; the gate's inputs are
contiguous, so that never applies to them.

The backward: the operator runs the built kernel of the call's dtype and softcap with the
smallest d_head variant not below the call's (the select of flash_attention.kernels.bwd_sm80 and
bwd_sm90 mirrors it), with the preprocess and the dQ conversion of its kind and dtype around it
(helpers.helpers_of: bwd_sm80_convert_dq_<dtype> after a bwd_sm80 kernel,
bwd_sm90_convert_dq_<dtype> after a Hopper one). On an sm_90 GPU a fixed-length call
(deterministic or not) takes it among the Hopper backward kernels (bwd_sm90) where one is built,
a varlen call the row's Hopper varlen kernel (flag j) where one is built, else each among
bwd_sm80; every call on another GPU runs bwd_sm80. (Here too the gate's contiguous inputs always
suit TMA.) So a build with both Hopper kinds runs no sm80-family backward kernel on sm_90: the
gate measures those on another GPU only.

A decode step (flash_attn_with_kvcache) runs the decode table's kernel for its dtype and d_head
(flash_attention.kernels.dec_sm80: one kernel per row serves every mask, page size and split
count, its combine kernel in the same unit) on every GPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from ..gpu.perfcases import Case

# A case made for a kernel takes the bucket of its rows nearest this from below (longer only
# for a kernel that serves nothing shorter): moderate sizes, as the gate's whole run must stay
# within its time budget.
CASE_SEQLEN_CAP = 4096
CASE_TOKENS = 65536  # batch x seqlen of a case made for a row
CASE_SOFTCAP = 30.0
GATE_SMS = 132  # SMs of the gate's GPU (an H100 or H200 SXM): the one-wave rule's wave
# A backward case made for a kernel: 4 sequences of 4096, as the gate's own backward cases (a
# varlen one: 4 sequences of varlen_lengths, the longest 4096).
BWD_CASE_SEQLEN = 4096
BWD_CASE_TOKENS = 16384


@dataclass(frozen=True)
class Row:
    dtype: str
    d_head: int  # the variant (32, 64, ..., 256)
    bucket: int  # the longest seqlen_q it serves (a power of two, 64 .. 16384)
    mask: bool
    local: bool  # a window bounded on the left
    softcap: bool
    kernel: str
    fallback: str
    varlen: str  # the Hopper kernel of the row's varlen calls, "" when none is built
    one_wave: str = ""  # Hopper kernels for calls whose tiles fit in one wave, comma-separated
    key_pad: str = ""  # a Hopper kernel for calls whose keys it pads at least 1/8 less

    @property
    def key(self) -> tuple[str, int, int, bool, bool, bool]:
        return (self.dtype, self.d_head, self.bucket, self.mask, self.local, self.softcap)


def dispatch_rows(configs: Iterable[str]) -> list[Row]:
    """The dispatch rows of a build holding these kernels (names), as the extension gets them
    from flash_attention.ops.dispatch_rows (the tuning file included); the FP8 (e4m3) rows have
    no fallback and no varlen kernel ("")."""
    from flash_attention.kernels import parse
    from flash_attention.ops import dispatch_rows as rows_of

    return [Row(*r) for r in rows_of(tuple(parse(c) for c in configs))]


def call_key(case: Case) -> tuple[str, int, int, bool, bool, bool]:
    """The row key of a case's call, as the extension computes it (d_head variant, bucket of
    seqlen_q, the canonical window's mask and left bound, softcap)."""
    from flash_attention.dispatch import seq_bucket
    from flash_attention.kernels.fwd_sm80 import variant_for
    from flash_attention.masks import canonical_window

    left, right = canonical_window(case.causal, case.window or (-1, -1), case.seqlen,
                                   case.keys)
    mask = (left, right) != (-1, -1)
    return (case.dtype, variant_for(case.d_head) or case.d_head, seq_bucket(case.seqlen), mask,
            mask and left != -1, case.softcap > 0)


def route(case: Case, rows: Sequence[Row], sm90: bool) -> str | None:
    """The forward kernel the case's attention() call runs on an sm_90 GPU (sm90=True) or
    another one (a varlen case on sm_90: the row's varlen kernel, else its fallback); None when
    the build has no row for it."""
    by_key = {r.key: r for r in rows}
    row = by_key.get(call_key(case))
    if row is None:
        return None
    if not sm90:
        return row.fallback or None  # an FP8 row has none: no kernel off sm_90
    if case.varlen:
        return row.varlen or row.fallback or None
    return one_wave(case, row) or fewer_padded_keys(case, row) or row.kernel or None


def fewer_padded_keys(case: Case, row: Row) -> str | None:
    """The row's fewer-padded-keys kernel where its B_c pads the case's keys at least 1/8 less
    than the row's kernel does (dispatch.h's fewer_padded_keys()), or None."""
    from flash_attention.kernels import parse

    if not row.key_pad or not row.kernel:
        return None
    keys = case.seqlen_k or case.seqlen

    def padded(name: str) -> int:
        block_c = parse(name).block_c
        return -(-keys // block_c) * block_c
    return row.key_pad if 8 * padded(row.key_pad) <= 7 * padded(row.kernel) else None


def one_wave(case: Case, row: Row, sms: int = GATE_SMS) -> str | None:
    """The row's one-wave kernel a fixed-length case runs on sm_90 (the first tier whose tiles,
    batch x heads x query blocks of its B_r, fit on `sms` SMs, as dispatch.h's one_wave()), or
    None."""
    from flash_attention.kernels import parse

    for name in filter(None, row.one_wave.split(",")):
        block_r = parse(name).block_r
        if case.batch * case.heads * -(-case.seqlen // block_r) <= sms:
            return name
    return None


def kind(kernel: str) -> str:
    """A kernel without its dtype (q's, and a decode kernel's FP8 cache dtype, e4m3 and e5m2
    alike: ``dec_sm80_fp8_d128_...``): the tile and flags the coverage is counted in."""
    out = kernel.replace("_bf16_", "_").replace("_fp16_", "_").removeprefix("bf16_") \
        .removeprefix("fp16_")
    if out.startswith("dec_"):
        out = out.replace("_e4m3_", "_fp8_").replace("_e5m2_", "_fp8_")
    return out


def _case_of_row(row: Row, varlen: bool) -> Case:
    """A case whose call the row serves: sequences of the row's bucket, CASE_TOKENS tokens,
    the row's d_head variant; causal for a masked row, a window of a quarter of the sequence
    bounded on the left for a local one, a softcap for a softcap row."""
    seqlen = row.bucket
    batch = max(2, CASE_TOKENS // seqlen)
    window = (max(1, seqlen // 4), 0) if row.local else None
    return Case(row.dtype, row.d_head, batch, seqlen, causal=row.mask and not row.local,
                window=window, softcap=CASE_SOFTCAP if row.softcap else 0.0,
                varlen=varlen)


def _preference(row: Row, kernel: str) -> tuple:
    """Rows of one kernel, best first: the kernel's own d_head variant (not a smaller one it
    zero-pads), no window before a window, the longest bucket up to CASE_SEQLEN_CAP, else the
    shortest above it."""
    d_kernel = int(kernel.split("_d")[1].split("_")[0])
    over = row.bucket > CASE_SEQLEN_CAP
    return (row.d_head != d_kernel, row.local, over, row.bucket if over else -row.bucket)


def case_for_kernel(kernel: str, rows: Sequence[Row], sm90: bool) -> Case | None:
    """A case dispatch runs `kernel` for on this GPU: a fixed-length one where a row's kernel
    runs fixed-length calls, else a varlen one where it runs a row's varlen batches (on sm_90
    the row's varlen kernel, else its sm80-family fallback); None when no row runs it (an FP8
    row's empty fallback and varlen kernel name none)."""
    if not kernel:
        return None
    fixed = [r for r in rows if (r.kernel if sm90 else r.fallback) == kernel]
    if fixed:
        return _case_of_row(min(fixed, key=lambda r: _preference(r, kernel)), varlen=False)
    if sm90:
        packed = [r for r in rows if (r.varlen or r.fallback) == kernel]
        if packed:
            return _case_of_row(min(packed, key=lambda r: _preference(r, kernel)), varlen=True)
    return None


# ---- the backward ------------------------------------------------------------------------------


def bwd_hopper(case: Case, sm90: bool) -> bool:
    """Whether the backward operator may run the case's calls on a Hopper backward kernel: on
    an sm_90 GPU (sm90=True), fixed-length or varlen (on the varlen kernels, flag j), with
    deterministic dQ or not (the gate's inputs are contiguous, so TMA can address them)."""
    return sm90


def bwd_kernel(case: Case, bwd_configs: Iterable[str], sm90: bool) -> str | None:
    """The backward main kernel the flash_attention::bwd operator runs for the case's calls on
    an sm_90 GPU (sm90=True) or another one, of a build holding these backward kernels (names,
    either kind); None when it has none for them."""
    from flash_attention.kernels import Call, bwd_sm80, bwd_sm90, parse

    built = tuple(parse(c) for c in bwd_configs)
    call = Call(case.dtype, case.d_head, softcap=case.softcap > 0)
    hopper = bwd_sm90.select_varlen if case.varlen else bwd_sm90.select
    cfg = ((hopper(call, built) if bwd_hopper(case, sm90) else None)
           or bwd_sm80.select(call, built))
    return None if cfg is None else cfg.name


def kernels_run(case: Case, rows: Sequence[Row], bwd_configs: Sequence[str],
                sm90: bool) -> list[str]:
    """Every kernel the case's timed calls launch on this GPU: the forward's (route) when it
    times the forward, the backward's main kernel with its helpers (the preprocess and the dQ
    conversion of its family and dtype) when it times the backward; a kernel the build has no
    row or config for is not listed."""
    from flash_attention.kernels import parse
    from flash_attention.kernels.helpers import helpers_of

    run = []
    if case.kind == "decode":
        run.append(dec_kernel(case, sm90))
        if dec_splits(case, sm90=sm90) > 1:
            run.append(f"dec_sm80_combine_{case.dtype}")
    if case.times_forward:
        run.append(route(case, rows, sm90))
    if case.times_backward:
        main = bwd_kernel(case, bwd_configs, sm90)
        run += [main] + ([h.name for h in helpers_of(parse(main))] if main else [])
    return [k for k in run if k is not None]


def case_for_bwd_kernel(kernel: str, bwd_configs: Sequence[str], sm90: bool) -> Case | None:
    """A backward case the operator runs `kernel` for on an sm_90 GPU (sm90=True) or another
    one (a main kernel, a preprocess or a dQ conversion): for a main kernel BWD_CASE_TOKENS
    tokens in sequences of BWD_CASE_SEQLEN at its own d_head, causal (both the masked edge
    blocks and the full ones), softcap for a softcap kernel, as a varlen batch for a varlen
    kernel (flag j) or for an sm80-family kernel a fixed-length Hopper one shadows on sm_90
    (where no Hopper varlen kernel takes those); for a helper, the case of a main kernel it
    runs with (helpers.helpers_of: of its dtype, and of its kind for a dQ conversion) without a
    softcap and with the d_head nearest 128. None when the operator runs another kernel for
    every call the kernel could serve (a kernel of a test set beside the default one, a Hopper
    kernel or the Hopper dQ conversion off sm_90, an sm80-family kernel both Hopper kinds
    shadow on sm_90)."""
    from flash_attention.kernels import HelperKernel, parse, parse_kernel
    from flash_attention.kernels.helpers import helpers_of

    cfg = parse_kernel(kernel)
    if isinstance(cfg, HelperKernel):
        mains = sorted((c for c in map(parse, bwd_configs) if cfg in helpers_of(c)),
                       key=lambda c: (c.softcap, abs(c.d_head - 128), c.d_head))
        made = (case_for_bwd_kernel(c.name, bwd_configs, sm90) for c in mains)
        return next((c for c in made if c is not None), None)
    case = Case(cfg.dtype, cfg.d_head, BWD_CASE_TOKENS // BWD_CASE_SEQLEN, BWD_CASE_SEQLEN,
                causal=True, softcap=CASE_SOFTCAP if cfg.softcap else 0.0, kind="bwd")
    for made in (case, replace(case, varlen=True)):
        if bwd_kernel(made, bwd_configs, sm90) == kernel:
            return made
    return None


# ---- decode steps ------------------------------------------------------------------------------

# A decode case made for a decode kernel: 16 sequences of 8192 cached keys, GQA 32/8, one query.
DEC_CASE = {"batch": 16, "seqlen": 1, "heads": 32, "kv_heads": 8, "seqlen_k": 8192}


def dec_kernel(case: Case, sm90: bool = True, sms: int = 132) -> str | None:
    """The decode kernel a decode case's flash_attn_with_kvcache call runs on an sm_90 GPU of
    `sms` SMs (sm90=True) or another one (the decode table's row for its dtype and d_head: its
    wide row where dec_sm80.runs_wide says so, its deep kernel where dec_sm80.runs_deep does,
    its small-page kernel where dec_sm80.small_pages does, where the table has them), None for
    another kind of case."""
    from flash_attention.kernels import Call, dec_sm80, parse

    if case.kind != "decode":
        return None
    call = Call(case.dtype, case.d_head)
    wide = dec_sm80.table_rows(call, case.cache, wide=True)
    kv = dec_sm80.kv_bytes(case.batch, case.kv, case.keys, case.d_head, case.cache)
    if wide and dec_sm80.runs_wide(_dec_rows(case), kv):
        return wide[0][1]
    deep = dec_sm80.table_rows(call, case.cache, deep=True)
    tiles = dec_sm80.row_tiles(_dec_rows(case), case.kv, case.batch)
    if deep and sm90 and dec_sm80.runs_deep(tiles, case.keys, sms):
        return deep[0][1]
    ((_, name),) = dec_sm80.table_rows(call, case.cache)
    small = dec_sm80.table_rows(call, case.cache, small_page=True)
    if small and dec_sm80.small_pages(case.page_size, parse(name).block_c):
        return small[0][1]
    return name


def _dec_rows(case: Case) -> int:
    from flash_attention.kernels import dec_sm80

    return dec_sm80.packed_rows(case.seqlen, case.heads, case.kv)


def dec_splits(case: Case, sms: int = 132, sm90: bool = True) -> int:
    """The split count the extension takes for a decode case on a GPU of `sms` SMs (132: H100
    SXM, H200), sm_90 or another one, over the tiles of the case's kernel's B_r:
    dec_sm80.heuristic_splits (choose_splits in src/csrc/binding/decode.cpp), or deep_splits
    for the deep kernel."""
    from flash_attention.kernels import dec_sm80, parse

    kernel = parse(dec_kernel(case, sm90, sms))
    ctas = dec_sm80.row_tiles(_dec_rows(case), case.kv, case.batch, kernel.block_r)
    if kernel.sm90_only:  # the deep kernel's own count
        return dec_sm80.deep_splits(ctas, case.keys, sms)
    return dec_sm80.heuristic_splits(ctas, case.keys, sms)


def case_for_dec_kernel(kernel: str, sm90: bool = True) -> Case | None:
    """A decode case whose call runs `kernel` on an sm_90 GPU (sm90=True) or another one:
    DEC_CASE at a decode kernel's dtype and d_head (8 causal queries for a 32-row kernel, 2048
    keys for a deep one, twice the sequences for a 16-row one whose row has a deep kernel,
    pages of 16 rows for a small-page one);
    for the combine (dec_sm80_combine_<dtype>) one sequence at d_head 128, which splits its
    keys. None when the decode table runs another kernel for its calls
    (a kernel of a test set; a deep kernel off sm_90)."""
    from flash_attention.kernels import Call, dec_sm80, parse

    if kernel.startswith("dec_sm80_combine_"):
        case = Case(kernel.rsplit("_", 1)[1], 128, kind="decode", **{**DEC_CASE, "batch": 1})
        return case if kernel in kernels_run(case, [], [], sm90=sm90) else None
    cfg = parse(kernel)
    case = Case(cfg.dtype, cfg.d_head, kind="decode", cache=cfg.cache, **DEC_CASE)
    if cfg.block_r > 16:  # 8 speculative positions of GQA groups of 4: 32 packed rows
        case = replace(case, seqlen=8, causal=True)
    if cfg.sm90_only:  # 128 tiles of 2048 keys: one CTA per SM, one split
        case = replace(case, seqlen_k=2048)
    elif dec_sm80.table_rows(Call(cfg.dtype, cfg.d_head), cfg.cache, small_page=True) == \
            [(None, kernel)]:
        case = replace(case, page_size=16)
    elif sm90 and parse(dec_kernel(case, sm90)).sm90_only:  # past the deep band: 256 tiles
        case = replace(case, batch=2 * case.batch)
    return case if dec_kernel(case, sm90) == kernel else None
