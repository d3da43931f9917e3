"""Context parallelism: attention over a sequence sharded across the ranks of a process group,
forward and backward, on torch.distributed (NCCL for CUDA tensors; gloo runs the same code on
CPU tensors with the fp32 reference as the block operation, which is how the ring's logic is
tested on machines without GPUs).

    from flash_attention.distributed import ring_attention, shard_sequence, gather_sequence
    q_local = shard_sequence(q, group)        # this rank's chunks of the sequence (dim 1)
    out_local = ring_attention(q_local, k_local, v_local, group=group, causal=True)
    out = gather_sequence(out_local, group)   # the whole sequence again

The layout (layout.py) gives rank r of P the chunks r and 2P - 1 - r of 2P equal chunks
("zigzag"), so that under a causal mask every rank has the same work; the ring (ring.py) passes
K and V (only the KV heads: GQA travels at its own size) around the group one step at a time,
each step's transfer running under the current block's attention (links.py: copied from the
peer GPU's memory by the copy engines, or sent by NCCL), and merges the partial outputs
by their LSEs in fp32 (merge.py); its backward sends dK and dV around with K and V. A sliding
window (ring_attention's window_size, as attention() takes it) skips the blocks outside it,
runs partial ones on slices, and shortens the ring to the steps some rank needs (layout.Plan).
A varlen pack is sharded sequence by sequence (shard_packed, gather_packed; ring_attention's
cu_seqlens; no window).
"""

from .layout import Layout, gather_packed, gather_sequence, shard_packed, shard_sequence
from .merge import merge_partials
from .ring import ring_attention

__all__ = ["Layout", "gather_packed", "gather_sequence", "merge_partials", "ring_attention",
           "shard_packed", "shard_sequence"]
