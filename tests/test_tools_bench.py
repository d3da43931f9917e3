"""The benchmark harness's pure parts (CPU)."""

from __future__ import annotations

from fa_tools.gpu import bench


def test_parse_shapes():
    assert bench.parse_shapes("16x512,4X16384") == [(16, 512), (4, 16384)]


def test_markdown_table_has_ratio_and_missing_peer():
    row = {"dtype": "bf16", "d_head": 128, "batch": 16, "seqlen": 4096, "heads": 16,
           "config": "fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor", "ours_tflops": 360.0,
           "sdpa_fa2_tflops": 350.0, "ratio_sdpa_fa2": 1.0286, "sdpa_cudnn_tflops": None,
           "ratio_sdpa_cudnn": None}
    text = bench.markdown([row], {"gpu": "NVIDIA H200", "torch": "2.11", "commit": "abc"})
    assert "| bf16 | 128 | 16x4096 | 16 | 360.0 | 350.0 | 1.029 | n/a | n/a |" in text
    assert "NVIDIA H200" in text and "abc" in text


def test_markdown_table_has_the_cycle_ratio():
    row = {"dtype": "bf16", "d_head": 128, "batch": 16, "seqlen": 4096, "heads": 16,
           "config": "fwd_sm90_bf16_d128_r128_c128_s2_fwpia", "ours_tflops": 600.0,
           "sdpa_fa2_tflops": 380.0, "ratio_sdpa_fa2": 1.58, "sdpa_cudnn_tflops": 610.0,
           "ratio_sdpa_cudnn": 0.984, "cycle_ratio_sdpa_cudnn": 0.93}
    text = bench.markdown([row], {"gpu": "NVIDIA H100", "torch": "2.11", "commit": "abc"})
    assert "| 610.0 | 0.984 | 0.930 | `fwd_sm90_bf16_d128_r128_c128_s2_fwpia` |" in text


def test_gemm_lines_put_each_row_against_the_gemm_of_its_rounds():
    rows = [{"dtype": "fp16", "batch": 16, "seqlen": 2048, "config": "fwd_sm90_fp16_x",
             "gemm_tflops": 680.0, "gemm_tflops_min": 650.5, "gemm_tflops_max": 700.25,
             "ratio_gemm": 0.8012, "cycle_ratio_gemm": 0.7901},
            {"dtype": "bf16", "batch": 16, "seqlen": 4096, "config": "fwd_sm90_bf16_x",
             "gemm_tflops": 700.0, "gemm_tflops_min": 690.0, "gemm_tflops_max": 710.0,
             "ratio_gemm": 0.9, "cycle_ratio_gemm": None}]
    text = bench.gemm_lines(rows)
    assert "| fp16 | 16x2048 | `fwd_sm90_fp16_x` | 680.0 (650.5-700.2) | 0.801 | 0.790 |" in text
    assert "| bf16 | 16x4096 | `fwd_sm90_bf16_x` | 700.0 (690.0-710.0) | 0.900 | n/a |" in text


def test_backward_rows_time_each_family_on_the_variant_a_call_runs():
    """--pass bwd --configs: of the named backward kernels (selections expand; their forward
    kernels are left out), those of the row's dtype without a softcap on the d_head variant a
    call of that d_head runs, one per kind (the sm80 kind's and the Hopper one's, for a
    progression); without --configs the operator's own choice (named after the run)."""
    assert bench.backward_kernels("bwd:default", "bf16", 128) == [
        "bwd_sm80_bf16_d128_r64_c128_w8_fh", "bwd_sm90_bf16_d128_r64_c128_f"]
    assert bench.backward_kernels("bwd:default", "fp16", 40) == [
        "bwd_sm80_fp16_d64_r128_c128_w8_fh", "bwd_sm90_fp16_d64_r128_c128_f"]
    assert bench.backward_kernels("bwd:default", "bf16", 192) == [
        "bwd_sm80_bf16_d256_r64_c64_w8_f", "bwd_sm90_bf16_d256_r64_c64_f"]
    assert bench.backward_kernels("bwd_sm90:default", "bf16", 256) == [
        "bwd_sm90_bf16_d256_r64_c64_f"]
    assert bench.backward_kernels("bwd_sm90:default", "bf16", 264) == []
    assert bench.backward_kernels(None, "bf16", 128) == [""]
    # a selection of every kind: its forward kernels are not backward ones
    assert bench.backward_kernels("default", "bf16", 128) == bench.backward_kernels(
        "bwd:default", "bf16", 128)
    assert bench.backward_kernels("fwd:default", "bf16", 128) == []
    # two tiles of one variant (bwd_sm90:r64 beside the default): both, in selection order
    assert bench.backward_kernels("bwd_sm90:r64,bwd_sm90:default", "fp16", 64) == [
        "bwd_sm90_fp16_d64_r64_c128_f", "bwd_sm90_fp16_d64_r128_c128_f"]


def test_markdown_names_the_backward_pass():
    row = {"dtype": "bf16", "d_head": 128, "batch": 16, "seqlen": 4096, "heads": 16,
           "config": "bwd_sm90_bf16_d128_r64_c128_f", "pass": "bwd", "ours_tflops": 377.8,
           "sdpa_fa2_tflops": 306.8, "ratio_sdpa_fa2": 1.23, "sdpa_cudnn_tflops": 505.6,
           "ratio_sdpa_cudnn": 0.75}
    text = bench.markdown([row], {"gpu": "NVIDIA H100", "torch": "2.11", "commit": "abc"})
    assert "The backward alone (FLOPs 2.5x the forward's)." in text
    assert "`bwd_sm90_bf16_d128_r64_c128_f`" in text
