"""Full rollout tensors from a Megatron trainer sharded over TP and EP: bucketed device collectives.

Where the trainer's layout differs from the rollout's (any TP or EP > 1 against a single-rank
engine, or Megatron's vocab-parallel embedding against the rollout's replicated one), every rank of
the trainer's model-parallel groups calls `gather_megatron_state` with its own `GPTModel`
`state_dict()` and gets the full, rollout-named tensors back, ready for `update_weights`. Tensors
stay on their device: each group's tensors are flattened into buckets of at most `bucket_bytes`
(one dtype each) and gathered with one collective per bucket, `all_gather_into_tensor` on NCCL
and `all_gather` into views of one buffer on gloo (CPU). TP slices are joined along Megatron's split
dimension (`megatron_layout.join_tp`); EP rank r's local expert K becomes global expert
`r * E_local + K`; replicated tensors are not sent. Nothing is pickled or moved through the host.

Every rank receives the whole model (the rollout's `update_weights` takes full tensors and keeps its
own slices). Left out: ETP > 1 and PP > 1 (refused by `megatron_config`), and gathering straight
into the rollout's slices (a rank would receive only what it serves).
"""
from __future__ import annotations

import re
import time
import zlib
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from megatron_rollout.model.config import ModelConfig
from megatron_rollout.model.sharding import full_shapes
from megatron_rollout.weights.megatron_layout import join_tp, tp_split_dim
from megatron_rollout.weights.megatron_names import rollout_key

DEFAULT_BUCKET_BYTES = 256 << 20
"""Bytes one rank sends per collective: large enough that NCCL runs near bandwidth, small enough
that the gathered bucket (group size times this) stays a small part of device memory."""

_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


class ReshardStats(NamedTuple):
    """What one `gather_megatron_state` call moved."""

    bytes_gathered: int
    """Bytes of the gathered buffers on this rank (every rank's buckets, its own included)."""
    buckets: int
    """Collectives issued (one per bucket per group)."""
    seconds: float
    """Wall time of the whole gather, device synchronised at the end."""

    @property
    def gb_per_s(self) -> float:
        return self.bytes_gathered / self.seconds / 1e9 if self.seconds > 0 else float("inf")


class GatheredState(NamedTuple):
    tensors: dict[str, torch.Tensor]
    """Full rollout name -> full tensor, in `full_shapes` order."""
    stats: ReshardStats


def _buckets(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of one dtype and device, each at most `bucket_bytes` (a larger tensor alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        kind_changes = bool(bucket) and (t.dtype, t.device) != (bucket[0][1].dtype, bucket[0][1].device)
        if bucket and (size + nbytes > bucket_bytes or kind_changes):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def _gather_flat(flat: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every group rank's `flat` ([n]), in group-rank order, gathered into one [size * n] buffer."""
    size = dist.get_world_size(group)
    out = flat.new_empty(size * flat.numel())
    if dist.get_backend(group) == "nccl":
        dist.all_gather_into_tensor(out, flat, group=group)
    else:  # gloo has no all_gather_into_tensor; all_gather writes into views of the one buffer
        dist.all_gather(list(out.chunk(size)), flat, group=group)
    return list(out.chunk(size))


def _gather_group(named: list[tuple[str, torch.Tensor]], group: Any, bucket_bytes: int
                  ) -> tuple[dict[str, list[torch.Tensor]], int, int]:
    """name -> [group rank r's tensor]; every rank passes the same names and shapes in the same order.
    Returns the parts, the bytes gathered and the buckets sent."""
    if not named:
        return {}, 0, 0
    if group is None or dist.get_world_size(group) == 1:
        return {n: [t] for n, t in named}, 0, 0
    parts: dict[str, list[torch.Tensor]] = {}
    nbytes = buckets = 0
    for bucket in _buckets(named, bucket_bytes):
        flat = torch.cat([t.detach().reshape(-1) for _, t in bucket])  # [n]
        gathered = _gather_flat(flat, group)
        nbytes += sum(g.numel() for g in gathered) * flat.element_size()
        buckets += 1
        for g in gathered:
            offset = 0
            for name, t in bucket:
                parts.setdefault(name, []).append(g[offset:offset + t.numel()].view(t.shape))
                offset += t.numel()
    return parts, nbytes, buckets


def _check_same_layout(named: list[tuple[str, torch.Tensor]], group: Any, what: str) -> None:
    """Every rank of `group` holds the same names and shapes (else the flat buckets would not line up)."""
    if group is None or dist.get_world_size(group) == 1:
        return
    mine = zlib.crc32(repr([(n, tuple(t.shape), str(t.dtype)) for n, t in named]).encode())  # same on every host
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    probe = torch.tensor([mine, -mine], dtype=torch.int64, device=device)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=group)
    if int(probe[0]) != mine or int(probe[1]) != -mine:
        raise ValueError(f"the ranks of the {what} group hold different {what} tensors (names, shapes or dtypes): "
                         "every rank must pass its whole GPTModel state_dict(), built from one config")


def gather_megatron_state(local_state: Mapping[str, Any], cfg: ModelConfig, tp_group: Any = None,
                          ep_group: Any = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> GatheredState:
    """Full rollout-named tensors from this rank's Megatron `state_dict()` (local or TE spec, its TP
    slices and its EP-local experts). Collective: every rank of `tp_group` and `ep_group` (e.g.
    `parallel_state.get_tensor_model_parallel_group()` and `get_expert_model_parallel_group()`;
    None = a group of one) calls it. Raises ValueError when the gathered state does not cover `cfg`."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    start = time.perf_counter()
    experts: list[tuple[str, torch.Tensor]] = []
    split: list[tuple[str, torch.Tensor]] = []
    out: dict[str, torch.Tensor] = {}
    for name, value in local_state.items():
        key = rollout_key(name)
        if key is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name!r}: expected a tensor, got {type(value).__name__}")
        if _EXPERT.match(key):
            experts.append((key, value))
        elif tp_split_dim(key) is not None:
            split.append((key, value))
        else:
            out[key] = value.detach()
    _check_same_layout(split, tp_group, "tensor-parallel")
    _check_same_layout(experts, ep_group, "expert-parallel")
    tp_parts, tp_bytes, tp_buckets = _gather_group(split, tp_group, bucket_bytes)
    for name, parts in tp_parts.items():
        out[name] = join_tp(name, parts)
    ep_parts, ep_bytes, ep_buckets = _gather_group(experts, ep_group, bucket_bytes)
    per_rank = cfg.num_moe_experts // max(1, dist.get_world_size(ep_group) if ep_group is not None else 1)
    for name, parts in ep_parts.items():
        m = _EXPERT.match(name)
        for rank, t in enumerate(parts):
            out[f"{m.group(1)}{rank * per_rank + int(m.group(2))}{m.group(3)}"] = t
    want = full_shapes(cfg)
    missing = [n for n in want if n not in out]
    wrong = [(n, tuple(out[n].shape), s) for n, s in want.items() if n in out and tuple(out[n].shape) != s]
    extra = sorted(set(out) - set(want))
    if missing or wrong or extra:
        raise ValueError(f"the gathered Megatron state does not match the rollout model: {len(missing)} tensors "
                         f"missing (e.g. {missing[:2]}), {len(extra)} unexpected (e.g. {extra[:2]}), wrong full "
                         f"shapes (name, got, want) {wrong[:2]}; pass the TP and EP groups the GPTModel was built on")
    if any(t.is_cuda for _, t in split + experts):
        torch.cuda.synchronize()
    stats = ReshardStats(tp_bytes + ep_bytes, tp_buckets + ep_buckets, time.perf_counter() - start)
    return GatheredState({n: out[n] for n in want}, stats)


def megatron_local_state(full: Mapping[str, torch.Tensor], cfg: ModelConfig, tp_rank: int, tp_size: int,
                         ep_rank: int, ep_size: int) -> dict[str, torch.Tensor]:
    """The local-spec state a Megatron rank at (TP rank, EP rank) holds of the full rollout-named
    tensors (ETP = 1): the inverse of `gather_megatron_state`, for tests and benchmarks."""
    per_rank = cfg.num_moe_experts // ep_size if cfg.num_moe_experts else 0
    out: dict[str, torch.Tensor] = {}
    for name, t in full.items():
        m = _EXPERT.match(name)
        if m:
            expert = int(m.group(2))
            if expert // per_rank == ep_rank:
                out[f"{m.group(1)}{expert % per_rank}{m.group(3)}"] = t.clone()
            continue
        dim = tp_split_dim(name)
        if dim is None or tp_size == 1:
            out[name] = t.clone()
        elif name.endswith("linear_fc1.weight"):  # SwiGLU: rank r holds [gate_r; up_r]
            gate, up = t.chunk(2, dim=0)
            out[name] = torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]])
        else:
            out[name] = t.chunk(tp_size, dim=dim)[tp_rank].clone()
    return out
