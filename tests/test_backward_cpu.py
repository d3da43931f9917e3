"""The backward on a machine without a GPU: its configs (the mirror of backward_config.cuh),
code generation, and the backward operator's fake implementation and validation, with the
autograd formula traced under FakeTensorMode (fake CUDA tensors).

A whole training step (forward, torch's autograd engine, update) traced on fake CUDA tensors
cannot run on this machine with torch 2.14: the engine asks the CUDA hooks whether device 0
has a primary context for every CUDA tensor it handles (stream synchronisation of its input
buffers), and with no device that check itself fails: ``RuntimeError: hasPrimaryContext
expects a valid device index, but got device_index=0``. It is torch's, not ours: ``(x * 2)
.sum().backward()`` on one fake CUDA tensor fails the same way. Every route tried goes through
the engine and stops there: eager backward under FakeTensorMode;
``make_fx(step, tracing_mode="fake")`` of a function calling ``torch.autograd.grad`` (also with
``FakeTensorMode(allow_non_fake_inputs=True)``); ``aot_export_joint_simple(trace_joint=True)``;
``aot_function``; ``torch.compile(backend="aot_eager")``; compiled autograd
(``torch._dynamo.compiled_autograd``); ``torch.func.vjp`` (which on our op first refuses: the
autograd.Function that register_autograd makes has no functorch support). Meta tensors are
refused by our input checks (CUDA only), and a PrivateUse1 device would not be CUDA either.
So ``test_training_step_traces_with_fake_cuda_tensors`` traces the step where a CUDA device
exists (the GPU machine, any torch) and on this machine xfails with that exact error (any other
error fails it); the CPU tests below trace the autograd formula and the fakes directly."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import flash_attention as fa
from flash_attention import ops
from flash_attention.codegen.generate import generate, kernel_source
from flash_attention.codegen.nvcc_wrapper import ARCH_MARKER, arch_override
from flash_attention.interface import flash_attn_func, flash_attn_varlen_func
from flash_attention.kernels import (
    Call,
    ConfigError,
    HelperKernel,
    bwd_sm80,
    bwd_sm90,
    dec_sm80,
    fwd_sm80,
    parse,
    parse_kernel,
    resolve,
)
from flash_attention.kernels.base import SMEM_PER_BLOCK_OPTIN
from flash_attention.kernels.bwd_sm80 import Sm80BwdConfig, WarpGrid, default_tile
from flash_attention.kernels.bwd_sm90 import Sm90BwdConfig

ALL = resolve("bwd:all")
HOPPER = bwd_sm90.SETS["default"]


def select(dtype: str, d_head: int, softcap: bool, built, hopper: bool = False):
    """The backward kernel the operator runs for a call (what it picks in C++): a Hopper one
    where the call can run one (``hopper``: an sm_90 GPU, fixed length, TMA-addressable) and
    one serves it, else an sm80-family one."""
    call = Call(dtype, d_head, softcap=softcap)
    return (bwd_sm90.select(call, built) if hopper else None) or bwd_sm80.select(call, built)


# ---- configs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", ALL, ids=str)
def test_names_round_trip(cfg):
    """Either kind: the name parses back to the config, by its own class, its kind module and
    the functions that read every kind (parse, parse_kernel); each fits its GPU's shared
    memory."""
    module = bwd_sm90 if isinstance(cfg, Sm90BwdConfig) else bwd_sm80
    assert type(cfg).parse(cfg.name) == module.parse(cfg.name) == parse(cfg.name) == cfg
    assert parse_kernel(cfg.name) == cfg and cfg.name.isidentifier()
    assert cfg.direction == "bwd" and cfg.name.startswith(cfg.KIND + "_")
    if isinstance(cfg, Sm90BwdConfig):
        assert cfg.smem_bytes <= SMEM_PER_BLOCK_OPTIN[90]
    else:
        assert cfg.accum_regs <= 200 and cfg.smem_bytes <= 163 * 1024


def test_sm80_chunks_split_warp_tiles_into_whole_pairs():
    """BwdConfig's static_asserts, as the twin computes the chunks: every sm80 config of every set
    (the variants at d_head 160 and 192 among them, which did not compile before the phase-3
    chunk became the widest whole divisor) splits phases 1 and 3 into whole pairs of n8 tiles."""
    sm80 = [c for c in ALL if isinstance(c, Sm80BwdConfig)]
    for cfg in sm80:
        for grid, chunk in ((cfg.phase1, cfg.p1_chunk_n_tiles), (cfg.phase3, cfg.p3_chunk_n_tiles)):
            assert chunk % 2 == 0 and grid.n_tiles % chunk == 0, cfg.name
    chunks = {c.d_head: c.p3_chunk_n_tiles for c in sm80}
    assert chunks == {32: 4, 64: 4, 96: 6, 128: 4, 160: 10, 192: 6, 256: 4}


def test_sets_cover_both_dtypes_and_softcap():
    default = resolve("bwd:default")
    assert len({(c.dtype, c.d_head, c.softcap) for c in default}) == 2 * 3 * 2
    assert len({(c.dtype, c.d_head, c.softcap) for c in bwd_sm80.SETS["variants"]}) == 2 * 7 * 2
    # every d_head up to 256 has a default kernel (zero-padded up to its variant)
    assert all(select(dt, d, sc, default) for dt in ("fp16", "bf16")
               for d in range(8, 257, 8) for sc in (False, True))
    assert default_tile("bf16", 128).name == "bwd_sm80_bf16_d128_r64_c128_w8_fh"
    assert default_tile("fp16", 256, softcap=True).name == "bwd_sm80_fp16_d256_r64_c64_w8_ft"
    assert default_tile("bf16", 64).name == "bwd_sm80_bf16_d64_r128_c128_w8_fh"
    # the default tiles are the rows of the default table, one per d_head variant
    assert {default_tile(dt, d, sc) for dt in ("fp16", "bf16") for d in fwd_sm80.D_HEADS
            for sc in (False, True)} == set(bwd_sm80.SETS["variants"]) | {
        default_tile(dt, 224, sc) for dt in ("fp16", "bf16") for sc in (False, True)}
    # ci: d_head 64 and 128 with the prefetch (bf16), fp16 d_head 256 with a softcap; all of
    # them default tiles, so a subset of the default set
    assert (default_tile("bf16", 64), default_tile("bf16", 128),
                           default_tile("fp16", 256, True)) == bwd_sm80.CI
    assert set(resolve("bwd:ci")) <= set(default)


@pytest.mark.parametrize("text, message", [
    ("bwd_sm80_bf16_d48_r64_c128_w8_f", "d_head must be one of"),
    ("bwd_sm80_bf16_d128_r64_c32_w8_f", "B_c must be one of"),
    ("bwd_sm80_bf16_d128_r32_c128_w8_f", "B_r must be one of"),
    ("bwd_sm80_bf16_d256_r64_c64_w4_f", "copies 4 smem rows per pass"),
    ("bwd_sm80_bf16_d256_r64_c64_w8_fh", "over the sm_80 limit"),
    ("bwd_sm80_bf16_d256_r64_c128_w8_f", "registers per thread"),
    ("bwd_sm80_bf16_d128_r64_c128_w8_fth", "in that order"),
    ("bwd_sm80_bf16_d128_r64_c128_w8_fb", "must be a subset of 'ht'"),  # the old prefetch letter
    ("bwd_sm80_bf16_d128_c128_r64_w8_fh", "cannot parse bwd_sm80 kernel name"),  # c before r
    ("fwd_sm80_bf16_d128_r64_c128_w8_f", "cannot parse bwd_sm80 kernel name"),
])
def test_invalid_configs_are_refused_with_the_reason(text, message):
    with pytest.raises(ConfigError, match=message):
        Sm80BwdConfig.parse(text)


def test_hopper_set_and_configs():
    """The Hopper default set: d_head 64 (B_r 128), 128 (B_r 64) and 256 (B_c 64, B_r 64: the
    warpgroups split d_head), both dtypes, softcap off and on; all of it in `bwd:default`
    (after the sm80 kind's tiles), its bf16 d_head 128 kernel in `ci`, none in `variants`;
    `r64` the d_head 64 ones at B_r 64. The fields and the shared memory mirror
    sm90/backward_config.cuh (kSmemBytes: K, V, two stages of Q, two of dO (one at d_head
    256), dS^T twice (once at d_head 64), P^T twice at d_head 256, a dQ part per warpgroup,
    LSE and D per stage, the barriers, 1024 bytes of alignment); B_r 128 only at d_head 64."""
    hopper = HOPPER
    assert len(hopper) == 24 and all(isinstance(c, Sm90BwdConfig) for c in hopper)
    assert {(c.dtype, c.d_head, c.softcap, c.varlen) for c in hopper} == {
        (dt, d, sc, vl) for dt in ("fp16", "bf16") for d in (64, 128, 256)
        for sc in (False, True) for vl in (False, True)}
    assert {(c.d_head, c.block_c, c.block_r) for c in hopper} == {
        (64, 128, 128), (128, 128, 64), (256, 64, 64)}
    assert [c.split_d for c in hopper].count(True) == 8
    # the varlen kernels (flag j) are the fixed-length rows' tiles, after them
    assert [c.varlen for c in hopper] == [False] * 12 + [True] * 12
    assert [dataclasses.replace(c, varlen=False) for c in hopper[12:]] == list(hopper[:12])
    r64 = bwd_sm90.SETS["r64"]
    assert {(c.d_head, c.block_r) for c in r64} == {(64, 64)}
    assert set(r64) <= set(ALL) and len(r64) == 4
    assert set(hopper) <= set(ALL)
    default = resolve("bwd:default")
    assert default[-24:] == hopper and not set(hopper) & set(bwd_sm80.SETS["variants"])
    assert default == bwd_sm80.DEFAULT + hopper
    assert set(hopper) & set(resolve("bwd:ci")) == {Sm90BwdConfig("bf16", 128, 64, 128),
                                                     Sm90BwdConfig("bf16", 128, 64, 128, True)}
    assert resolve("bwd_sm90:default,bwd:default") == hopper + default[:-24]
    cfg = parse("bwd_sm90_bf16_d128_r64_c128_ft")
    assert cfg == Sm90BwdConfig("bf16", 128, 64, 128, softcap=True)
    assert (cfg.family, cfg.KIND, cfg.ARCH, cfg.block_c, cfg.block_r, cfg.threads,
            cfg.warps) == ("sm90", "bwd_sm90", 90, 128, 64, 384, 12)
    assert cfg.name == "bwd_sm90_bf16_d128_r64_c128_ft" and cfg.flags_on == "softcap"
    assert Sm90BwdConfig("bf16", 128, 64, 128).smem_bytes == 198784  # with one block's fp32 dQ
    # a dQ part per warpgroup, one dS^T buffer (kDqOwnKeys)
    assert Sm90BwdConfig("fp16", 64, 64, 128).smem_bytes == 116864
    assert Sm90BwdConfig("fp16", 64, 128, 128).smem_bytes == 199808
    # one dO stage, P^T and dS^T twice each: 896 bytes under the 227 KB limit
    assert Sm90BwdConfig("bf16", 256, 64, 64).smem_bytes == 231552
    assert cfg.occupancy(90, 168)["ctas"] == 1  # 384 threads x 168 registers
    assert bwd_sm90.default_tile("bf16", 128) == Sm90BwdConfig("bf16", 128, 64, 128)
    assert bwd_sm90.default_tile("fp16", 64, True) == Sm90BwdConfig("fp16", 64, 128, 128,
                                                                     softcap=True)
    varlen = parse("bwd_sm90_fp16_d64_r128_c128_fjt")
    assert varlen == bwd_sm90.varlen_tile("fp16", 64, True) and varlen.varlen and varlen.softcap
    assert not varlen.serves(Call("fp16", 64, softcap=True))
    assert isinstance(parse_kernel("bwd_sm80_preprocess_bf16"), HelperKernel)
    # resolve names the sets when a name of either kind does not parse
    with pytest.raises(ConfigError, match="or name a set: ci, default"):
        resolve("bwd_sm90_bf16_d96_r64_c128_f")


@pytest.mark.parametrize("text, message", [
    ("bwd_sm90_bf16_d96_r64_c128_f", r"d_head must be one of \(64, 128, 256\), got 96"),
    ("bwd_sm90_fp16_d256_r64_c128_ft", "B_c=128 does not go with d_head=256"),
    ("bwd_sm90_bf16_d128_r64_c64_f", "B_c=64 does not go with d_head=128"),
    ("bwd_sm90_bf16_d128_r64_c256_f", r"B_c must be one of \(64, 128\), got 256"),
    ("bwd_sm90_bf16_d128_r128_c128_f", "B_r=128 needs d_head=64"),
    ("bwd_sm90_bf16_d64_r256_c128_f", r"B_r must be one of \(64, 128\), got 256"),
    ("bwd_sm90_bf16_d128_r64_c128_fb", "flags 'b' must be a subset of 'jt'"),
    ("bwd_sm90_bf16_d128_r64_c128_ftt", "must be a subset"),
    ("bwd_sm90_bf16_d128_c128_f", "cannot parse bwd_sm90 kernel name"),
    ("bwd_sm90_bf16_d128_r64_c128_w8_f", "cannot parse bwd_sm90 kernel name"),
    ("bwd_sm90_fp32_d128_r64_c128_f", "cannot parse bwd_sm90 kernel name"),
])
def test_invalid_hopper_configs_are_refused_with_the_reason(text, message):
    with pytest.raises(ConfigError, match=message):
        parse(text)


def test_invalid_hopper_config_fields_are_refused():
    with pytest.raises(ConfigError, match="dtype must be one of"):
        Sm90BwdConfig("fp32", 64, 64, 128)
    with pytest.raises(ConfigError, match="softcap must be a bool"):
        Sm90BwdConfig("bf16", 64, 64, 128, softcap=1)
    with pytest.raises(ConfigError, match="B_c=64 does not go with d_head=64"):
        Sm90BwdConfig("bf16", 64, 64, 64)
    with pytest.raises(ConfigError, match="B_c=128 does not go with d_head=256"):
        Sm90BwdConfig("bf16", 256, 64, 128)
    with pytest.raises(TypeError):  # B_r and B_c have no defaults
        Sm90BwdConfig("bf16", 128)  # type: ignore[call-arg]


def test_helpers_of_each_kind():
    """Every backward unit holds the preprocess and its kind's dQ conversion, of its dtype; a
    build holds each helper once."""
    sm80, sm90 = default_tile("fp16", 128), Sm90BwdConfig("bf16", 128, 64, 128)
    from flash_attention.kernels.helpers import helpers, helpers_of

    assert [h.name for h in helpers_of(sm80)] == ["bwd_sm80_preprocess_fp16",
                                                  "bwd_sm80_convert_dq_fp16"]
    assert [h.name for h in helpers_of(sm90)] == ["bwd_sm80_preprocess_bf16",
                                                  "bwd_sm90_convert_dq_bf16"]
    assert [h.name for h in helpers([sm90, sm80, sm80, *fwd_sm80.CI])] == [
        "bwd_sm80_preprocess_fp16", "bwd_sm80_convert_dq_fp16", "bwd_sm80_preprocess_bf16",
        "bwd_sm90_convert_dq_bf16"]
    h = HelperKernel.parse("bwd_sm90_convert_dq_fp16")
    assert (h.family, h.job, h.dtype, h.threads, h.warps, h.direction) == (
        "sm90", "convert_dq", "fp16", 256, 8, "bwd")
    assert h.template == "bwd_convert_dq_tiles_kernel" and str(h) == h.name
    with pytest.raises(ConfigError, match="cannot parse helper kernel"):
        HelperKernel.parse("bwd_sm90_preprocess_fp16")  # the preprocess is the sm80 kind's
    with pytest.raises(ConfigError, match="cannot parse helper kernel"):
        HelperKernel.parse("bwd_sm80_combine_fp16")  # the combine is the decode's
    with pytest.raises(ConfigError, match="invalid helper kernel"):
        HelperKernel("sm90", "preprocess", "bf16")
    # the decode kernels' helper: the split-KV combine
    dec = dec_sm80.default_tile("fp16", 128)
    assert [h.name for h in helpers_of(dec)] == ["dec_sm80_combine_fp16"]
    c = HelperKernel.parse("dec_sm80_combine_bf16")
    assert (c.family, c.job, c.direction, c.threads, c.template) == (
        "sm80", "combine", "dec", 128, "dec_combine_kernel")
    assert helpers_of(fwd_sm80.CI[0]) == ()


def test_warp_grids_take_the_squarest_tile():
    # mirrors flash::squarest_warp_rows: S^T of 128 keys x 64 queries over 8 warps is 4 x 2
    g = WarpGrid(128, 64, 8)
    assert (g.warp_rows, g.warp_cols, g.m_tiles, g.n_tiles) == (4, 2, 2, 4)
    g = WarpGrid(64, 256, 8)  # dK, dV of d_head 256: warps split d_head
    assert (g.warp_rows, g.warp_cols, g.m_tiles, g.n_tiles) == (2, 4, 2, 8)
    assert WarpGrid(64, 224, 8).warp_rows == 4  # 224 splits in two only
    assert WarpGrid(16, 16, 8).problems("x")


def test_resolve_and_select():
    assert resolve("bwd:none") == () == resolve("none")
    assert resolve("bwd:ci,bwd:ci") == resolve("bwd:ci")
    with pytest.raises(ConfigError, match="or name a set"):
        resolve("bwd:ci,nonsense")
    built = bwd_sm80.SETS["variants"]
    assert select("bf16", 40, False, built).d_head == 64
    assert select("bf16", 200, False, built).d_head == 256
    assert select("fp16", 256, True, built).softcap
    ci = resolve("bwd:ci")
    assert select("bf16", 72, False, ci).d_head == 128
    assert select("fp16", 64, False, ci) is None


def test_select_prefers_a_hopper_kernel_only_when_the_call_can_run_one():
    """hopper=True (an sm_90 GPU, fixed length, TMA-addressable): the Hopper kernel of the
    smallest d_head variant not below the call's, else the sm80 kind's; hopper=False: the
    sm80 kind's alone (what the operator does in C++)."""
    built = resolve("bwd:default")
    h = select("bf16", 128, False, built, hopper=True)
    assert h == Sm90BwdConfig("bf16", 128, 64, 128)
    assert select("bf16", 128, False, built) == default_tile("bf16", 128)
    assert select("bf16", 128, False, built, hopper=False) == default_tile("bf16", 128)
    assert select("fp16", 40, True, built, hopper=True) == Sm90BwdConfig(
        "fp16", 64, 128, 128, softcap=True)
    assert select("fp16", 96, False, built, hopper=True).name == "bwd_sm90_fp16_d128_r64_c128_f"
    # above 128: the Hopper kind's d_head 256 kernel (split d_head), or off Hopper the sm80
    # kind's
    assert select("bf16", 192, False, built, hopper=True) == Sm90BwdConfig("bf16", 256, 64, 64)
    assert select("bf16", 192, False, built) == default_tile("bf16", 256)
    # no Hopper kernel built: the sm80 kind; only Hopper kernels: none off Hopper
    assert select("bf16", 64, True, bwd_sm80.DEFAULT, hopper=True) == default_tile("bf16", 64,
                                                                                   True)
    assert select("bf16", 64, False, HOPPER, hopper=False) is None
    assert select("bf16", 64, False, HOPPER, hopper=True) == Sm90BwdConfig("bf16", 64, 128, 128)
    assert select("bf16", 264, False, HOPPER, hopper=True) is None
    # each kind's select reads its own kernels alone
    assert bwd_sm90.select(Call("bf16", 128), bwd_sm80.DEFAULT) is None
    assert bwd_sm80.select(Call("bf16", 128), HOPPER) is None


# ---- code generation --------------------------------------------------------------------------


def test_codegen_writes_one_file_per_config_and_the_registry(tmp_path):
    """Backward units go beside the forward ones (one directory, one registry.cu listing both
    registries); a smaller selection removes the stale files; a build without backward kernels
    keeps a valid (empty) backward registry."""
    forward = fwd_sm80.CI[:1]
    configs = resolve("bwd:ci")
    paths = generate((*forward, *configs), tmp_path)
    assert [p.name for p in paths] == [f"{c.name}.cu" for c in (*forward, *configs)] + [
        "registry.cu"]
    text = (tmp_path / "bwd_sm80_bf16_d128_r64_c128_w8_fh.cu").read_text()
    assert ("sm80::BwdConfig<__nv_bfloat16, 128, 64, 128, 8, /*prefetch=*/true, "
            "/*softcap=*/false>" in text)
    registry = (tmp_path / "registry.cu").read_text()
    assert all(f"&entry_{c.name}" in registry for c in configs)
    assert f"*count = {len(configs)};" in registry
    generate((*forward, *configs[:1]), tmp_path)
    assert not (tmp_path / f"{configs[1].name}.cu").exists()
    generate(forward, tmp_path)
    registry = (tmp_path / "registry.cu").read_text()
    assert "*count = 0;" in registry and "BwdKernelEntry" in registry
    assert not list(tmp_path.glob("bwd_*.cu"))


def test_codegen_of_a_hopper_config(tmp_path):
    """A Hopper backward unit: the sm_90a marker in its head (the nvcc wrapper then compiles it
    for sm_90a alone), the Hopper launcher's header, flash::sm90::BwdConfig<Elem, d_head, B_r,
    B_c, softcap> and its registry entry; listed in the registry beside the sm80 kind's, which
    keeps its own template and no marker. Every flag changes the instantiation."""
    hopper, sm80 = Sm90BwdConfig("bf16", 128, 64, 128), default_tile("bf16", 128)
    forward = fwd_sm80.CI[0]
    paths = generate((forward, hopper, sm80), tmp_path)
    assert [p.name for p in paths] == [f"{forward.name}.cu", f"{hopper.name}.cu",
                                       f"{sm80.name}.cu", "registry.cu"]
    text = paths[1].read_text()
    assert ARCH_MARKER in text[:4096] and "torch" not in text
    assert '#include "sm90/backward_launch.cuh"' in text
    assert (f"using Cfg_{hopper.name} = sm90::BwdConfig<__nv_bfloat16, 128, 64, 128, "
            "/*varlen=*/false, /*softcap=*/false>;") in text
    assert f'sm90::make_bwd_entry<Cfg_{hopper.name}>("{hopper.name}")' in text
    assert f"extern const BwdKernelEntry entry_{hopper.name} =" in text
    other = paths[2].read_text()
    assert ARCH_MARKER not in other and '#include "sm80/backward_launch.cuh"' in other
    assert "sm90::" not in other
    registry = paths[3].read_text()
    assert f"&entry_{hopper.name}," in registry and f"&entry_{sm80.name}," in registry
    assert "*count = 2;" in registry
    args = ["-O3", "-gencode=arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"]
    assert arch_override(args, str(paths[1])) == ["-O3", "-gencode=arch=compute_90a,code=sm_90a"]
    assert arch_override(args, str(paths[2])) == args
    fp16 = kernel_source(Sm90BwdConfig("fp16", 64, 128, 128, softcap=True))
    assert ("sm90::BwdConfig<__half, 64, 128, 128, /*varlen=*/false, /*softcap=*/true>;"
            in fp16)
    for name in Sm90BwdConfig.FLAGS:
        flipped = hopper.replace(**{name: not getattr(hopper, name)})
        assert kernel_source(flipped) != kernel_source(hopper)
    for name in Sm80BwdConfig.FLAGS:
        flipped = sm80.replace(**{name: not getattr(sm80, name)})
        assert kernel_source(flipped) != kernel_source(sm80)


# ---- the operator's fake, validation and tracing ----------------------------------------------


def test_bwd_explain_is_registered_and_refuses_cpu_tensors(require_extension):
    """flash_attention::bwd_explain (the backward's debug log: what a call runs, and why not the
    Hopper kernel) is an operator of every build; it reads the GPU's properties, so CPU tensors
    are refused with a ValueError, not a crash."""
    t = torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bwd_explain needs CUDA tensors"):
        torch.ops.flash_attention.bwd_explain(t, t, t, t, False, False)



@pytest.fixture
def mode(require_extension):
    from flash_attention import backward

    if not backward.built():
        pytest.skip("this build has no backward kernels")
    return FakeTensorMode()


def traceable_call():
    """(torch dtype, d_head, causal, softcap) that this build serves forward and backward."""
    from flash_attention import backward

    bwd = backward.built()
    for dtype, d, _, mask, _, softcap, *_ in ops.dispatch_rows(ops.BUILT):
        if any(select(dtype, d, softcap, bwd, hopper=h) is not None for h in (False, True)):
            return ({"fp16": torch.float16, "bf16": torch.bfloat16}[dtype], d, mask,
                    5.0 if softcap else 0.0)
    pytest.skip("this build serves no call both ways")


class _Ctx:
    """What the autograd formula uses of torch's context object."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def test_autograd_formula_traces_with_fake_tensors(mode):
    """The forward op's autograd formula on fake CUDA tensors: the forward saves q, k, v, out
    and the LSE (nothing of size seqlen^2) and the backward op gives gradients shaped like the
    inputs. (The autograd engine itself needs a GPU to run a CUDA backward, fake or not: the
    GPU tests run it, eagerly and under torch.compile.)"""
    from flash_attention import backward

    dtype, d, causal, softcap = traceable_call()
    assert torch._C._dispatch_has_kernel_for_dispatch_key("flash_attention::attention",
                                                          "Autograd")
    with mode:
        q = torch.randn(2, 33, 4, d, dtype=dtype, device="cuda")
        k = torch.randn(2, 40, 2, d, dtype=dtype, device="cuda")
        inputs = (q, k, k, None, None, 0, 0, None, causal, -1, -1, softcap, True, "")
        out, lse = torch.ops.flash_attention.attention.default(*inputs)
        ctx = _Ctx()
        backward._setup_context(ctx, inputs, (out, lse))
        saved = ctx.saved_tensors
        assert [t.shape for t in saved[:5]] == [q.shape, k.shape, k.shape, q.shape, (2, 4, 33)]
        assert saved[5:] == (None, None)  # cu_seqlens of a varlen call
        grads = backward._attention_backward(ctx, torch.randn_like(out), None)
        assert len(grads) == len(inputs) and all(g is None for g in grads[3:])
        for g, t in zip(grads[:3], (q, k, k)):
            assert isinstance(g, FakeTensor) and g.shape == t.shape and g.dtype == dtype
        ctx.return_lse = False  # a forward without the LSE cannot be differentiated
        with pytest.raises(RuntimeError, match="return_lse=True"):
            backward._attention_backward(ctx, out, None)


def test_requires_grad_keeps_the_lse_and_the_deterministic_op(mode):
    dtype, d, causal, softcap = traceable_call()
    with mode:
        q = torch.randn(2, 33, 4, d, dtype=dtype, device="cuda", requires_grad=True)
        out = fa.attention(q, q, q, causal=causal, softcap=softcap)
        det = flash_attn_func(q, q, q, causal=causal, softcap=softcap, deterministic=True)
    assert out.grad_fn is not None and "attention" in out.grad_fn.name()
    assert det.grad_fn is not None and out.shape == det.shape == q.shape


class _BwdCalls(TorchDispatchMode):
    """Records the arguments of every flash_attention::bwd call under it."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.flash_attention.bwd.default:
            self.calls.append(args)
        return func(*args, **(kwargs or {}))


def test_varlen_deterministic_orders_dq_with_the_sequences(mode):
    """deterministic=True of a varlen call keeps the LSE through attention_det (attention's
    arguments), whose autograd formula asks the backward op for the fixed dQ order with the
    call's cu_seqlens and max_seqlens."""
    from flash_attention import backward

    dtype, d, causal, softcap = traceable_call()
    with mode:
        q = torch.randn(53, 4, d, dtype=dtype, device="cuda", requires_grad=True)
        k = torch.randn(70, 2, d, dtype=dtype, device="cuda", requires_grad=True)
        cu_q = torch.tensor([0, 20, 53], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, 40, 70], dtype=torch.int32, device="cuda")
        det = flash_attn_varlen_func(q, k, k, cu_q, cu_k, 33, 40, causal=causal, softcap=softcap,
                                     deterministic=True)
        assert det.grad_fn is not None and "attention_det" in det.grad_fn.name()
        plain = flash_attn_varlen_func(q, k, k, cu_q, cu_k, 33, 40, causal=causal,
                                       softcap=softcap)
        assert "attention_det" not in plain.grad_fn.name()

        inputs = (q.detach(), k.detach(), k.detach(), cu_q, cu_k, 33, 40, None, causal, -1, -1,
                  softcap, True, "")
        out, lse = torch.ops.flash_attention.attention_det.default(*inputs)
        assert out.shape == q.shape and lse.shape == (4, 53)
        ctx = _Ctx()
        backward._setup_deterministic_context(ctx, inputs, (out, lse))
        with _BwdCalls() as recorded:
            grads = backward._attention_backward(ctx, torch.randn_like(out), None)
    (args,) = recorded.calls
    assert args[7] is cu_q and args[8] is cu_k and args[9:11] == (33, 40)
    assert args[16] is True  # deterministic
    assert [g.shape for g in grads[:3]] == [q.shape, k.shape, k.shape]
    assert all(g is None for g in grads[3:])


def test_bwd_fake_checks_its_arguments(mode):
    dtype, d, causal, softcap = traceable_call()
    with mode:
        q = torch.empty(1, 20, 2, d, dtype=dtype, device="cuda")
        k = torch.empty(1, 30, 1, d, dtype=dtype, device="cuda")
        lse = torch.empty(1, 2, 20, dtype=torch.float32, device="cuda")
        bwd = torch.ops.flash_attention.bwd.default
        args = [q, q, k, k, q, lse, None, None, None, 0, 0, None, causal, -1, -1, softcap,
                False, ""]
        dq, dk, dv = bwd(*args)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape
        with pytest.raises(ValueError, match="dout must have the shape"):
            bwd(*[q[:, :10], *args[1:]])
        with pytest.raises(ValueError, match="lse must be fp32"):
            bwd(*[*args[:5], lse[:, :1], *args[6:]])
        cu = torch.zeros(2, dtype=torch.int32, device="cuda")
        with pytest.raises(ValueError, match="3-D"):  # varlen tensors are packed
            bwd(*[*args[:7], cu, cu, *args[9:]])
        packed_q, packed_k = q[0], k[0]
        lse_v = torch.empty(2, 20, dtype=torch.float32, device="cuda")
        dq, dk, dv = bwd(packed_q, packed_q, packed_k, packed_k, packed_q, lse_v, None, cu, cu,
                         20, 30, None, causal, -1, -1, softcap, False, "")
        assert dq.shape == packed_q.shape and dk.shape == dv.shape == packed_k.shape
        with pytest.raises(RuntimeError, match="not in this build"):
            bwd(*[*args[:-1], "bwd_sm80_bf16_d32_r64_c64_w8_f"])


def test_calls_without_a_backward_are_refused(mode):
    dtype, d, _, _ = traceable_call()
    with mode:
        q = torch.empty(1, 20, 2, d, dtype=dtype, device="cuda", requires_grad=True)
        with pytest.raises(RuntimeError, match="no backward for a call with out="):
            fa.attention(q, q, q, out=torch.empty(1, 20, 2, d, dtype=dtype, device="cuda"))
        with pytest.raises(NotImplementedError, match="dropout_p"):
            flash_attn_func(q, q, q, dropout_p=0.1)


def test_training_step_traces_with_fake_cuda_tensors(mode):
    """A training step (projections to q, k, v, attention, loss, gradients, SGD update) traced
    by make_fx on fake CUDA tensors: the graph holds the forward and backward operators, and
    the gradients have the weights' shapes, dtypes and (contiguous) strides. On a machine
    without a CUDA device torch's autograd engine cannot handle CUDA tensors (module
    docstring): xfail with exactly that error."""
    from torch.fx.experimental.proxy_tensor import make_fx

    dtype, d, causal, softcap = traceable_call()
    batch, seq, hidden, heads, kv_heads = 2, 37, 64, 4, 2

    def step(x, wq, wk, wv):
        q = (x @ wq).view(batch, seq, heads, d)
        k = (x @ wk).view(batch, seq, kv_heads, d)
        v = (x @ wv).view(batch, seq, kv_heads, d)
        out = fa.attention(q, k, v, causal=causal, softcap=softcap)
        loss = out.float().square().mean()
        grads = torch.autograd.grad(loss, (wq, wk, wv))
        return (*[w.detach() - 0.1 * g for w, g in zip((wq, wk, wv), grads)], *grads)

    with mode:
        x = torch.randn(batch, seq, hidden, dtype=dtype, device="cuda")
        weights = [torch.randn(hidden, h * d, dtype=dtype, device="cuda", requires_grad=True)
                   for h in (heads, kv_heads, kv_heads)]
    try:
        gm = make_fx(step, tracing_mode="fake")(x, *weights)
    except RuntimeError as exc:
        if torch.cuda.is_available() or "hasPrimaryContext expects a valid device" not in str(
                exc):
            raise
        pytest.xfail(f"torch's autograd engine needs a CUDA device for CUDA tensors: {exc}")
    ops_in_graph = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.flash_attention.attention.default in ops_in_graph
    assert torch.ops.flash_attention.bwd.default in ops_in_graph
    bwd = next(n for n in gm.graph.nodes if n.target == torch.ops.flash_attention.bwd.default)
    dq, dk, dv = bwd.meta["val"]
    assert dq.shape == (batch, seq, heads, d) and dk.shape == dv.shape == (batch, seq, kv_heads,
                                                                            d)
    assert all(t.dtype == dtype and t.is_contiguous() for t in (dq, dk, dv))
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    updated, grads = outputs[:3], outputs[3:]
    for node, w in zip([*updated, *grads], [*weights, *weights]):
        val = node.meta["val"]
        assert val.shape == w.shape and val.dtype == dtype and val.stride() == w.stride()


def test_backward_dispatch_rows_cover_every_variant():
    """The backward's table (flash_attention.backward.dispatch_rows) has a row per dtype,
    d_head variant and softcap with bucket 64 and no mask: the Hopper kernel where one is built
    (its row's), the sm80-family kernel as the fallback; with the sm80 kind alone both are that
    kernel; a variant no built kernel serves has no row."""
    from flash_attention import backward
    from flash_attention.kernels.base import D_HEADS

    rows = backward.dispatch_rows(resolve("bwd:default"))
    assert len(rows) == 2 * 2 * len(D_HEADS)
    for dtype, d, bucket, mask, local, softcap, kernel, fallback, varlen, *tiers in rows:
        assert (bucket, mask, local, tiers) == (64, False, False, ["", ""])
        call = Call(dtype, d, softcap=softcap)
        # varlen calls: the Hopper kernel of the row's tile with flag j
        assert varlen == dataclasses.replace(parse(kernel), varlen=True).name
        assert kernel == bwd_sm90.select(call, resolve("bwd:default")).name
        assert fallback == bwd_sm80.select(call, resolve("bwd:default")).name
        assert parse(kernel).serves(call) and parse(fallback).serves(call)
    sm80_only = backward.dispatch_rows(resolve("bwd_sm80:default"))
    assert all(r[6] == r[7] and r[6].startswith("bwd_sm80_") and r[8] == "" for r in sm80_only)
    hopper_only = backward.dispatch_rows(resolve("bwd_sm90:default"))
    assert all(r[7] == "" for r in hopper_only)
    d128 = backward.dispatch_rows([bwd_sm80.default_tile("bf16", 128)])
    assert [r[1] for r in d128] == [32, 64, 96, 128]  # no kernel serves d_head 160-256


def test_backward_select_takes_the_row_kernel_first():
    """A backward kind picks its row's kernel where it is built, whatever else of that d_head
    the build holds before it (the measured tile), else the smallest built variant that serves
    the call (zero-padded)."""
    row = bwd_sm80.default_tile("bf16", 64)
    other = row.replace(block_r=64)  # the same d_head, another tile, first in the build
    assert bwd_sm80.select(Call("bf16", 64), (other, row)) == row
    assert bwd_sm80.select(Call("bf16", 64), (other,)) == other
    assert bwd_sm80.select(Call("bf16", 40), (bwd_sm80.default_tile("bf16", 128),)) \
        == bwd_sm80.default_tile("bf16", 128)
    r64 = bwd_sm90.SETS["r64"][0]
    assert bwd_sm90.select(Call("bf16", 64), (r64, bwd_sm90.default_tile("bf16", 64))) \
        == bwd_sm90.default_tile("bf16", 64)
