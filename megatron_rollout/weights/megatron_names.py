"""Megatron-core `GPTModel` state-dict names -> the rollout's names, for both layer specs.

The rollout keeps the local layer spec's names (`sharding.full_shapes`), so a local-spec state
maps by identity. The Transformer Engine spec names three tensors differently, as read from
megatron-core 0.16.1 and 0.19.2 (`models/gpt/gpt_layer_specs.py`,
`extensions/transformer_engine_spec_provider.py`) and TE 2.20.2 (`pytorch/module/layernorm_linear.py`,
`grouped_linear.py`):

| TE spec                                          | rollout                                        |
| ------------------------------------------------ | ---------------------------------------------- |
| `L.self_attention.linear_qkv.layer_norm_weight`  | `L.input_layernorm.weight` (fused into QKV)    |
| `L.mlp.linear_fc1.layer_norm_weight` (dense)     | `L.pre_mlp_layernorm.weight` (fused into fc1)  |
| `L.mlp.experts.linear_fc{1,2}.weightK` (grouped) | `L.mlp.experts.local_experts.K.linear_fc{1,2}.weight` |
| `*._extra_state` (both specs)                    | nothing: TE's FP8 metadata, or None            |

`rollout_key` is the lenient form the engine's `update_weights` applies to every incoming name
(renames and drops, leaves anything else to the store's own unknown-name error);
`megatron_state_to_rollout` is the strict form: it refuses any name outside the table with what to
change, and a state that leaves a rollout tensor unset. Left out: multi-latent attention, MTP,
TE's op fuser (`use_te_op_fuser`) and the single grouped expert weight (`moe_single_grouped_weight`):
refused by name.
"""
from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch

from megatron_rollout.model.config import ModelConfig
from megatron_rollout.model.sharding import full_shapes

_LAYER = r"(?P<layer>decoder\.layers\.\d+\.)"
_RENAMES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(rf"^{_LAYER}self_attention\.linear_qkv\.layer_norm_weight$"), r"\g<layer>input_layernorm.weight"),
    (re.compile(rf"^{_LAYER}mlp\.linear_fc1\.layer_norm_weight$"), r"\g<layer>pre_mlp_layernorm.weight"),
    (re.compile(rf"^{_LAYER}mlp\.experts\.linear_fc(?P<fc>[12])\.weight(?P<k>\d+)$"),
     r"\g<layer>mlp.experts.local_experts.\g<k>.linear_fc\g<fc>.weight"),
)
_SAME = re.compile(
    r"^(embedding\.word_embeddings\.weight|output_layer\.weight|decoder\.final_layernorm\.weight|"
    rf"{_LAYER}(input_layernorm\.weight|self_attention\.(linear_qkv|linear_proj|q_layernorm|k_layernorm)\.weight"
    r"|pre_mlp_layernorm\.weight"
    r"|mlp\.(linear_fc[12]|router|shared_experts\.linear_fc[12]|experts\.local_experts\.\d+\.linear_fc[12])\.weight"
    r"|mlp\.router\.expert_bias))$")
_EXTRA_STATE = re.compile(r"(^|\.)_extra_state\d*$")
_HINTS: tuple[tuple[str, str], ...] = (  # (fnmatch pattern, what to change), most specific first
    ("*layer_norm_bias", "LayerNorm biases: build with normalization='RMSNorm'"),
    ("*.bias*", "linear biases: build with add_bias_linear=False, add_qkv_bias=False"),
    ("*router.qb_beta", "quantile-balancing router bias: use moe_router_load_balancing_type='none'"),
    ("*shared_experts.gate_weight", "a gated shared expert: build with moe_shared_expert_gate=False"),
    ("*mlp.experts.linear_fc?.weight", "one grouped expert weight: build with moe_single_grouped_weight=False"),
    ("*mlp.[0-9]*", "TE's fused-op MLP: build the spec with use_te_op_fuser=False"),
    ("*position_embeddings*", "learned positions: build with position_embedding_type='rope'"),
)
KNOWN_RENAMES = ("linear_qkv.layer_norm_weight -> input_layernorm.weight, mlp.linear_fc1.layer_norm_weight -> "
                 "pre_mlp_layernorm.weight, mlp.experts.linear_fc{1,2}.weightK -> "
                 "mlp.experts.local_experts.K.linear_fc{1,2}.weight")


def is_extra_state(name: str) -> bool:
    """Megatron's `*._extra_state` entries: None under the local spec, TE's FP8 metadata otherwise."""
    return bool(_EXTRA_STATE.search(name))


def rollout_key(name: str) -> str | None:
    """The rollout's name for a Megatron state-dict key of either spec; None for `_extra_state`.
    A name outside the TE table comes back unchanged (the caller decides whether it is known)."""
    if is_extra_state(name):
        return None
    for pattern, repl in _RENAMES:
        if pattern.match(name):
            return pattern.sub(repl, name)
    return name


def rollout_name(name: str) -> str | None:
    """`rollout_key`, strict: raises ValueError, naming what to change, for a name neither spec has."""
    target = rollout_key(name)
    if target is None or target != name or _SAME.match(name):
        return target
    hint = next((why for pat, why in _HINTS if fnmatch.fnmatchcase(name, pat)), None)
    raise ValueError(f"Megatron tensor {name!r} has no counterpart in the rollout model"
                     + (f" ({hint})" if hint else "") + f"; known renames: {KNOWN_RENAMES}")


def rollout_pairs(pairs: Iterable[Any]) -> list[Any]:
    """(name, tensor) pairs under the rollout's names, `_extra_state` dropped; anything that is not
    a (str, value) pair passes through untouched for the caller's own type errors."""
    out = []
    for pair in pairs:
        if isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str):
            key = rollout_key(pair[0])
            if key is None:
                continue
            pair = (key, pair[1])
        out.append(pair)
    return out


class MappedState(NamedTuple):
    """A Megatron state dict under the rollout's names."""

    tensors: dict[str, torch.Tensor]
    """Rollout name -> tensor (the trainer's own tensors, not copies), in `full_shapes` order."""
    renamed: int
    """Entries whose name changed (TE's fused norms and grouped experts)."""
    skipped: int
    """`_extra_state` entries left out."""


def megatron_state_to_rollout(state: Mapping[str, Any], cfg: ModelConfig) -> MappedState:
    """Rename a single-rank `GPTModel.state_dict()` (local or TE spec) to the rollout's names for
    `cfg`. Raises ValueError for an unknown name, two entries landing on one name, or a rollout
    tensor that no entry fills."""
    out: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}
    renamed = skipped = 0
    for name, value in state.items():
        target = rollout_name(name)
        if target is None:
            skipped += 1
            continue
        if target in source:
            raise ValueError(f"{name!r} and {source[target]!r} both map to rollout tensor {target!r}: "
                             "the state mixes the TE and the local layer spec")
        source[target] = name
        out[target] = value
        renamed += target != name
    want = full_shapes(cfg)
    missing, extra = [n for n in want if n not in out], sorted(set(out) - set(want))
    if missing or extra:
        raise ValueError(f"the Megatron state does not cover the rollout model exactly: {len(missing)} rollout "
                         f"tensors unset (e.g. {missing[:2]}), {len(extra)} not in this ModelConfig "
                         f"(e.g. {[source[n] for n in extra[:2]]}); build the GPTModel from the same config")
    return MappedState({n: out[n] for n in want}, renamed, skipped)
