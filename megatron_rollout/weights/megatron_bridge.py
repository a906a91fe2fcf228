"""The native model built from an in-process Megatron-core `GPTModel`: shared storage or a copy.

`native_from_megatron` reads the architecture from the GPTModel (`megatron_config.model_config_of`)
and gives the native model the trainer's weights in one of two ways:
- shared storage (where the layouts match: TP = EP = 1 against this single-rank native model, the
  same dtype): every native parameter is a new `Parameter` over the trainer's own tensor, found by
  name (`megatron_names`, local or TE spec). No second copy exists; an optimizer step that updates
  the trainer's parameters in place (every torch and Megatron optimizer does) is what the rollout
  serves next, with no `update_weights` call, at unchanged addresses;
- a copy: the trainer's tensors, gathered over its TP and EP groups where it is sharded
  (`megatron_reshard`, a collective: every trainer rank calls it), copied into the native model's own
  parameters; later versions arrive through `update_weights`.
Left out: a sharded native model (ATP, EP > 1) sharing a sharded trainer's storage (Megatron splits the
vocabulary and the shared expert, the rollout replicates them), and FP8 parameters.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_rollout.model.config import ModelConfig
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.weights.megatron_config import model_config_of
from megatron_rollout.weights.megatron_names import megatron_state_to_rollout


def trainer_groups(gpt: Any) -> tuple[Any, Any]:
    """The TP and EP process groups the GPTModel's weights are sharded over: its `pg_collection`
    (megatron-core 0.16 and 0.19 keep one on every model); None where it has none (one rank)."""
    pg = getattr(gpt, "pg_collection", None)
    return getattr(pg, "tp", None), getattr(pg, "ep", None)


def trainer_layout(gpt: Any) -> tuple[int, int]:
    """(TP, EP) the GPTModel is sharded over: its groups' sizes, or its config's where larger."""
    tc = gpt.config
    tp_group, ep_group = trainer_groups(gpt)
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    ep = dist.get_world_size(ep_group) if ep_group is not None else 1
    return max(tp, tc.tensor_model_parallel_size or 1), max(ep, tc.expert_model_parallel_size or 1)


def layouts_match(gpt: Any) -> bool:
    """Whether the native single-rank model can alias the trainer's tensors (TP = EP = 1)."""
    return trainer_layout(gpt) == (1, 1)


def _megatron_tensors(gpt: nn.Module, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rollout name -> the trainer's own tensor (no copy), checked against `cfg`'s shapes and dtype."""
    tensors = megatron_state_to_rollout(gpt.state_dict(keep_vars=True), cfg).tensors
    wrong = [f"{n} ({t.dtype})" for n, t in tensors.items()
             if t.dtype != (torch.float32 if n.endswith("router.expert_bias") else cfg.torch_dtype)]
    if wrong:
        raise ValueError(f"cannot share storage: {len(wrong)} trainer tensors are not {cfg.torch_dtype}, e.g. "
                         f"{wrong[0]}; pass share_storage=False to copy (and cast) them")
    return tensors


def native_from_megatron(gpt: nn.Module, share_storage: bool | None = None, tp_group: Any = None,
                         ep_group: Any = None) -> MoETransformer:
    """The native model of `gpt`'s architecture holding `gpt`'s weights (see the module docstring).
    `share_storage`: None shares where the layouts match and copies otherwise; True refuses (ValueError)
    where they do not. `tp_group`, `ep_group`: the trainer's groups for the copy of a sharded model
    (default: the GPTModel's own, `trainer_groups`)."""
    cfg = model_config_of(gpt)
    match = layouts_match(gpt)
    if share_storage and not match:
        tp, ep = trainer_layout(gpt)
        raise ValueError(f"cannot share storage with a trainer at TP={tp}, EP={ep}: the rollout model here is one "
                         "rank holding whole tensors (and Megatron splits the vocabulary); pass "
                         "share_storage=False to gather and copy them")
    if share_storage is None:
        share_storage = match
    device = next(gpt.parameters()).device
    if share_storage:
        tensors = _megatron_tensors(gpt, cfg)
        model = MoETransformer(cfg, device="meta")
        for name, t in tensors.items():
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner).register_parameter(leaf, nn.Parameter(t.detach(), requires_grad=False))
        return model
    if match:
        tensors = megatron_state_to_rollout(gpt.state_dict(), cfg).tensors
    else:
        from megatron_rollout.weights.megatron_reshard import gather_megatron_state

        own_tp, own_ep = trainer_groups(gpt)
        tensors = gather_megatron_state(gpt.state_dict(), cfg, tp_group or own_tp, ep_group or own_ep).tensors
    model = MoETransformer(cfg, device=device).requires_grad_(False)
    with torch.no_grad():
        for name, t in tensors.items():
            model.get_parameter(name).copy_(t)
    return model


def shares_storage(model: nn.Module, gpt: nn.Module) -> bool:
    """Whether every native parameter lies at the address of the trainer tensor of its name."""
    theirs = megatron_state_to_rollout(gpt.state_dict(keep_vars=True), model.cfg).tensors
    return all(p.data_ptr() == theirs[n].data_ptr() for n, p in model.named_parameters())
