"""The FP8 Llama logits check (ci/llama_fp8_logits.py) on a CPU: its harness with the FA3
emulation standing in for the kernel (PASS, exit 0), a planted fault in that stand-in (FAIL,
exit 1), and no sm_90 GPU without a stand-in (exit 2). On an H200 it runs in ci/gpu_validate.sh
step fp8 (the kernel itself)."""

from __future__ import annotations

import contextlib
import io

import pytest

from .script_modules import load_script

pytest.importorskip("transformers", reason="transformers is not installed (noxfile TEST_DEPS "
                    "has it): the Llama client's tests need it")
client = load_script("ci/llama_fp8_logits.py")


def run(argv, kernel=None):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = client.main(argv, kernel=kernel)
    return code, buf.getvalue()


def emulation(q8, k8, v8, qd, kd, vd, causal, softmax_scale):
    from flash_attention.reference import attention_reference_fp8

    out, _ = attention_reference_fp8(q8, k8, v8, qd, kd, vd, softmax_scale, round_p=True,
                                     causal=causal)
    return out


def test_the_emulation_in_place_of_the_kernel_passes(tmp_path):
    code, text = run(["--preset", "tiny", "--json", str(tmp_path / "r.json")], emulation)
    assert code == 0 and "PASS" in text, text
    assert "| ours |" in text and "| peer |" in text and "| bf16 |" in text
    assert (tmp_path / "r.json").read_text().count('"pass": true') == 1


def test_a_planted_error_in_the_kernel_fails():
    def wrong(*args, **kwargs):
        out = emulation(*args, **kwargs)
        return out + 0.05 * out.abs().amax()  # a bias on every output value

    code, text = run(["--preset", "tiny"], wrong)
    assert code == 1 and "FAIL" in text, text


def test_without_an_sm90_gpu_it_says_so(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, text = run(["--preset", "tiny"])
    assert code == 2 and "sm_90" in text
