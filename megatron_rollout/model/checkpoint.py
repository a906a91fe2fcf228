"""Hugging Face checkpoints in and out of the native model's Megatron names (docs/design.md §4).

Users start from HF checkpoints; the rollout runs on Megatron names so that weight hot-swap is a
name-for-name copy. This module converts once, at load time: it reads config.json with
transformers' own config classes, plans which HF tensor(s) make each Megatron tensor, validates
the whole checkpoint against that plan *before* a model is built, then reads only what this
rank's shard holds (safetensors slices, so an EP rank reads its own experts only).

Both expert layouts are read: per-expert tensors (`experts.N.gate_proj`, Mixtral's
`block_sparse_moe.experts.N.w1`), which is what transformers 5 writes and loads, and the fused
`experts.gate_up_proj` / `experts.down_proj` of transformers 5's in-memory modules. Writing uses
the per-expert layout.

DeepSeek-V3 (`DeepseekV3ForCausalLM`: MLA, YaRN, biased group-limited routing, shared experts, MTP
layers) maps through `model.deepseek_checkpoint`, which this module calls at a few marked points.

Left out on purpose: biases, RoPE scaling outside DeepSeek-V3's YaRN, Qwen2-MoE-style gated shared
experts, quantised (FP8, int) checkpoints, and saving a sharded model (gather the full state first).
"""
from __future__ import annotations

import abc
import json
import logging
import os
import pickle
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_rollout.comm.facade import Comm, LocalComm, Shard
from megatron_rollout.model import deepseek_checkpoint as deepseek
from megatron_rollout.model.config import PRESETS, ModelConfig
from megatron_rollout.model.sharding import full_shapes, local_name, shard_tensor
from megatron_rollout.model.transformer import MoETransformer

log = logging.getLogger(__name__)

QWEN3_MOE, QWEN3, LLAMA, MISTRAL, MIXTRAL = (
    "Qwen3MoeForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM")
DEEPSEEK_V3 = deepseek.DEEPSEEK_V3
SUPPORTED_ARCHITECTURES = (QWEN3_MOE, QWEN3, LLAMA, MISTRAL, MIXTRAL, DEEPSEEK_V3)
_BY_MODEL_TYPE = {"qwen3_moe": QWEN3_MOE, "qwen3": QWEN3, "llama": LLAMA, "mistral": MISTRAL, "mixtral": MIXTRAL,
                  "deepseek_v3": DEEPSEEK_V3}
_QK_NORM = {QWEN3_MOE, QWEN3}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                       "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                       "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer some old checkpoints carry; recomputed here


# ---------------------------------------------------------------- config

def architecture_of(hf_config) -> str:
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs and getattr(hf_config, "model_type", None) in _BY_MODEL_TYPE:
        archs = [_BY_MODEL_TYPE[hf_config.model_type]]
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {archs or getattr(hf_config, 'model_type', None)!r}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return archs[0]


def _rope_theta(c) -> float:
    params = dict(getattr(c, "rope_parameters", None) or {})
    legacy = dict(getattr(c, "rope_scaling", None) or {})
    kind = params.get("rope_type") or params.get("type") or legacy.get("rope_type") or legacy.get("type") or "default"
    if kind != "default":
        raise ValueError(f"RoPE scaling type {kind!r} is not supported (only unscaled 'default' RoPE); "
                         "use a checkpoint without rope scaling")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={params['partial_rotary_factor']} is not supported (only 1.0)")
    theta = params.get("rope_theta", getattr(c, "rope_theta", None))
    if theta is None:
        raise ValueError("config.json gives no rope_theta (in rope_parameters or at top level)")
    return float(theta)


def _check_features(c, arch: str) -> None:
    if getattr(c, "hidden_act", "silu") != "silu":
        raise ValueError(f"{arch}: hidden_act {c.hidden_act!r} is not supported (only SwiGLU with 'silu')")
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(c, flag, False):
            raise ValueError(f"{arch}: {flag}=True is not supported (the native model has no biases)")


def config_from_hf(hf_config) -> ModelConfig:
    """A `ModelConfig` for a transformers config (or a checkpoint directory holding config.json)."""
    if isinstance(hf_config, (str, os.PathLike)):
        import transformers

        hf_config = transformers.AutoConfig.from_pretrained(hf_config)
    c, arch = hf_config, architecture_of(hf_config)
    if arch == DEEPSEEK_V3:
        return deepseek.deepseek_config_from_hf(c)
    _check_features(c, arch)
    heads, layers = c.num_attention_heads, c.num_hidden_layers
    max_pos = c.max_position_embeddings
    window = getattr(c, "sliding_window", None)  # Qwen3 configs set None unless use_sliding_window
    if window is not None and window < max_pos:
        # Sequences no longer than the window attend exactly as with full attention.
        log.info("%s: sliding_window %d < max_position_embeddings %d; capping the context at %d",
                 arch, window, max_pos, window)
        max_pos = window
    dtype = getattr(c, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, torch.float32)
    kw = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=layers, num_attention_heads=heads,
              num_query_groups=getattr(c, "num_key_value_heads", None) or heads,
              kv_channels=getattr(c, "head_dim", None) or c.hidden_size // heads,
              layernorm_epsilon=float(c.rms_norm_eps), rotary_base=_rope_theta(c), qk_layernorm=arch in _QK_NORM,
              tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)), max_position_embeddings=max_pos,
              dtype=_DTYPE_NAMES.get(dtype, "float32"))
    if arch == QWEN3_MOE:
        step = getattr(c, "decoder_sparse_step", 1)
        if type(step) is not int or step < 1:
            raise ValueError(f"{arch}: decoder_sparse_step must be an integer >= 1 (every step-th layer is MoE; 1: "
                             f"every layer), got {step!r}; fix config.json")
        moe = tuple(int(c.num_experts > 0 and i not in (c.mlp_only_layers or ())
                        and (i + 1) % c.decoder_sparse_step == 0) for i in range(layers))
        kw.update(num_moe_experts=c.num_experts if any(moe) else 0, moe_router_topk=c.num_experts_per_tok,
                  moe_ffn_hidden_size=c.moe_intermediate_size, moe_renormalize_topk=bool(c.norm_topk_prob),
                  moe_layer_freq=moe if 0 in moe and any(moe) else (),
                  ffn_hidden_size=c.intermediate_size if 0 in moe else 0)
    elif arch == MIXTRAL:
        kw.update(num_moe_experts=c.num_local_experts, moe_router_topk=c.num_experts_per_tok,
                  moe_ffn_hidden_size=c.intermediate_size, moe_renormalize_topk=True)
    else:
        kw.update(ffn_hidden_size=c.intermediate_size)
    return ModelConfig(**kw)


def hf_config_from(cfg: ModelConfig, arch: str):
    """The transformers config that describes `cfg` as an `arch` model (raises if it cannot)."""
    import transformers

    if arch == DEEPSEEK_V3:
        return deepseek.deepseek_hf_config(cfg)
    moe = [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]
    problems = []
    if arch not in SUPPORTED_ARCHITECTURES:
        problems.append(f"architecture {arch!r} is not one of {', '.join(SUPPORTED_ARCHITECTURES)}")
    if cfg.moe_shared_expert_intermediate_size:
        problems.append("moe_shared_expert_intermediate_size > 0 (no shared expert in these architectures)")
    if cfg.qk_layernorm != (arch in _QK_NORM):
        has = "has" if arch in _QK_NORM else "has no"
        problems.append(f"qk_layernorm={cfg.qk_layernorm}, but {arch} {has} qk norm")
    if arch == MIXTRAL and (not all(moe) or not cfg.moe_renormalize_topk):
        problems.append("Mixtral needs every layer MoE and moe_renormalize_topk=True")
    if arch in (QWEN3, LLAMA, MISTRAL) and any(moe):
        problems.append(f"{arch} is dense but layers {[i for i, m in enumerate(moe) if m]} are MoE")
    if problems:
        raise ValueError(f"cannot express this ModelConfig as {arch}: " + "; ".join(problems))
    kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
              num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_query_groups,
              head_dim=cfg.kv_channels, rms_norm_eps=cfg.layernorm_epsilon, hidden_act="silu",
              rope_parameters={"rope_type": "default", "rope_theta": cfg.rotary_base},
              tie_word_embeddings=cfg.tie_word_embeddings, max_position_embeddings=cfg.max_position_embeddings,
              architectures=[arch], dtype=cfg.dtype)
    if arch == QWEN3_MOE:
        kw.update(num_experts=cfg.num_moe_experts, num_experts_per_tok=cfg.moe_router_topk,
                  moe_intermediate_size=cfg.moe_ffn_hidden_size, norm_topk_prob=cfg.moe_renormalize_topk,
                  intermediate_size=cfg.ffn_hidden_size or cfg.moe_ffn_hidden_size, decoder_sparse_step=1,
                  mlp_only_layers=[i for i, m in enumerate(moe) if not m])
    elif arch == MIXTRAL:
        kw.update(num_local_experts=cfg.num_moe_experts, num_experts_per_tok=cfg.moe_router_topk,
                  intermediate_size=cfg.moe_ffn_hidden_size)
    else:
        kw.update(intermediate_size=cfg.ffn_hidden_size)
    if arch == MISTRAL:
        kw.update(sliding_window=None)
    model_type = {v: k for k, v in _BY_MODEL_TYPE.items()}[arch]
    return transformers.AutoConfig.for_model(model_type, **kw)


# ---------------------------------------------------------------- the plan: Megatron tensor <- HF tensors

@dataclass(frozen=True)
class _Part:
    name: str  # HF tensor name
    expert: int | None = None  # row of a fused [experts, ...] tensor, or None for the whole tensor


@dataclass(frozen=True)
class _Recipe:
    kind: str  # "copy" | "gate_up" (concatenate rows) | "qkv" (Megatron per-query-group interleave)
    parts: tuple[_Part, ...]


@dataclass(frozen=True)
class _Plan:
    recipes: dict[str, _Recipe]  # full Megatron name -> how to build it
    hf_shapes: dict[str, tuple[int, ...]]  # every HF tensor the plan reads, with its expected shape


def _moe_layout(arch: str, prefix: str, names: Collection[str] | None, fused: bool) -> tuple[str, bool]:
    """(module name of the MoE block, whether experts are fused) for one layer."""
    if names is not None:
        legacy = arch == MIXTRAL and not any(n.startswith(prefix + "mlp.") for n in names)
        block = "block_sparse_moe" if legacy else "mlp"
        return block, f"{prefix}{block}.experts.gate_up_proj" in names
    return ("mlp" if fused or arch != MIXTRAL else "block_sparse_moe"), fused


def _plan(cfg: ModelConfig, arch: str, names: Collection[str] | None = None, fused: bool = False) -> _Plan:
    """Map every full Megatron name to HF tensors. `names` (a checkpoint's) picks the expert layout
    per layer; without it the layout is per-expert, or fused if `fused`."""
    if cfg.moe_shared_expert_intermediate_size and arch != DEEPSEEK_V3:
        raise ValueError(f"{arch} has no shared expert; this config has one")
    h, e_ffn = cfg.hidden_size, cfg.moe_ffn_hidden_size
    recipes: dict[str, _Recipe] = {}
    shapes: dict[str, tuple[int, ...]] = {}

    def part(name: str, shape: tuple[int, ...], expert: int | None = None) -> _Part:
        shapes[name] = shape
        return _Part(name, expert)

    def put(megatron: str, kind: str, *parts: _Part) -> None:
        recipes[megatron] = _Recipe(kind, parts)

    put("embedding.word_embeddings.weight", "copy", part("model.embed_tokens.weight", (cfg.vocab_size, h)))
    for i, m, p in _layer_prefixes(cfg):
        put(m + "input_layernorm.weight", "copy", part(p + "input_layernorm.weight", (h,)))
        if cfg.multi_latent_attention:
            deepseek.mla_recipes(cfg, m, p, part, put)
        else:
            _gqa_recipes(cfg, m, p, part, put)
        put(m + "pre_mlp_layernorm.weight", "copy", part(p + "post_attention_layernorm.weight", (h,)))
        if not cfg.is_moe_layer(i):
            f = cfg.ffn_hidden_size
            put(m + "mlp.linear_fc1.weight", "gate_up", part(p + "mlp.gate_proj.weight", (f, h)),
                part(p + "mlp.up_proj.weight", (f, h)))
            put(m + "mlp.linear_fc2.weight", "copy", part(p + "mlp.down_proj.weight", (h, f)))
            continue
        block, is_fused = _moe_layout(arch, p, names, fused)
        b, n_exp = f"{p}{block}.", cfg.num_moe_experts
        put(m + "mlp.router.weight", "copy", part(b + "gate.weight", (n_exp, h)))
        if arch == DEEPSEEK_V3:
            deepseek.moe_extra_recipes(cfg, m, b, part, put)
        gate, up, down = ("w1", "w3", "w2") if block == "block_sparse_moe" else ("gate_proj", "up_proj", "down_proj")
        for e in range(n_exp):
            x = f"{m}mlp.experts.local_experts.{e}."
            if is_fused:  # transformers 5: gate_up_proj [E, 2F, H] with gate rows first, down_proj [E, H, F]
                put(x + "linear_fc1.weight", "copy", part(b + "experts.gate_up_proj", (n_exp, 2 * e_ffn, h), e))
                put(x + "linear_fc2.weight", "copy", part(b + "experts.down_proj", (n_exp, h, e_ffn), e))
            else:
                put(x + "linear_fc1.weight", "gate_up", part(f"{b}experts.{e}.{gate}.weight", (e_ffn, h)),
                    part(f"{b}experts.{e}.{up}.weight", (e_ffn, h)))
                put(x + "linear_fc2.weight", "copy", part(f"{b}experts.{e}.{down}.weight", (h, e_ffn)))
    put("decoder.final_layernorm.weight", "copy", part("model.norm.weight", (h,)))
    deepseek.mtp_recipes(cfg, part, put)
    if not cfg.tie_word_embeddings:
        put("output_layer.weight", "copy", part("lm_head.weight", (cfg.vocab_size, h)))
    return _Plan(recipes, shapes)


def _layer_prefixes(cfg: ModelConfig) -> list[tuple[int, str, str]]:
    """(layer, Megatron prefix, HF prefix) of every transformer layer, the MTP layers' last."""
    layers = [(i, f"decoder.layers.{i}.", f"model.layers.{i}.") for i in range(cfg.num_layers)]
    return layers + deepseek.mtp_layer_prefixes(cfg)


def _gqa_recipes(cfg: ModelConfig, m: str, p: str, part, put) -> None:
    """Grouped-query attention's tensors of layer prefix `m` (Megatron) / `p` (HF)."""
    h, d = cfg.hidden_size, cfg.kv_channels
    put(m + "self_attention.linear_qkv.weight", "qkv",
        part(p + "self_attn.q_proj.weight", (cfg.num_attention_heads * d, h)),
        part(p + "self_attn.k_proj.weight", (cfg.num_query_groups * d, h)),
        part(p + "self_attn.v_proj.weight", (cfg.num_query_groups * d, h)))
    put(m + "self_attention.linear_proj.weight", "copy",
        part(p + "self_attn.o_proj.weight", (h, cfg.num_attention_heads * d)))
    if cfg.qk_layernorm:
        put(m + "self_attention.q_layernorm.weight", "copy", part(p + "self_attn.q_norm.weight", (d,)))
        put(m + "self_attention.k_layernorm.weight", "copy", part(p + "self_attn.k_norm.weight", (d,)))


def _assemble(recipe: _Recipe, read: Callable[[_Part], torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    ts = [read(p) for p in recipe.parts]
    if recipe.kind == "copy":
        return ts[0]
    if recipe.kind == "gate_up":
        return torch.cat(ts)
    q, k, v = ts
    g, h = cfg.num_query_groups, cfg.hidden_size
    # [groups, (heads_per_group + 2) * head_dim, hidden]: each group's q heads, then its k, then its v
    return torch.cat([q.reshape(g, -1, h), k.reshape(g, -1, h), v.reshape(g, -1, h)], dim=1).reshape(-1, h)


def _split(recipe: _Recipe, t: torch.Tensor, cfg: ModelConfig) -> list[torch.Tensor]:
    if recipe.kind == "copy":
        return [t]
    if recipe.kind == "gate_up":
        return list(t.chunk(2))
    g, hpg, d, h = cfg.num_query_groups, cfg.heads_per_group, cfg.kv_channels, cfg.hidden_size
    qkv = t.reshape(g, hpg + 2, d, h)
    return [qkv[:, :hpg].reshape(-1, h), qkv[:, hpg].reshape(-1, h), qkv[:, hpg + 1].reshape(-1, h)]


# ---------------------------------------------------------------- reading checkpoints

class _Source(abc.ABC):
    """Named tensors whose shapes and dtypes are known before their data is read."""

    @abc.abstractmethod
    def names(self) -> set[str]: ...

    @abc.abstractmethod
    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype | str]: ...

    @abc.abstractmethod
    def read(self, part: _Part) -> torch.Tensor: ...


class _DictSource(_Source):
    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def names(self) -> set[str]:
        return set(self.tensors)

    def meta(self, name):
        return tuple(self.tensors[name].shape), self.tensors[name].dtype

    def read(self, part):
        t = self.tensors[part.name]
        return t if part.expert is None else t[part.expert]


class _SafetensorsSource(_Source):
    """Lazy: `read` loads one tensor, or one expert's row of a fused tensor."""

    def __init__(self, files: list[Path]) -> None:
        from safetensors import safe_open

        self.where: dict[str, object] = {}
        self.file_of: dict[str, Path] = {}
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except Exception as exc:  # safetensors' own error type (SafetensorError) or an OSError
                raise ValueError(f"{path}: not a readable safetensors file ({exc}); it is empty, truncated or "
                                 f"corrupt: download or save it again") from None
            for name in handle.keys():
                if name in self.where:
                    raise ValueError(f"tensor {name!r} appears in two files of the checkpoint (second: {path})")
                self.where[name], self.file_of[name] = handle, path

    def names(self) -> set[str]:
        return set(self.where)

    def meta(self, name):
        sl = self.where[name].get_slice(name)
        raw = sl.get_dtype()
        return tuple(sl.get_shape()), _SAFETENSORS_DTYPES.get(raw, raw)

    def read(self, part):
        handle = self.where[part.name]
        try:
            return handle.get_tensor(part.name) if part.expert is None else handle.get_slice(part.name)[part.expert]
        except Exception as exc:
            raise ValueError(f"{self.file_of[part.name]}: cannot read tensor {part.name!r} ({exc}); the file is "
                             f"damaged: download or save it again") from None


def _allowed_roots(path: Path) -> list[Path]:
    """Where a checkpoint's files may live: its directory, and for a Hugging Face hub cache snapshot
    (`<repo>/snapshots/<revision>/`, whose files are symlinks to `<repo>/blobs/`) that blobs folder."""
    roots = [path.resolve()]
    if path.resolve().parent.name == "snapshots":
        roots.append(path.resolve().parent.parent / "blobs")
    return roots


def _inside(path: Path, name: str, origin: str) -> Path:
    """`path / name`, refused when the name or a symlink on the way leads out of the checkpoint."""
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise ValueError(f"{origin} names {name!r}, outside the checkpoint directory {path}; only files "
                         f"inside it are read")
    file = path / rel
    target = file.resolve()
    if not any(target.is_relative_to(root) for root in _allowed_roots(path)):
        raise ValueError(f"{file} is a symlink to {target}, outside the checkpoint directory {path}; copy the "
                         f"file into the checkpoint instead")
    if file.exists() and not file.is_file():  # a FIFO would block the reader, a device never end
        raise ValueError(f"{file} is not a regular file (a directory, FIFO, socket or device); a checkpoint is "
                         f"read from regular files only")
    return file


def _read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{file}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def _index_files(path: Path, index: Path) -> list[Path]:
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ValueError(f"{index}: expected a 'weight_map' object of tensor name -> file name")
    return sorted({_inside(path, f, f"{index.name}'s weight_map") for f in weight_map.values()})


def _load_bin(file: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        # torch's own message proposes weights_only=False, which would run the file's code: never.
        raise ValueError(f"{file}: refused: it holds pickled Python objects besides tensors, and loading those "
                         f"runs code from the file. Convert it to safetensors where it is trusted, or use a "
                         f"safetensors checkpoint") from None
    except Exception as exc:
        raise ValueError(f"{file}: not a readable PyTorch checkpoint ({type(exc).__name__}); it is empty, "
                         f"truncated or corrupt: download or save it again") from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise ValueError(f"{file}: expected a dict of tensor name -> tensor, got {type(state).__name__}")
    return state


def _open_checkpoint(path: Path) -> _Source:
    index = path / "model.safetensors.index.json"
    if index.exists():  # only the files it names: some repos also ship e.g. consolidated.safetensors
        files = _index_files(path, _inside(path, index.name, "the checkpoint"))
    elif (path / "model.safetensors").exists():
        files = [_inside(path, "model.safetensors", "the checkpoint")]
    else:
        files = [_inside(path, f.name, "the checkpoint") for f in sorted(path.glob("*.safetensors"))]
    if files:
        return _SafetensorsSource(files)
    bins = [_inside(path, f.name, "the checkpoint") for f in sorted(path.glob("pytorch_model*.bin"))]
    if not bins:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for b in bins:
        tensors.update(_load_bin(b))
    return _DictSource(tensors)


def _validate(source: _Source, plan: _Plan, cfg: ModelConfig, arch: str) -> None:
    """Raise ValueError for the first thing wrong with the checkpoint, before anything is read."""
    names = source.names()
    ignored = {n for n in names if n.endswith(_IGNORED_SUFFIXES)}
    if arch == DEEPSEEK_V3:
        ignored |= deepseek.ignored_names(names, cfg)
    if cfg.tie_word_embeddings:
        ignored.add("lm_head.weight")  # transformers ties it to the embedding too, and ignores the stored copy
    missing = sorted(set(plan.hf_shapes) - names)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensor(s) that {arch} with this config.json needs, "
                         f"first: {missing[:3]}; the weights are incomplete or belong to another config.json")
    extra = sorted(names - set(plan.hf_shapes) - ignored)
    if extra:
        raise ValueError(f"checkpoint has {len(extra)} unexpected tensor(s), first: {extra[:3]}; biases, gated "
                         f"shared experts and quantisation scales are not supported: remove them or use a "
                         f"plain {arch} checkpoint")
    for name, want in plan.hf_shapes.items():
        shape, dtype = source.meta(name)
        if shape != want:
            raise ValueError(f"tensor {name!r} has shape {shape}, expected {want} for {arch} with this "
                             f"config.json; check that config.json belongs to these weights")
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"tensor {name!r} has dtype {dtype}, supported: float32, bfloat16, float16; "
                             f"convert (dequantise) the checkpoint first")


# ---------------------------------------------------------------- public API

def hf_to_megatron(hf_state: Mapping[str, torch.Tensor], cfg: ModelConfig, arch: str) -> dict[str, torch.Tensor]:
    """Full HF state (per-expert or fused experts) -> full Megatron state, names as `full_shapes(cfg)`."""
    source = _DictSource(hf_state)
    plan = _plan(cfg, arch, source.names())
    _validate(source, plan, cfg, arch)
    return {name: _assemble(r, source.read, cfg) for name, r in plan.recipes.items()}


def megatron_to_hf(state: Mapping[str, torch.Tensor], cfg: ModelConfig, arch: str,
                   fused_experts: bool = False) -> dict[str, torch.Tensor]:
    """Full Megatron state -> HF names; per-expert layout (what transformers 5 writes) unless
    `fused_experts` (transformers 5's in-memory `experts.gate_up_proj` / `down_proj`)."""
    want = full_shapes(cfg)
    missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or extra:
        raise ValueError(f"state does not match the config: missing {missing[:3]}, unexpected {extra[:3]}")
    plan = _plan(cfg, arch, None, fused_experts)
    out: dict[str, torch.Tensor] = {}
    stacked: dict[str, dict[int, torch.Tensor]] = {}
    for name, recipe in plan.recipes.items():
        for part, t in zip(recipe.parts, _split(recipe, state[name], cfg)):
            if part.expert is None:
                out[part.name] = t
            else:
                stacked.setdefault(part.name, {})[part.expert] = t
    out.update({name: torch.stack([rows[e] for e in sorted(rows)]) for name, rows in stacked.items()})
    return out


def hf_items(items: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig, arch: str
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """Full Megatron tensors, one at a time, as their HF tensors (per-expert layout, q/k/v and
    gate/up as views of the tensor given): `megatron_to_hf` for a stream that never holds the
    whole state, such as weights loaded into another engine in place."""
    recipes = _plan(cfg, arch).recipes
    for name, t in items:
        recipe = recipes.get(name)
        if recipe is None:
            raise ValueError(f"{name!r} is not a tensor of this config under {arch}")
        yield from ((part.name, piece) for part, piece in zip(recipe.parts, _split(recipe, t, cfg)))


def _dtype_name(dtype: torch.dtype | str) -> str:
    name = _DTYPE_NAMES.get(dtype, dtype) if isinstance(dtype, torch.dtype) else dtype
    if name not in _DTYPE_NAMES.values():
        raise ValueError(f"unsupported model dtype {dtype}; expected float32, bfloat16 or float16")
    return name


def load_pretrained(path: str | os.PathLike, comm: Comm | None = None, device: torch.device | str | None = None,
                    dtype: torch.dtype | str | None = None) -> MoETransformer:
    """Build this rank's shard of an HF checkpoint directory. Validates everything first; the
    model is returned only when every parameter was filled."""
    import transformers

    path = Path(path)
    config = _inside(path, "config.json", "the checkpoint")  # transformers reads it after us: check it like weights
    if not config.is_file():
        raise FileNotFoundError(f"{config} does not exist: a checkpoint directory holds config.json and its weights")
    _read_json(config)  # transformers' own error gives no position, and some none at all
    hf_config = transformers.AutoConfig.from_pretrained(path)
    arch = architecture_of(hf_config)
    cfg = config_from_hf(hf_config)
    if dtype is not None:
        cfg = cfg.replace(dtype=_dtype_name(dtype))
    source = _open_checkpoint(path)
    if arch == DEEPSEEK_V3:
        cfg = deepseek.with_mtp_layers(cfg, source.names())
    plan = _plan(cfg, arch, source.names())
    _validate(source, plan, cfg, arch)
    comm = comm or LocalComm()
    model = MoETransformer(cfg, comm, device)
    params = dict(model.named_parameters())
    filled = set()
    with torch.no_grad():
        for name, recipe in plan.recipes.items():
            local = local_name(name, cfg, comm.shard)
            if local is None:
                continue  # another EP rank's expert: never read
            params[local].copy_(shard_tensor(name, _assemble(recipe, source.read, cfg), cfg, comm.shard))
            filled.add(local)
    if filled != set(params):
        raise RuntimeError(f"internal: parameters left unfilled: {sorted(set(params) - filled)[:3]}")
    log.info("loaded %s (%s) from %s", arch, cfg.dtype, path)
    return model


def save_safetensors(model_or_full_state: MoETransformer | Mapping[str, torch.Tensor], cfg: ModelConfig,
                     path: str | os.PathLike, arch: str) -> Path:
    """The weights alone: one safetensors file under `arch`'s Hugging Face names (per-expert layout)."""
    from safetensors.torch import save_file

    if isinstance(model_or_full_state, MoETransformer):
        if model_or_full_state.comm.shard != Shard():
            raise ValueError(f"this model is one rank's shard ({model_or_full_state.comm.shard}); gather the "
                             "full state and pass it as a dict")
        state = model_or_full_state.state_dict()
    else:
        state = model_or_full_state
    tensors = megatron_to_hf(state, cfg, arch)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # one host copy each: q/k/v (and gate/up) are views of one tensor, and safetensors refuses shared storage
    save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}, str(path),
              metadata={"format": "pt"})
    return path


def save_pretrained(model_or_full_state: MoETransformer | Mapping[str, torch.Tensor], cfg: ModelConfig,
                    path: str | os.PathLike, arch: str) -> None:
    """Write config.json + model.safetensors that `transformers.AutoModelForCausalLM` loads."""
    hf_config = hf_config_from(cfg, arch)  # a config the architecture cannot express fails before any write
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(path)
    save_safetensors(model_or_full_state, cfg, path / "model.safetensors", arch)


def load_model(spec: str, comm: Comm | None = None, device: torch.device | str | None = None) -> MoETransformer:
    """A preset name (random init, seed 0) or an HF checkpoint directory."""
    if spec in PRESETS:
        return MoETransformer(PRESETS[spec], comm, device).init_weights(seed=0)
    if Path(spec).is_dir():
        return load_pretrained(spec, comm, device)
    raise ValueError(f"model {spec!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a directory "
                     "holding config.json and weights")
