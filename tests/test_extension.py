"""The built extension (CPU): it imports, and its registry is exactly the configs the build
selected, with the same derived facts as the Python configs."""

from __future__ import annotations

import pytest

import flash_attention as fa
from flash_attention._extension import extension, ptxas_log_path


@pytest.fixture
def ext(require_extension):
    return extension()


def test_registry_matches_build_info(ext):
    """The forward registry lists build_info's "configs", the backward one its "bwd_configs",
    the decode one its "dec_configs", each the selection's kernels of that direction in
    selection order."""
    from flash_attention import backward, kvcache

    info = fa.build_info()
    assert info is not None, "build_info.json missing beside the extension"
    assert "bwd_kernels" not in info  # one selection (FLASH_ATTENTION_KERNELS) for every kind
    selected = fa.resolve(info["kernels"])
    assert [c.name for c in fa.available_configs()] == info["configs"]
    assert fa.available_configs() == [c for c in selected if c.direction == "fwd"]
    assert [c.name for c in backward.built()] == info["bwd_configs"]
    assert list(backward.built()) == [c for c in selected if c.direction == "bwd"]
    assert [c.name for c in kvcache.built()] == info["dec_configs"]
    assert list(kvcache.built()) == [c for c in selected if c.direction == "dec"]


def test_registry_facts_match_python_configs(ext):
    for entry in ext.kernels():
        cfg = fa.parse(entry["name"])
        assert entry["dtype"] == cfg.dtype
        assert entry["d_head"] == cfg.d_head
        assert entry["block_r"] == cfg.block_r and entry["block_c"] == cfg.block_c
        assert entry["threads"] == cfg.threads
        assert entry["smem_bytes"] == cfg.smem_bytes
        assert entry["mask"] == cfg.mask and entry["softcap"] == cfg.softcap


def test_ptxas_report_kept(ext):
    text = ptxas_log_path().read_text()
    info = fa.build_info()
    for name in info["configs"]:
        assert f"### {name}.cu" in text
    for name in info["bwd_configs"]:  # the backward's in the same report
        assert f"### {name}.cu" in text
    assert "### registry.cu" in text
    sm80 = [c for c in info["configs"] if c.startswith("fwd_sm80_")]
    for arch in info["archs"]:
        assert text.count(f"for 'sm_{arch}'") >= len(sm80)
    # Hopper kernels compile for sm_90a alone, whatever the build's list: a forward unit one
    # kernel, a Hopper backward unit three (its main kernel and its kind's two helpers of its
    # dtype: the preprocess and the tile-order dQ conversion).
    hopper_bwd = [c for c in info["bwd_configs"] if c.startswith("bwd_sm90_")]
    assert text.count("for 'sm_90a'") == len(info["configs"]) - len(sm80) + 3 * len(hopper_bwd)


def test_operator_call_rejects_bad_input(ext):
    """The operator checks what it is given even when called directly, without the API."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    q = torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16)
    with pytest.raises((NotImplementedError, RuntimeError), match="CPU"):
        torch.ops.flash_attention.fwd(q, q, q, q, None, "", 0.1, -1, -1, 0.0)
    with FakeTensorMode():
        q = torch.empty(1, 4, 1, 64, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(RuntimeError, match="not in this build"):
            torch.ops.flash_attention.fwd(q, q, q, q, None, "fwd_sm80_bf16_d64_r64_c64_w4_f", 0.1,
                                          -1, -1, 0.0)


def test_registry_lists_each_direction(ext):
    """kernels(direction) lists that direction's registry (the backward's entries serve masks:
    masks are run-time arguments there); another direction is refused by name."""
    from flash_attention import backward, kvcache

    assert [e["name"] for e in ext.kernels("fwd")] == [c.name for c in fa.available_configs()]
    bwd = ext.kernels("bwd")
    assert [e["name"] for e in bwd] == [c.name for c in backward.built()]
    for entry in bwd:
        cfg = fa.parse(entry["name"])
        assert (entry["block_r"], entry["block_c"], entry["softcap"], entry["mask"]) == (
            cfg.block_r, cfg.block_c, cfg.softcap, True)
        assert entry["arch"] == (90 if cfg.family == "sm90" else 80)
    dec = ext.kernels("dec")
    assert [e["name"] for e in dec] == [c.name for c in kvcache.built()]
    for entry in dec:  # masks and softcap are run-time arguments of every decode kernel
        assert (entry["mask"], entry["softcap"], entry["arch"]) == (True, True, 80)
    with pytest.raises(ValueError, match="direction must be fwd, bwd or dec"):
        ext.kernels("sideways")


def test_set_dispatch_checks_its_rows(ext):
    """Each direction's table takes rows of its own registry: a kernel another build or
    direction has, a fallback that is not an sm80-family kernel and an unknown direction are
    refused (the table the package set stays in place: a call still finds its kernel)."""
    from flash_attention import backward, ops

    fwd = fa.available_configs()
    row = ("bf16", 128, 64, False, False, False)
    with pytest.raises(RuntimeError, match="not in this build"):
        ext.set_dispatch("bwd", [(*row, fwd[0].name, fwd[0].name, "", "", "")])
    hopper = [c for c in backward.built() if c.family == "sm90"]
    if hopper:
        with pytest.raises(RuntimeError, match="not an sm80-family kernel"):
            ext.set_dispatch("bwd", [(*row, hopper[0].name, hopper[0].name, "", "", "")])
    with pytest.raises(RuntimeError, match="not in this build"):  # a forward kernel as decode's
        ext.set_dispatch("dec", [(*row, fwd[0].name, fwd[0].name, "", "", "")])
    fixed_hopper = [c for c in fwd if c.family == "sm90" and not c.varlen]
    if fixed_hopper:  # a varlen column naming a kernel that also takes fixed-length calls
        with pytest.raises(RuntimeError, match="does not take varlen calls alone"):
            ext.set_dispatch("fwd", [(*row, fwd[0].name, fwd[0].name, fixed_hopper[0].name, "",
                                      "")])
    sm80 = [c for c in fwd if c.family == "sm80"]
    if sm80:  # a one-wave tier, then a fewer-padded-keys kernel, naming an sm80-family kernel
        with pytest.raises(RuntimeError, match="not a fixed-length Hopper kernel"):
            ext.set_dispatch("fwd", [(*row, fwd[0].name, sm80[0].name, "", sm80[0].name, "")])
        with pytest.raises(RuntimeError, match="not a fixed-length Hopper kernel"):
            ext.set_dispatch("fwd", [(*row, fwd[0].name, sm80[0].name, "", "", sm80[0].name)])
    with pytest.raises(ValueError, match="direction must be fwd, bwd or dec"):
        ext.set_dispatch("sideways", [])
    ops.refresh_dispatch()
    assert ext.choice("bf16", 128, 4096, False, False) != ""
