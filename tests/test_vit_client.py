"""The Hugging Face ViT client (ci/vit_client.py): on a CPU its presets, its attention function's
contract and refusals, and its exit code 2 with no GPU; on a GPU the client itself on a small
batch (exit 0: every encoder within the accuracy rule), and the one-wave tiers dispatch picks
for a ViT's calls."""

from __future__ import annotations

import pytest
import torch

from .script_modules import load_script

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (noxfile TEST_DEPS has it): the ViT "
    "client's tests need it")

client = load_script("ci/vit_client.py")


def test_presets_are_vit_shapes():
    assert {name: (p.tokens, p.heads, p.d_head) for name, p in client.PRESETS.items()} == {
        "base-224": (197, 12, 64), "large-224": (257, 16, 64), "d128-448": (785, 10, 128)}
    assert "flash" not in client.NAME  # transformers would look for a flash-attn package


def test_attention_refuses_masks_and_dropout():
    q = torch.zeros(1, 2, 5, 8)
    with pytest.raises(NotImplementedError, match="unmasked"):
        client.ours(None, q, q, q, torch.zeros(1, 1, 5, 5))
    with pytest.raises(NotImplementedError, match="dropout"):
        client.ours(None, q, q, q, None, dropout=0.1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU exit code: a CPU machine")
def test_exit_code_2_without_a_gpu(capsys):
    assert client.main(["--presets", "base-224", "--batches", "1"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().out


@pytest.mark.gpu
def test_client_passes_on_a_small_batch(require_extension, tmp_path):
    out = tmp_path / "vit.json"
    assert client.main(["--batches", "2", "--steps", "2", "--json", str(out)]) == 0
    assert out.is_file()


@pytest.mark.gpu
def test_vit_calls_run_the_one_wave_tiers(require_sm90):
    """ViT-B at batch 1 (12 heads x 4 blocks of 64 rows) runs the B_r 64 tier; at batch 64 the
    length row; explain says which and why."""
    import flash_attention as fa
    from flash_attention import ops

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    q = torch.randn(1, 197, 12, 64, device="cuda", dtype=torch.bfloat16)
    text = ops.extension().explain(q, q, q, -1, -1, False)
    if sms >= 12 * 4:
        assert text.startswith("fwd_sm90_bf16_d64_r64_c128_s2_fwia (one wave"), text
    big = torch.randn(64, 197, 12, 64, device="cuda", dtype=torch.bfloat16)
    assert ops.extension().explain(big, big, big, -1, -1, False) == \
        "fwd_sm90_bf16_d64_r128_c128_s2_fwal"
    out = fa.attention(q, q, q)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2).float() for t in (q, q, q))).transpose(1, 2)
    assert (out.float() - ref).abs().max() < 2e-2
