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
from torch import nn

from megatron_rollout.model.config import ModelConfig
from megatron_rollout.model.megatron_config import model_config_of
from megatron_rollout.model.megatron_names import megatron_state_to_rollout
from megatron_rollout.model.transformer import MoETransformer


def trainer_layout(gpt: Any) -> tuple[int, int]:
    """(TP, EP) the GPTModel is sharded over: its config's sizes, or `parallel_state`'s where those are
    larger (a TransformerConfig built by hand keeps the default 1 while parallel_state shards)."""
    tc = gpt.config
    tp, ep = tc.tensor_model_parallel_size or 1, tc.expert_model_parallel_size or 1
    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        return tp, ep
    if ps.model_parallel_is_initialized():
        tp = max(tp, ps.get_tensor_model_parallel_world_size())
        ep = max(ep, ps.get_expert_model_parallel_world_size())
    return tp, ep


def layouts_match(gpt: Any) -> bool:
    """Whether the native single-rank model can alias the trainer's tensors (TP = EP = 1)."""
    return trainer_layout(gpt) == (1, 1)


def _megatron_tensors(gpt: nn.Module, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rollout name -> the trainer's own tensor (no copy), checked against `cfg`'s shapes and dtype."""
    tensors = megatron_state_to_rollout(gpt.state_dict(keep_vars=True), cfg).tensors
    wrong = [f"{n} ({t.dtype})" for n, t in tensors.items() if t.dtype != cfg.torch_dtype]
    if wrong:
        raise ValueError(f"cannot share storage: {len(wrong)} trainer tensors are not {cfg.torch_dtype}, e.g. "
                         f"{wrong[0]}; pass share_storage=False to copy (and cast) them")
    return tensors


def native_from_megatron(gpt: nn.Module, share_storage: bool | None = None, tp_group: Any = None,
                         ep_group: Any = None) -> MoETransformer:
    """The native model of `gpt`'s architecture holding `gpt`'s weights (see the module docstring).
    `share_storage`: None shares where the layouts match and copies otherwise; True refuses (ValueError)
    where they do not. `tp_group`, `ep_group`: the trainer's groups for the copy of a sharded model
    (default: Megatron's `parallel_state` groups)."""
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
        from megatron.core import parallel_state as ps

        from megatron_rollout.model.megatron_reshard import gather_megatron_state

        tp_group = tp_group or ps.get_tensor_model_parallel_group()
        ep_group = ep_group or ps.get_expert_model_parallel_group()
        tensors = gather_megatron_state(gpt.state_dict(), cfg, tp_group, ep_group).tensors
    model = MoETransformer(cfg, device=device).requires_grad_(False)
    with torch.no_grad():
        for name, t in tensors.items():
            model.get_parameter(name).copy_(t)
    return model


def shares_storage(model: nn.Module, gpt: nn.Module) -> bool:
    """Whether every native parameter lies at the address of the trainer tensor of its name."""
    theirs = megatron_state_to_rollout(gpt.state_dict(keep_vars=True), model.cfg).tensors
    return all(p.data_ptr() == theirs[n].data_ptr() for n, p in model.named_parameters())
