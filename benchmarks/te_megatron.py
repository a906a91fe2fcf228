"""A Megatron-core `GPTModel` on the Transformer Engine layer spec trains one step, hot-swaps into the
rollout through `update_weights`, and the rollout on TE (bf16) must give the trainer's logits (GPU only).

Why: issue 18 asks that a Megatron TE-spec trainer feed the rollout with a copy. The rollout keeps the
local spec's parameter names; `megatron_rollout.weights.megatron_names` maps the TE spec's (fused norms,
grouped experts, `_extra_state`) onto them and refuses any other name; the engine's `update_weights`
then checks shapes, dtypes and values as for any trainer.

The run (`run`): one NCCL rank, parallel_state at TP = EP = 1; a Qwen3-MoE-shaped GPTModel in bf16
(default: 2 layers of `qwen3-30b-a3b-12l`, TE grouped experts, qk norm) takes one Adam step (lr 1e-4)
on random tokens; its state dict goes through `megatron_state_to_rollout` into a rollout engine whose model
starts as NaN (so a tensor the copy missed cannot hide); the rollout's attention and dense-MLP linears
then run on `te.pytorch.Linear` in bf16 (`TEBF16Weight`, the `te_layers.TEWeight` slot outside FP8
autocast), and the logits of both models on the same tokens are compared: relative error (whole and
per token, max and mean) and top-1 agreement. The rollout's own bf16 path and TE FP8 recipes
(`te_layers.apply_te`) are reported beside it.

    python -m benchmarks.te_megatron --out te-megatron.json

Left out: TP/EP/PP > 1 (one rank), FP8 training (the trainer is bf16), Megatron's DDP wrapper and
distributed optimizer (a torch Adam over the bf16 parameters), MLA, MTP, TE's op fuser
(`use_te_op_fuser`), and the single grouped expert weight (`moe_single_grouped_weight`): refused by name.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fnmatch
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatron_rollout.model import te_layers
from megatron_rollout.model.config import ModelConfig, preset
from megatron_rollout.weights.megatron_layout import transformer_config
from megatron_rollout.weights.megatron_names import megatron_state_to_rollout

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- the rollout's linears on TE in bf16

class TEBF16Weight(te_layers.TEWeight):
    """`te_layers.TEWeight` outside FP8 autocast: TE's bf16 GEMM on the Linear's own weight storage
    (no recipe, no FP8 weight cache, so nothing to refresh). `te_layers.TEConfig` has FP8 recipes
    only; this is its bf16 case, kept here until `te_layers` offers one."""

    backend = "transformer_engine_bf16"

    def matmul(self, x: torch.Tensor, refresh: bool | None = None) -> torch.Tensor:
        if self.module.weight.data_ptr() != self.owner.weight.data_ptr():
            self.bind()
        lead, k = x.shape[:-1], x.shape[-1]
        y = self.module(x.reshape(-1, k))  # [rows, out]
        return y.view(*lead, y.shape[-1])

    def refresh(self) -> None:
        return None


def apply_te_bf16(model: nn.Module, include: tuple[str, ...] = te_layers.DEFAULT_INCLUDE) -> tuple[str, ...]:
    """Put the model's matching `Linear`s on `te.pytorch.Linear` in bf16, in place (undo with
    `te_layers.remove_te`). Returns the module names."""
    from megatron_rollout.model.layers import Linear

    why = te_layers.te_missing()
    if why:
        raise te_layers.TEUnavailable(why)
    import transformer_engine.pytorch as te

    names = []
    for name, module in model.named_modules():
        if isinstance(module, Linear) and any(fnmatch.fnmatchcase(name, p) for p in include):
            out_f, in_f = module.weight.shape
            layer = te.Linear(in_f, out_f, bias=False, params_dtype=module.weight.dtype, device=module.weight.device)
            module.fp8 = TEBF16Weight(module, None, layer)
            names.append(name)
    if not names:
        raise ValueError(f"no Linear layer matches {include}")
    return tuple(names)


# ---------------------------------------------------------------- config and result

@dataclass(frozen=True)
class TEMegatronConfig:
    model: str = "qwen3-30b-a3b-12l"
    """Model preset whose sizes both models take (in bf16)."""
    num_layers: int = 2
    """Leading layers of the preset to build (its `moe_layer_freq` is cut to them)."""
    grouped_gemm: bool = True
    """Megatron experts as TE's `TEGroupedMLP` (`experts.linear_fc1.weightK`); False: `SequentialMLP`
    of TE linears (`experts.local_experts.K.linear_fc1.weight`)."""
    batch: int = 2
    """Sequences of random tokens (training step and logits)."""
    seq_len: int = 256
    """Tokens per sequence."""
    lr: float = 1e-4
    """Adam learning rate of the one training step."""
    seed: int = 0
    """Seeds Megatron's init (`model_parallel_cuda_manual_seed`) and the tokens."""
    fp8_recipes: tuple[str, ...] = ("current",)
    """TE FP8 recipes (`te_layers.RECIPES`) whose rollout logits are also reported against the trainer."""

    def __post_init__(self) -> None:
        cfg = preset(self.model)  # raises for an unknown preset, naming the known ones
        if not 0 < self.num_layers <= cfg.num_layers:
            raise ValueError(f"num_layers must be in [1, {cfg.num_layers}] for {self.model}, got {self.num_layers}")
        if self.batch <= 0 or self.seq_len < 2:
            raise ValueError(f"need batch >= 1 and seq_len >= 2 (next-token loss), got {self.batch}, {self.seq_len}")
        if self.seq_len > cfg.max_position_embeddings:
            raise ValueError(f"seq_len {self.seq_len} exceeds {self.model}'s context {cfg.max_position_embeddings}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        bad = [r for r in self.fp8_recipes if r not in te_layers.RECIPES]
        if bad:
            raise ValueError(f"unknown FP8 recipes {bad}; choose from {te_layers.RECIPES}")

    def model_config(self) -> ModelConfig:
        cfg = preset(self.model)
        return cfg.replace(num_layers=self.num_layers, moe_layer_freq=cfg.moe_layer_freq[:self.num_layers],
                           dtype="bfloat16")


@dataclass(frozen=True)
class LogitParity:
    """Rollout logits against the trainer's on the same tokens."""

    rel_err: float
    """||rollout - trainer|| / ||trainer|| over all logits."""
    max_token_rel_err: float
    """The same per token position, worst token."""
    mean_token_rel_err: float
    """The same per token position, averaged."""
    top1_agreement: float
    """Share of positions whose argmax token agrees."""


def logit_parity(got: torch.Tensor, ref: torch.Tensor) -> LogitParity:
    """got, ref: [B, T, V]."""
    got, ref = got.float(), ref.float()
    per_token = (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)  # [B, T]
    return LogitParity(float((got - ref).norm() / ref.norm()), float(per_token.max()), float(per_token.mean()),
                       float((got.argmax(-1) == ref.argmax(-1)).float().mean()))


def missing_requirements() -> str | None:
    """None when this machine can run the benchmark; otherwise what is missing and how to get it."""
    if not torch.cuda.is_available():
        return "te_megatron needs a CUDA device (TE's layers and Megatron's forward run on GPU only)"
    why = te_layers.te_missing()
    if why:
        return why
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        return (f"megatron-core is not importable ({exc}): on the GPU machine bring .whl/ and install it with "
                "`bash benchmarks/device/te_session.sh megatron` (docs/fp8-te.md)")
    return None


# ---------------------------------------------------------------- Megatron side

@contextlib.contextmanager
def one_rank_world(seed: int) -> Iterator[None]:
    """torch.distributed on one NCCL rank (unless one is already up) and parallel_state at TP = EP = 1;
    torn down afterwards if made here."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.cuda.set_device(0)
    with contextlib.ExitStack() as stack:
        if not dist.is_initialized():
            store_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="te_megatron"))
            store = dist.FileStore(os.path.join(store_dir, "store"), 1)
            dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
            stack.callback(dist.destroy_process_group)
        elif dist.get_world_size() != 1:
            raise RuntimeError(f"te_megatron runs on one rank; the process group has {dist.get_world_size()}")
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1, expert_tensor_parallel_size=1)
            stack.callback(ps.destroy_model_parallel)
        model_parallel_cuda_manual_seed(seed)
        yield


def build_te_gpt(cfg: ModelConfig, grouped_gemm: bool) -> tuple[nn.Module, str]:
    """A GPTModel on the TE spec (on the current CUDA device) and the spec function used. One layer
    spec (`get_gpt_layer_with_transformer_engine_spec`, the same keywords in megatron-core 0.16 and
    0.19) when every layer has the same kind; the decoder block spec for mixed dense/MoE layers."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs

    moe = dict(moe_router_dtype="fp32", moe_grouped_gemm=grouped_gemm) if cfg.num_moe_experts else {}
    tcfg = transformer_config(cfg, use_cpu_initialization=False, gradient_accumulation_fusion=False, **moe)
    kinds = {cfg.is_moe_layer(i) for i in range(cfg.num_layers)}
    if len(kinds) == 1:
        spec = specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=cfg.num_moe_experts or None, moe_grouped_gemm=grouped_gemm, qk_layernorm=cfg.qk_layernorm)
        used = "get_gpt_layer_with_transformer_engine_spec"
    else:
        spec = specs.get_gpt_decoder_block_spec(tcfg, use_transformer_engine=True)
        used = "get_gpt_decoder_block_spec(use_transformer_engine=True)"
    gpt = GPTModel(tcfg, spec, vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
                   position_embedding_type="rope", rotary_base=int(cfg.rotary_base), rotary_percent=1.0,
                   share_embeddings_and_output_weights=cfg.tie_word_embeddings)
    return gpt.cuda(), used


def megatron_logits(gpt: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """ids [B, T] -> logits [B, T, V]; causal attention from the spec's mask type (no mask tensor)."""
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    return gpt(ids, positions, None)


def train_step(gpt: nn.Module, ids: torch.Tensor, lr: float) -> float:
    """One Adam step of next-token cross-entropy on `ids`; returns the loss before the step."""
    opt = torch.optim.Adam(gpt.parameters(), lr=lr)
    gpt.train()
    logits = megatron_logits(gpt, ids)
    loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss)


# ---------------------------------------------------------------- the run

def rollout_engine(cfg: ModelConfig, device: torch.device):
    """A rollout engine (eager runner: the model's own forward, nothing installed on it) whose model
    starts as NaN, so a tensor that `update_weights` misses poisons every logit; routed experts in
    the CUDA runner's stacked layout, which `update_weights` copies into."""
    from megatron_rollout.engine import EngineConfig, KVConfig, RolloutEngine, RunnerConfig
    from megatron_rollout.model.layers import Experts
    from megatron_rollout.model.transformer import MoETransformer

    model = MoETransformer(cfg, device=device).requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    for m in model.modules():
        if isinstance(m, Experts):
            m.restack()
    return RolloutEngine(model, EngineConfig(kv=KVConfig(num_blocks=64), runner=RunnerConfig(kind="eager")))


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out = te_layers.te_versions()
    try:
        out["megatron-core"] = version("megatron-core")
    except PackageNotFoundError:
        out["megatron-core"] = None
    return out


def run(config: TEMegatronConfig) -> dict[str, Any]:
    """Train one step on the TE-spec GPTModel, hot-swap into the rollout, compare logits (see the
    module docstring). Raises RuntimeError naming what is missing without CUDA, TE or megatron-core."""
    why = missing_requirements()
    if why:
        raise RuntimeError(why)
    from megatron_rollout.engine import SamplingParams

    cfg = config.model_config()
    times: dict[str, float] = {}
    result: dict[str, Any] = {"config": dataclasses.asdict(config), "model_config": dataclasses.asdict(cfg),
                              "versions": _versions()}

    def timed(name: str, fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times[name] = round(time.perf_counter() - t0, 3)
        return out

    with one_rank_world(config.seed):
        gpt, result["spec"] = timed("build_megatron", lambda: build_te_gpt(cfg, config.grouped_gemm))
        gen = torch.Generator(device="cuda").manual_seed(config.seed)
        ids = torch.randint(0, cfg.vocab_size, (config.batch, config.seq_len), device="cuda", generator=gen)
        before = {n: p.detach().clone() for n, p in gpt.named_parameters()}
        result["train_loss"] = timed("train_step", lambda: train_step(gpt, ids, config.lr))
        moved = [n for n, p in gpt.named_parameters() if not torch.equal(before[n], p)]
        result["params_moved"], result["params_total"] = len(moved), len(before)
        result["max_abs_update"] = max(float((p.detach() - before[n]).abs().max()) for n, p in gpt.named_parameters())
        del before
        gpt.eval()
        with torch.no_grad():
            ref = timed("megatron_forward", lambda: megatron_logits(gpt, ids).float())  # [B, T, V]
            result["loss_after_step"] = float(F.cross_entropy(ref[:, :-1].reshape(-1, ref.shape[-1]),
                                                              ids[:, 1:].reshape(-1)))
            mapped = megatron_state_to_rollout(gpt.state_dict(), cfg)
            result["names"] = {"rollout_tensors": len(mapped.tensors), "renamed": mapped.renamed,
                               "extra_state_skipped": mapped.skipped}

            engine = rollout_engine(cfg, torch.device("cuda"))
            model = engine.model
            timed("update_weights", lambda: engine.update_weights(mapped.tensors, 1))
            result["weight_version"] = engine.weight_version
            parity: dict[str, Any] = {"native_bf16": dataclasses.asdict(logit_parity(model(ids), ref))}
            result["te_linears"] = len(apply_te_bf16(model))
            got = timed("rollout_te_bf16_forward", lambda: model(ids))
            parity["te_bf16"] = dataclasses.asdict(logit_parity(got, ref))
            # The engine serving the swapped weights on TE: its greedy first token after a 16-token prompt
            # and the trainer's argmax there (recorded, not asserted: a bf16 near-tie may flip it).
            first: dict[str, Any] = {"megatron": int(ref[0, 15].argmax())}
            try:
                out = engine.generate([ids[0, :16].tolist()], SamplingParams(temperature=0.0, max_new_tokens=1))[0]
                first.update(rollout=out.token_ids[0] if out.token_ids else None, error=out.error)
            except Exception as exc:  # recorded, so the logit figures above still come back
                log.exception("engine.generate on the swapped weights failed")
                first["error"] = f"{type(exc).__name__}: {exc}"
            result["engine_first_token"] = first
            te_layers.remove_te(model)
            for recipe in config.fp8_recipes:
                try:
                    te_layers.apply_te(model, te_layers.TEConfig(recipe=recipe, experts=False))
                    parity[f"te_fp8_{recipe}"] = dataclasses.asdict(logit_parity(model(ids), ref))
                except Exception as exc:  # recorded: one unavailable recipe must not hide the bf16 figure
                    log.exception("TE FP8 recipe %s failed", recipe)
                    parity[f"te_fp8_{recipe}"] = {"error": f"{type(exc).__name__}: {exc}"}
                finally:
                    te_layers.remove_te(model)
        result["parity"], result["times_s"] = parity, times
    return result


def summary(result: dict[str, Any]) -> str:
    lines = [f"spec {result['spec']}; loss {result['train_loss']:.4f} -> {result['loss_after_step']:.4f}; "
             f"{result['params_moved']}/{result['params_total']} params moved; names {result['names']}",
             f"{'rollout path':<16}{'rel err':>10}{'max tok':>10}{'mean tok':>10}{'top-1':>8}"]
    for name, p in result["parity"].items():
        if "error" in p:
            lines.append(f"{name:<16}  error: {p['error'][:100]}")
        else:
            lines.append(f"{name:<16}{p['rel_err']:>10.4f}{p['max_token_rel_err']:>10.4f}"
                         f"{p['mean_token_rel_err']:>10.4f}{p['top1_agreement']:>8.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    d = TEMegatronConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=d.model)
    p.add_argument("--layers", type=int, default=d.num_layers)
    p.add_argument("--sequential-experts", action="store_true", help="SequentialMLP instead of TE grouped experts")
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--fp8", default=",".join(d.fp8_recipes), help="comma-separated TE FP8 recipes also compared")
    p.add_argument("--out", default=None, help="JSON path")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = TEMegatronConfig(model=args.model, num_layers=args.layers, grouped_gemm=not args.sequential_experts,
                              batch=args.batch, seq_len=args.seq_len, lr=args.lr, seed=args.seed,
                              fp8_recipes=tuple(r for r in args.fp8.split(",") if r))
    why = missing_requirements()
    if why:
        raise SystemExit(f"te_megatron: {why}")
    result = run(config)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    print(summary(result))


if __name__ == "__main__":
    main()
