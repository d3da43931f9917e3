"""What the Hugging Face clients (ci/llama_train_client.py, ci/llama_generate_client.py,
ci/cp_train_example.py) share about the calls transformers makes to a registered attention
function: whether a call is causal, and the refusal of what the clients do not implement."""

from __future__ import annotations


def is_causal(module, kwargs) -> bool:
    """The call's causal flag (transformers passes is_causal, or sets it on the module)."""
    return bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))


def refuse_unsupported(attention_mask, dropout, kwargs, *, position_ids: bool = False) -> None:
    """Raise NotImplementedError for a mask, dropout or a sliding window (and, with
    position_ids, for a call without them). transformers builds no mask for an implementation
    it does not know (a causal model without padding needs none): a mask here is padding or a
    custom mask, which the clients refuse rather than ignore."""
    if attention_mask is not None:
        raise NotImplementedError("attention_mask (padding or a custom mask) is not supported: "
                                  "causal batches without padding only")
    if dropout:
        raise NotImplementedError(f"attention dropout {dropout} is not supported")
    if kwargs.get("sliding_window"):
        raise NotImplementedError("sliding_window from the model config is not wired here")
    if position_ids and kwargs.get("position_ids") is None:
        raise NotImplementedError("no position_ids: the cache lengths are read from them")
