"""Megatron-core's tensor-parallel layout of full-named tensors (ETP = 1), as a trainer shards them.

The rollout's own layout (`model.sharding`) splits only attention and the dense MLP over ATP and
keeps embeddings replicated; a Megatron trainer also splits the vocabulary and the shared expert.
Hot swap from such a trainer joins its TP slices with `join_tp` before resharding (rl's Megatron
trainer, the hot-swap benchmark). Left out: expert tensor parallelism (ETP > 1).
"""
from __future__ import annotations

import torch


def tp_split_dim(name: str) -> int | None:
    """The dimension Megatron splits `name` along over TP (ETP = 1: routed experts are whole), or None."""
    if ".experts.local_experts." in name or name.endswith("layernorm.weight") or name.endswith("router.weight"):
        return None
    if name.endswith(("linear_qkv.weight", "linear_fc1.weight", "word_embeddings.weight", "output_layer.weight")):
        return 0  # column parallel (and the vocab-parallel embedding)
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1  # row parallel
    return None


def join_tp(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """Full tensor from TP rank r's slices `parts[r]` (a SwiGLU fc1 slice is [gate_r; up_r])."""
    dim = tp_split_dim(name)
    if dim is None or len(parts) == 1:
        return parts[0]
    if name.endswith("linear_fc1.weight"):
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(parts, dim=dim)
