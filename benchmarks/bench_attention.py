"""asv: timings of attention() and of PyTorch SDPA's FLASH_ATTENTION (FA2) and CUDNN_ATTENTION
backends, over dtype x d_head x (batch, seq_len), 16 heads. All cases are measured once per
run in setup_cache, in one process, with CUDA events (fa_tools.gpu.perfcases: median of 20 calls);
the track_ methods report them. Without a GPU every benchmark here is skipped.
Nox builds the extension; asv only measures (environment_type "existing")."""

from fa_tools.gpu.perfcases import ASV_CASES, CONTENDERS, STANDARD, Case, measure

SHAPES = [f"{b}x{s}" for b, s in STANDARD]


class Attention:
    params = (["bf16", "fp16"], [128, 64], SHAPES)
    param_names = ["dtype", "d_head", "batch_x_seq"]
    timeout = 600

    def setup_cache(self):
        import torch

        if not torch.cuda.is_available():
            return {"skip": "no CUDA GPU: timings skipped"}  # asv passes no cache for None
        return measure(list(ASV_CASES), CONTENDERS, reps=20)

    setup_cache.timeout = 1200

    def setup(self, cache, dtype, d_head, shape):
        if "skip" in cache:
            raise NotImplementedError(cache["skip"])
        batch, seqlen = (int(x) for x in shape.split("x"))
        self.r = cache[Case(dtype, d_head, batch, seqlen).name]

    def track_ours_ms(self, cache, dtype, d_head, shape):
        return self.r["ours"]

    track_ours_ms.unit = "ms"

    def track_sdpa_fa2_ms(self, cache, dtype, d_head, shape):
        return self.r["sdpa_fa2"]

    track_sdpa_fa2_ms.unit = "ms"

    def track_sdpa_cudnn_ms(self, cache, dtype, d_head, shape):
        return self.r["sdpa_cudnn"]

    track_sdpa_cudnn_ms.unit = "ms"

    def track_ratio_to_sdpa_fa2(self, cache, dtype, d_head, shape):
        """Our time over SDPA FA2's in the same run (lower is better, < 1: we are faster)."""
        return self.r["ours"] / self.r["sdpa_fa2"]

    track_ratio_to_sdpa_fa2.unit = "ratio"
