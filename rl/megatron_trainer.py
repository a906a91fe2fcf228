"""Training a Megatron-core `GPTModel` in the colocated loop, and the model built to match ours.

The native inference model uses Megatron's parameter names and shapes (docs/design.md §4), so a
`GPTModel` built from the same `ModelConfig` maps onto it name for name: identically under the
local layer spec, through `megatron_names`' three renames under the Transformer Engine spec.
`MegatronTrainer.named_weights()` feeds `engine.update_weights` under the rollout's names; the
constructor checks the mapping and fails with the differing names.

A GPTModel builds on CPU with the local spec (CPU init, no bias, no sequence parallelism, the
allgather token dispatcher, no grouped GEMM) but its forward needs CUDA, so the training step runs
on GPU only; the Transformer Engine spec builds on GPU only.

The optimizer is a torch optimizer over the parameters, or Megatron's own
(`megatron.core.optimizer.get_megatron_optimizer` over the model wrapped in Megatron's
`DistributedDataParallel`): gradients then accumulate in the wrapper's buffers, and clipping and
the fp32 main weights of a bf16 model live inside the optimizer's step, which writes the model's
parameters in place (their addresses, which a rollout engine sharing them reads, do not move).

A trainer sharded over TP and EP (ETP = 1, local spec) holds slices under local names:
`megatron_full_state` gathers them to full tensors (local expert K on EP rank e -> global expert
e * per_rank + K; the TP-split QKV, attention projection, dense and shared-expert fc1/fc2, embedding
and output layer concatenated along Megatron's split dimension, SwiGLU fc1 as [gate; up] halves),
and `engine.update_weights` then reshards them into the rollout's own ATP/EP layout. Left out:
pipeline parallelism, expert tensor parallelism, Megatron's distributed optimizer, and the MoE
auxiliary losses (disabled in the config).
"""
from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from megatron_rollout.model.config import ModelConfig
from megatron_rollout.model.sharding import full_shapes
from megatron_rollout.weights.megatron_layout import join_tp, tp_split_dim, transformer_config  # noqa: F401 (re-exported)
from megatron_rollout.weights.megatron_names import megatron_state_to_rollout
from rl.trainer import PolicyTrainer

log = logging.getLogger(__name__)
SPECS = ("local", "te")


def _without_te_compat() -> None:
    """megatron-core 0.16.1's router reads `moe_utils.te_general_gemm`, a name bound only when
    Transformer Engine imports; without TE the MoE forward dies with a NameError. Binding it to
    None selects Megatron's own torch.mm path, which is what that check intends."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_gpt_model(cfg: ModelConfig, spec: str = "local", **overrides: Any) -> nn.Module:
    """A Megatron `GPTModel` matching `cfg` (call after `parallel_state.initialize_model_parallel`):
    the local layer spec on CPU, or the Transformer Engine spec ("te", on the current CUDA device)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if spec not in SPECS:
        raise ValueError(f"layer spec must be one of {SPECS}, got {spec!r}")
    _without_te_compat()
    if spec == "te":  # TE allocates on the GPU; its wgrad fusion needs a fused kernel we do not ask for
        overrides = dict(use_cpu_initialization=False, gradient_accumulation_fusion=False, **overrides)
        if cfg.num_moe_experts:
            overrides.setdefault("moe_router_dtype", "fp32")
    tcfg = transformer_config(cfg, **overrides)
    # The decoder block spec (not one layer spec) is what honours a mixed moe_layer_freq.
    layers = get_gpt_decoder_block_spec(tcfg, use_transformer_engine=spec == "te", normalization="RMSNorm")
    return GPTModel(tcfg, layers, vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
                    position_embedding_type="rope", rotary_base=int(cfg.rotary_base), rotary_percent=1.0,
                    share_embeddings_and_output_weights=cfg.tie_word_embeddings)


def unwrap(model: nn.Module) -> nn.Module:
    """The GPTModel inside Megatron's `DistributedDataParallel` (which keeps it as `.module`)."""
    from megatron.core.distributed import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def rollout_tensors(model: nn.Module, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rollout name -> the GPTModel's own parameter (no copy), either layer spec; raises ValueError
    naming the names and shapes that do not map 1:1 onto `cfg`'s native model."""
    try:
        tensors = megatron_state_to_rollout(unwrap(model).state_dict(keep_vars=True), cfg).tensors
    except ValueError as exc:
        raise ValueError(f"Megatron model does not map 1:1 onto the native names (missing or extra tensors): {exc}"
                         ) from None
    want = full_shapes(cfg)
    shape = [(n, tuple(t.shape), want[n]) for n, t in tensors.items() if tuple(t.shape) != want[n]]
    if shape:
        raise ValueError(f"Megatron model does not map 1:1 onto the native names: shape mismatch {shape[:3]} "
                         "(name, got, want)")
    return tensors


def check_names(model: nn.Module, cfg: ModelConfig) -> None:
    """Raise unless the model's parameters map 1:1 onto `full_shapes(cfg)` (names and shapes)."""
    rollout_tensors(model, cfg)


@torch.no_grad()
def load_weights(model: nn.Module, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                 cfg: ModelConfig | None = None) -> None:
    """Copy rollout-named tensors (e.g. a native model's `named_parameters()`) into `model`: by
    parameter name, or through the name map of either layer spec when `cfg` is given."""
    params = rollout_tensors(model, cfg) if cfg is not None else dict(model.named_parameters())
    for name, t in (named.items() if isinstance(named, Mapping) else named):
        if name not in params:
            raise KeyError(f"{name!r} is not a parameter of the target model")
        params[name].copy_(t)


_LOCAL_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def megatron_full_state(model: nn.Module, cfg: ModelConfig, group=None) -> dict[str, torch.Tensor]:
    """Full tensors under full names from a GPTModel sharded over TP/EP (every rank of `group`,
    default the world, calls it and gets all of them). Moves tensors through the CPU, once per
    hot swap: simple and portable; a GPU trainer would all-gather on the device instead."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp, ep = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    per_rank = cfg.num_moe_experts // ps.get_expert_model_parallel_world_size() if cfg.num_moe_experts else 0
    mine: dict[str, tuple[int, torch.Tensor]] = {}
    for name, p in model.named_parameters():
        m = _LOCAL_EXPERT.match(name)
        if m:
            name = f"{m.group(1)}{ep * per_rank + int(m.group(2))}{m.group(3)}"
        mine[name] = (tp, p.detach().cpu())
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for entry in gathered:
        for name, (rank, tensor) in entry.items():
            parts.setdefault(name, {}).setdefault(rank, tensor)
    want = full_shapes(cfg)
    missing = sorted(set(want) - set(parts))
    if missing:
        raise KeyError(f"no rank holds {missing[0]} ({len(missing)} tensors missing): call on every rank")
    full = {name: join_tp(name, [parts[name][r] for r in sorted(parts[name])]) for name in want}
    wrong = [(n, tuple(t.shape), want[n]) for n, t in full.items() if tuple(t.shape) != want[n]]
    if wrong:
        raise ValueError(f"gathered Megatron tensors have the wrong full shape, e.g. {wrong[0]} (name, got, want)")
    return full


class MegatronTrainer(PolicyTrainer):
    """`PolicyTrainer` over a Megatron `GPTModel` (any TP and EP, PP = ETP = 1; local or TE spec),
    bare or wrapped in Megatron's `DistributedDataParallel`, and a torch optimizer over its
    parameters or Megatron's optimizer over the wrapper (module docstring); the training step needs
    CUDA (tested with TP = EP = 1). `model_cfg` is the native config the engine runs. A GPTModel
    holds process groups and cannot be deep-copied, so the KL reference (when `kl_coef` > 0 and
    no `ref_model` is given) is a fresh `build_gpt_model(model_cfg, spec)` loaded with the policy's weights."""

    def __init__(self, model: nn.Module, optimizer: Any, loss_cfg, model_cfg: ModelConfig, spec: str = "local",
                 **kwargs: Any) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.optimizer import MegatronOptimizer

        self.gpt = unwrap(model)
        self.megatron_optimizer = isinstance(optimizer, MegatronOptimizer)
        if self.megatron_optimizer and self.gpt is model:
            raise ValueError("Megatron's optimizer reads the gradient buffers of Megatron's DistributedDataParallel: "
                             "wrap the GPTModel in it, or pass a torch optimizer")
        self.sharded = False
        if ps.model_parallel_is_initialized():
            sizes = (ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size(),
                     ps.get_pipeline_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size())
            if sizes[2:] != (1, 1):
                raise NotImplementedError(f"MegatronTrainer supports PP = ETP = 1, got (TP, EP, PP, ETP) = {sizes}")
            self.sharded = sizes[:2] != (1, 1)
        if not self.sharded:
            check_names(self.gpt, model_cfg)
        self.model_cfg = model_cfg
        if "process_group" not in kwargs and ps.model_parallel_is_initialized():
            kwargs["process_group"] = ps.get_data_parallel_group()
        if loss_cfg.kl_coef > 0 and kwargs.get("ref_model") is None:
            ref = build_gpt_model(model_cfg, spec).to(next(self.gpt.parameters()).device)
            ref.load_state_dict(self.gpt.state_dict())
            kwargs["ref_model"] = ref
        super().__init__(model, optimizer, loss_cfg, **kwargs)

    def logits(self, model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device).expand(b, t)
        return model(input_ids, positions, None)  # causal mask built by the attention; [B, T, V]

    def zero_grad(self) -> None:
        if not self.megatron_optimizer:
            return super().zero_grad()
        self.model.zero_grad_buffer()  # the wrapper's gradient buffers (param.main_grad)
        self.optimizer.zero_grad()

    def apply_grads(self) -> float | None:
        if not self.megatron_optimizer:
            return super().apply_grads()
        self.model.finish_grad_sync()  # the data-parallel all-reduce of the gradient buffers
        ok, norm, _ = self.optimizer.step()  # clips at OptimizerConfig.clip_grad, writes the params in place
        if not ok:
            log.warning("Megatron's optimizer skipped a step (gradients not finite)")
        return None if norm is None else float(norm)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Rollout names and tensors; sharded over TP/EP this is a collective (every rank calls it)."""
        if self.sharded:
            yield from megatron_full_state(self.gpt, self.model_cfg).items()
            return
        for name, t in rollout_tensors(self.gpt, self.model_cfg).items():
            yield name, t.detach()
