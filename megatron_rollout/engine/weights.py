"""Weight hot-swap: versions, validation, copy into persistent buffers, zero-copy bind.

Tensors arrive under full Megatron names (`sharding.full_shapes`); each rank keeps its slice, so a
trainer whose TP/EP layout differs from the rollout's ATP/EP hands over full tensors and this
store reshards them; `gather_full_state` builds those from a sharded trainer's local state. A version may arrive in several chunks (`final=False` until the last);
until the last chunk lands the version is half-applied and the engine refuses to step.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from megatron_rollout.comm.facade import Shard
from megatron_rollout.model.config import ModelConfig
from megatron_rollout.model.sharding import full_name, full_shapes, local_name, shard_tensor, unshard_tensor
from megatron_rollout.model.transformer import MoETransformer


class WeightVersionError(RuntimeError):
    """A stale, out-of-order or half-applied weight version."""


class WeightStore:
    def __init__(self, model: MoETransformer) -> None:
        self.model = model
        self.version = 0
        self._pending: int | None = None
        self._received: set[str] = set()
        self._shapes = full_shapes(model.cfg)

    def check_ready(self) -> None:
        if self._pending is not None:
            missing = len(self._shapes) - len(self._received)
            raise WeightVersionError(f"weight version {self._pending} is half-applied ({missing} tensors missing); "
                                     f"finish it with update_weights(..., final=True) before stepping")

    def update(self, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int,
               final: bool = True) -> None:
        items = list(named.items() if isinstance(named, Mapping) else named)
        if version <= self.version:
            raise WeightVersionError(f"weight version {version} is stale: the engine is at {self.version}")
        if self._pending is not None and version != self._pending:
            raise WeightVersionError(f"version {self._pending} is half-applied; got a chunk of version {version}")
        cfg, shard = self.model.cfg, self.model.comm.shard
        staged = []
        for name, tensor in items:  # validate everything before touching a parameter
            if name not in self._shapes:
                raise KeyError(f"unknown weight {name!r} (expected Megatron names, e.g. {next(iter(self._shapes))!r})")
            if tuple(tensor.shape) != self._shapes[name]:
                raise ValueError(f"weight {name}: shape {tuple(tensor.shape)}, expected {self._shapes[name]}")
            local = local_name(name, cfg, shard)
            if local is not None:
                staged.append((self.model.get_parameter(local), shard_tensor(name, tensor, cfg, shard)))
        self._pending = version
        with torch.no_grad():
            for param, value in staged:
                param.copy_(value)
        self._received.update(name for name, _ in items)
        if final:
            missing = sorted(set(self._shapes) - self._received)
            if missing:
                raise WeightVersionError(f"final chunk of version {version} leaves {len(missing)} tensors "
                                         f"unset, e.g. {missing[0]}; the version stays half-applied")
            self.version, self._pending, self._received = version, None, set()

    def bind(self, params: Mapping[str, torch.Tensor], version: int) -> None:
        """Zero-copy: point the engine's parameters at a colocated trainer's tensors (same local
        names, shapes, dtypes and devices), for an eager engine; captured graphs need `update`."""
        if version <= self.version:
            raise WeightVersionError(f"weight version {version} is stale: the engine is at {self.version}")
        own = dict(self.model.named_parameters())
        if set(params) != set(own):
            raise KeyError(f"bind needs exactly the engine's parameters; differ: {sorted(set(params) ^ set(own))[:3]}")
        for name, t in params.items():
            p = own[name]
            if t.shape != p.shape or t.dtype != p.dtype or t.device != p.device:
                raise ValueError(f"cannot bind {name}: {tuple(t.shape)}/{t.dtype}/{t.device} vs "
                                 f"{tuple(p.shape)}/{p.dtype}/{p.device}; use update() to copy")
        for name, t in params.items():
            own[name].data = t.detach()
        self.version = version


def gather_full_state(local_state: Mapping[str, torch.Tensor], cfg: ModelConfig, shard: Shard,
                      all_gather_object: Callable[[object], list]) -> dict[str, torch.Tensor]:
    """Full tensors from a sharded trainer: every rank passes its local (Megatron-named, TP-sliced,
    locally numbered experts) state and its `Shard`; `all_gather_object` gathers a Python object
    over ranks that together hold the whole model (e.g. `DistComm.all_gather_object` or
    `torch.distributed.all_gather_object` over the model-parallel group). Portable and simple,
    it moves tensors through the CPU; a trainer that already holds full tensors skips it."""
    mine = {full_name(n, cfg, shard): (shard.atp_rank, t.detach().cpu()) for n, t in local_state.items()}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for entry in all_gather_object(mine):
        for name, (rank, tensor) in entry.items():
            parts.setdefault(name, {}).setdefault(rank, tensor)
    missing = sorted(set(full_shapes(cfg)) - set(parts))
    if missing:
        raise KeyError(f"no rank holds {missing[0]} ({len(missing)} tensors missing): gather over every "
                       f"model-parallel rank")
    return {name: unshard_tensor(name, [parts[name][r] for r in sorted(parts[name])], cfg) for name in full_shapes(cfg)}
