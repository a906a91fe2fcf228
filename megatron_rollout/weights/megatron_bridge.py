"""The native model built from an in-process Megatron-core `GPTModel`: shared storage or a copy.

`native_from_megatron` reads the architecture from the GPTModel (`megatron_config.model_config_of`)
and gives the native model the trainer's weights in one of two ways:
- shared storage (where the layouts match: TP = EP = 1 against this single-rank native model): every
  native parameter is a new `Parameter` over the trainer's own tensor, found by name
  (`megatron_names`, local or TE spec), in the trainer's dtype: a bf16 GPTModel keeps its norm weights
  in fp32 (torch's RMSNorm under the local spec), which the native model's ops read as they are
  (`ModelOps.rmsnorm`), and DeepSeek's router bias is fp32 on both sides. The routed experts are first
  moved into one stack per projection that trainer and rollout both view (`megatron_experts`: what the
  CUDA runner's grouped kernels read). No second copy exists; an optimizer step that updates the
  trainer's parameters in place (every torch and Megatron optimizer does) is what the rollout serves
  next, decode graphs included, with no `update_weights` call, at unchanged addresses;
- a copy: the trainer's tensors, gathered over its TP and EP groups where it is sharded
  (`megatron_reshard`, a collective: every trainer rank calls it), copied into the native model's own
  parameters; later versions arrive through `update_weights`.
`sharing_obstacle` says why a trainer cannot be shared (another dtype, experts inside a shared
buffer); `share_storage=None` then copies, `True` refuses with that reason.
Left out: a sharded native model (ATP, EP > 1) sharing a sharded trainer's storage (Megatron splits the
vocabulary and the shared expert, the rollout replicates them), and FP8 parameters.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_rollout.model.config import ModelConfig
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.weights.megatron_config import model_config_of
from megatron_rollout.weights.megatron_experts import share_expert_stacks, stack_obstacle
from megatron_rollout.weights.megatron_names import megatron_state_to_rollout

log = logging.getLogger(__name__)


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


def _trainer_tensors(gpt: nn.Module, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rollout name -> the trainer's own tensor (its `Parameter`, no copy), in `full_shapes` order."""
    return megatron_state_to_rollout(gpt.state_dict(keep_vars=True), cfg).tensors


def _shareable_dtypes(name: str, cfg: ModelConfig) -> tuple[torch.dtype, ...]:
    if name.endswith("router.expert_bias"):
        return (torch.float32,)  # Megatron keeps it fp32 whatever the model's dtype
    if name.endswith("layernorm.weight"):
        return (cfg.torch_dtype, torch.float32)  # a bf16 GPTModel's torch RMSNorm weights are fp32
    return (cfg.torch_dtype,)


def sharing_obstacle(gpt: nn.Module, cfg: ModelConfig | None = None) -> str | None:
    """Why the native single-rank model cannot use `gpt`'s storage as it is, or None (it can)."""
    if not layouts_match(gpt):
        tp, ep = trainer_layout(gpt)
        return (f"the trainer is sharded at TP={tp}, EP={ep} and the rollout model here is one rank holding whole "
                "tensors (and Megatron splits the vocabulary)")
    cfg = cfg or model_config_of(gpt)
    tensors = _trainer_tensors(gpt, cfg)
    wrong = [f"{n} ({t.dtype})" for n, t in tensors.items() if t.dtype not in _shareable_dtypes(n, cfg)]
    if wrong:
        return (f"{len(wrong)} trainer tensors are not {cfg.torch_dtype} (norm weights may be float32), e.g. "
                f"{wrong[0]}")
    return stack_obstacle(tensors)


def native_from_megatron(gpt: nn.Module, share_storage: bool | None = None, tp_group: Any = None,
                         ep_group: Any = None) -> MoETransformer:
    """The native model of `gpt`'s architecture holding `gpt`'s weights (see the module docstring).
    `share_storage`: None shares where `sharing_obstacle` finds nothing and copies otherwise; True
    refuses (ValueError, with the reason) where it finds something. `tp_group`, `ep_group`: the
    trainer's groups for the copy of a sharded model (default: the GPTModel's own, `trainer_groups`)."""
    cfg = model_config_of(gpt)
    if share_storage is not False:
        why = sharing_obstacle(gpt, cfg)
        if why is not None and share_storage:
            raise ValueError(f"cannot share storage: {why}; pass share_storage=False to copy (gather, cast) them")
        if why is not None:
            log.info("the rollout copies the trainer's weights: %s", why)
        share_storage = why is None
    if share_storage:
        stacks = share_expert_stacks(_trainer_tensors(gpt, cfg))  # moves the trainer's experts: read them after
        model = MoETransformer(cfg, device="meta")
        for name, t in _trainer_tensors(gpt, cfg).items():
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner).register_parameter(leaf, nn.Parameter(t.detach(), requires_grad=False))
        for module, (fc1, fc2) in stacks.items():
            model.get_submodule(module).adopt(fc1, fc2)
        return model
    device = next(gpt.parameters()).device
    if layouts_match(gpt):
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
    """Whether every native parameter lies at the address of the trainer tensor of its name (never
    for a sharded trainer, whose local tensors have other shapes)."""
    if not layouts_match(gpt):
        return False
    theirs = megatron_state_to_rollout(gpt.state_dict(keep_vars=True), model.cfg).tensors
    return all(p.data_ptr() == theirs[n].data_ptr() for n, p in model.named_parameters())
