"""bf16 vs FP8 (`torch._scaled_mm`) vs FP8 (Transformer Engine, each recipe) on one random-weight
model: graph-replayed decode step, one 4096-token prefill, and each FP8 path's logit error against
bf16 (GPU only; TE built by benchmarks/device/te_session.sh).

The GEMM-backend variants (`scaled_mm`, `te_*`) cover the same layers (attention QKV/projection and
dense MLPs, `te_layers.DEFAULT_INCLUDE`), so they compare backends, not coverage; routed experts stay
bf16 grouped GEMMs unless TE's device-split GroupedLinear applies (recorded per variant). The
`fp8_experts` variants quantise the routed experts too (`model.fp8`'s default layers), per tensor
and in 128x128 blocks: stacked e4m3 experts on the weight-only Triton kernels (`kernels.moe_triton`)
inside the decode graph, the dense layers on `scaled_mm`. Variants run one after another on one
model and cache, interleaved over `--repeats` rounds after an untimed warm round (decode graphs
recaptured per variant and round, outside timing; compilations counted in every timed round).
Left out: several GPUs, FP8 KV.

    python -m benchmarks.te --out te-bench.json
"""
from __future__ import annotations

import argparse
import json
import logging
import math
from typing import Any

import numpy as np
import torch

from benchmarks import micro
from benchmarks.bounds import model_costs
from benchmarks.ceilings import copy_bandwidth, matmul_rate
from benchmarks.compiles import CompileCounter
from megatron_rollout.model import fp8, te_layers
from megatron_rollout.model.config import preset
from megatron_rollout.model.layers import Linear

log = logging.getLogger(__name__)


def _reset(model: torch.nn.Module) -> None:
    te_layers.remove_te(model)
    for m in model.modules():
        if isinstance(m, Linear):
            m.fp8 = None


def _variant(model, name: str) -> dict[str, Any]:
    """Put the model on variant `name`: 'bf16', 'scaled_mm', 'fp8_experts[_block]', or 'te_<recipe>'."""
    _reset(model)
    if name == "scaled_mm":
        return {"layers": len(fp8.quantize_model_fp8(model, include=te_layers.DEFAULT_INCLUDE, backend="scaled_mm"))}
    if name.startswith("fp8_experts"):
        block = 128 if name.endswith("block") else None
        return {"layers": len(fp8.quantize_model_fp8(model, block=block, backend="scaled_mm")), "block": block}
    if name.startswith("te_"):
        result = te_layers.apply_te(model, te_layers.TEConfig(recipe=name[3:]))
        return {"layers": len(result.linears), "experts_on_te": len(result.experts),
                "experts_skipped": result.experts_skipped, "versions": result.versions}
    return {}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.rollout import random_model
    from megatron_rollout.engine.config import RunnerConfig
    from megatron_rollout.kv.paged import PagedKVCache
    from megatron_rollout.runner.cuda import CudaRunner

    cfg = preset(args.model)
    device = torch.device("cuda")
    block = 16
    model = random_model(cfg, device, args.seed)
    blocks = args.rows * math.ceil(args.context / block) + math.ceil(args.prefill / block) + 64
    cache = PagedKVCache(cfg, blocks, block, cfg.num_query_groups, device="cuda")
    cache.k.normal_()
    cache.v.normal_()
    runner = CudaRunner(model, cache, RunnerConfig(graph_batch_sizes=(args.rows,)))
    costs = model_costs(cfg)
    result: dict[str, Any] = {"model": args.model, "rows": args.rows, "context": args.context,
                              "prefill_tokens": args.prefill, "copy_bandwidth_gb_s": copy_bandwidth() / 1e9,
                              "bf16_matmul_tflops": matmul_rate() / 1e12, "te_missing": te_layers.te_missing(),
                              "variants": {}}
    bandwidth = result["copy_bandwidth_gb_s"] * 1e9
    peak = result["bf16_matmul_tflops"] * 1e12
    ids = torch.randint(0, cfg.vocab_size, (1, args.logit_tokens), device=device,
                        generator=torch.Generator(device=device).manual_seed(args.seed))
    names = ["bf16", "scaled_mm", "fp8_experts", "fp8_experts_block"]
    names += ([f"te_{r}" for r in te_layers.RECIPES] if result["te_missing"] is None else [])
    ref = None
    rounds: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(args.repeats + 1):  # round 0 warms every variant (captures, Triton, TE's caches)
        for name in names:  # interleaved: every variant once per round
            if "error" in result["variants"].get(name, {}):
                continue
            entry: dict[str, Any] = result["variants"].setdefault(name, {})
            try:
                with torch.no_grad():
                    setup = _variant(model, name)
                    if r == 0:
                        entry.update(setup)
                        logits = model(ids).float()
                        if ref is None:
                            ref = logits
                        else:
                            entry["logits_rel_err_vs_bf16"] = float((logits - ref).norm() / ref.norm())
                            entry["top1_agreement_vs_bf16"] = float(
                                (logits.argmax(-1) == ref.argmax(-1)).float().mean())
                    runner.drop_graphs()  # captured with the previous variant's layers
                    runner.decode_graph(args.rows)  # capture outside the timed region
                    rng = np.random.default_rng(args.seed)
                    with CompileCounter() as counter:
                        decode = micro.decode_steps(runner, costs, bandwidth, [(args.rows, args.context)], rng,
                                                    iters=args.iters)[0]
                        pre = micro.prefill(runner, costs, peak, [[(0, args.prefill)]], rng)[0]
                if r > 0:
                    rounds[name].append({"decode_ms": decode["graph_ms"], "decode_eager_ms": decode["eager_ms"],
                                         "roofline_ms": decode["roofline_ms"], "prefill_ms": pre["ms"],
                                         "prefill_tokens_per_s": pre["tokens_per_s"], "compiles": counter.counts.total})
            except Exception as exc:  # recorded, so one failing path does not hide the others
                log.exception("variant %s failed", name)
                entry["error"] = f"{type(exc).__name__}: {exc}"
    for name, reps in rounds.items():
        entry = result["variants"][name]
        if reps:
            entry["repeats"] = reps
            timed = [k for k in reps[0] if k != "compiles"]  # a count, summed below, not a figure
            entry["median"] = {k: float(np.median([x[k] for x in reps])) for k in timed}
            entry["min"] = {k: float(np.min([x[k] for x in reps])) for k in timed}
            entry["max"] = {k: float(np.max([x[k] for x in reps])) for k in timed}
            entry["compiles"] = sum(x["compiles"] for x in reps)
        log.info("%s: %s", name, {k: v for k, v in entry.items() if k not in ("repeats", "min", "max", "versions")})
    _reset(model)
    return result


def summary(result: dict[str, Any]) -> str:
    """Median (min-max) over the timed rounds; compilations summed over them (must be 0)."""
    lines = [f"{'variant':<18}{'decode ms':>22}{'prefill tok/s':>26}{'logit rel err':>15}{'top-1':>7}{'compiles':>9}"]
    for name, e in result["variants"].items():
        if "error" in e or "median" not in e:
            lines.append(f"{name:<18}  error: {e.get('error', 'no timed round')[:100]}")
            continue
        med, lo, hi = e["median"], e["min"], e["max"]
        dec = f"{med['decode_ms']:.3f} ({lo['decode_ms']:.3f}-{hi['decode_ms']:.3f})"
        pre = f"{med['prefill_tokens_per_s']:.0f} ({lo['prefill_tokens_per_s']:.0f}-{hi['prefill_tokens_per_s']:.0f})"
        lines.append(f"{name:<18}{dec:>22}{pre:>26}{e.get('logits_rel_err_vs_bf16', 0.0):>15.4f}"
                     f"{e.get('top1_agreement_vs_bf16', 1.0):>7.3f}{e['compiles']:>9d}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-30b-a3b-12l")
    p.add_argument("--rows", type=int, default=64, help="decode rows (one graph bucket)")
    p.add_argument("--context", type=int, default=2048, help="decode context per row")
    p.add_argument("--prefill", type=int, default=4096, help="tokens of the one prefill span")
    p.add_argument("--logit-tokens", type=int, default=256)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3, help="timed rounds, variants interleaved in each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.te needs a CUDA device")
    result = run(args)
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(summary(result))


if __name__ == "__main__":
    main()
