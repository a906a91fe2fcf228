"""`python -m benchmarks.mtp`: MTP speculative decoding on and off, acceptance rate and decode tokens/s.

One engine per setting (plain decoding, then `EngineConfig.speculative` with k = 1..`--k`) over one
model, all on the same runner (`--runner`; auto: the CUDA runner with its decode graphs on a GPU,
where drafting's verify and draft forwards are graph replays too, the portable runner on CPU).
Each engine generates the prompts once untimed (kernels compile, graphs are captured), then the
settings take turns `--repeats` times. Per setting the report gives the median decode tokens/s
with its range (generated tokens over the wall time of the generate call, prefill included:
prefix caching is off, so every call prefills), decode iterations, the acceptance rate, and the
Triton/dynamo compilations and graph captures counted inside the timed calls (both should be 0).
Greedy tokens of every speculative run are checked against the plain run's.

Random weights draft badly, so two models are measured: `random` (the preset as initialised) and
`copying`, the same shapes with the MTP layer right by construction (`make_copying`): the
speed-up path, acceptance close to 1.

Presets: `tiny` (a DeepSeek-V3-shaped toy, seconds on CPU) and `deepseek-v3-4l` (DeepSeek-V3's
widths with 4 decoder layers and 32 experts, bf16, one H200). JSON to `--out` (default
benchmarks/results/mtp.json), a table on stdout.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.compiles import CompileCounter
from megatron_rollout.engine import (
    EngineConfig,
    KVConfig,
    RolloutEngine,
    RunnerConfig,
    SamplingParams,
    SchedulerConfig,
    SpeculativeConfig,
)
from megatron_rollout.model.config import ModelConfig
from megatron_rollout.model.transformer import MoETransformer

_DEEPSEEK_TINY = ModelConfig(
    vocab_size=64, hidden_size=32, num_layers=3, num_attention_heads=4, num_query_groups=4, kv_channels=24,
    ffn_hidden_size=48, num_moe_experts=8, moe_router_topk=4, moe_ffn_hidden_size=16,
    moe_shared_expert_intermediate_size=16, moe_layer_freq=(0, 1, 1), moe_renormalize_topk=True,
    layernorm_epsilon=1e-6, max_position_embeddings=512, dtype="float32", multi_latent_attention=True,
    q_lora_rank=24, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12,
    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_num_groups=4,
    moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5, mtp_num_layers=1)

PRESETS: dict[str, ModelConfig] = {
    "tiny": _DEEPSEEK_TINY,
    # DeepSeek-V3's widths (hidden 7168, MLA ranks 1536/512, 128 heads, expert FFN 2048, vocab
    # 129,280), 4 decoder layers (the first dense) and 32 routed experts (top-8): about 18 GB in bf16.
    "deepseek-v3-4l": _DEEPSEEK_TINY.replace(
        vocab_size=129280, hidden_size=7168, num_layers=4, num_attention_heads=128, num_query_groups=128,
        kv_channels=192, ffn_hidden_size=18432, num_moe_experts=32, moe_router_topk=8, moe_ffn_hidden_size=2048,
        moe_shared_expert_intermediate_size=2048, moe_layer_freq=(0, 1, 1, 1), max_position_embeddings=4096,
        dtype="bfloat16", q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64,
        v_head_dim=128, moe_router_num_groups=8, moe_router_group_topk=4),
}


def make_copying(model: MoETransformer) -> MoETransformer:
    """Make `model`'s first MTP layer right by construction: every attention and MLP output projection
    is zeroed (each layer passes its input on, so the target's next token is a function of the
    current one), the norms before the output layer are ones, and `eh_proj` = [I, 0] hands the MTP
    layer the next token's embedding. The MTP layer at position i then computes what the target
    computes at i + 1: its draft for t_{i+2} is the target's own prediction (acceptance ~1)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
                p.zero_()
            elif name.endswith(("final_layernorm.weight", "enorm.weight")):
                p.fill_(1.0)
        eh = model.mtp.layers[0].eh_proj.weight  # [H, 2H]: [embedded next token ; hidden state]
        h = eh.shape[0]
        eh.zero_()
        eh[:, :h].copy_(torch.eye(h, dtype=eh.dtype))
    return model


def engines(model: MoETransformer, settings: list[int | None], base: EngineConfig) -> dict[str, RolloutEngine]:
    """One engine per setting over `model`, all on the runner `base.runner` names."""
    return {_name(k): RolloutEngine(model, dataclasses.replace(base, speculative=None if k is None
                                                               else SpeculativeConfig(k=k)))
            for k in settings}


def measure(engine: RolloutEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """One generate call: tokens/s, decode iterations and acceptance of this call (`EngineStats`
    deltas), compilations inside it (`CompileCounter`), graphs captured inside it, tokens."""
    stats, held = dataclasses.replace(engine.stats), engine.runner.captured
    cuda = engine.model.device.type == "cuda"
    with CompileCounter() as counter, engine.step_log.recording():
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        results = engine.generate(prompts, params)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    steps = engine.step_log.since(t0)
    decode = [r.duration for r in steps if r.phase == "D" and not r.prefill_tokens]
    tokens = sum(len(r.token_ids) for r in results)
    s = engine.stats
    drafted, accepted = s.drafted_tokens - stats.drafted_tokens, s.accepted_tokens - stats.accepted_tokens
    captured = engine.runner.captured
    return {"tokens_per_s": tokens / wall, "wall_s": wall, "tokens": tokens,
            "decode_s": sum(decode), "decode_ms_per_iteration": 1e3 * statistics.median(decode) if decode else 0.0,
            "decode_tokens_per_s": (tokens - len(results)) / sum(decode) if decode else 0.0,
            "decode_iterations": s.decode_iterations - stats.decode_iterations,
            "acceptance_rate": accepted / drafted if drafted else 0.0, "drafted": drafted, "accepted": accepted,
            "compilations": counter.counts.total,
            "graphs_captured": sum(len(a) - len(b) for a, b in zip(captured, held)),
            "token_ids": [r.token_ids for r in results]}


def run(preset: str, device: str, rows: int, prompt_len: int, new_tokens: int, max_k: int, repeats: int,
        temperature: float, seed: int = 0, runner: str = "auto") -> dict:
    cfg = PRESETS[preset]
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, cfg.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(rows)]
    params = SamplingParams(temperature=temperature, max_new_tokens=new_tokens, ignore_stop=True)
    blocks = rows * (-(-(prompt_len + new_tokens + max_k + 1) // 16) + 1)
    base = EngineConfig(scheduler=SchedulerConfig(block_size=16, max_batch_tokens=max(512, prompt_len),
                                                  max_decode_rows=max(rows, 1)),
                        kv=KVConfig(num_blocks=blocks, prefix_caching=False),  # every call prefills again
                        runner=RunnerConfig(kind=runner))
    settings: list[int | None] = [None, *range(1, max_k + 1)]
    report: dict = {"preset": preset, "device": device, "rows": rows, "prompt_len": prompt_len,
                    "new_tokens": new_tokens, "temperature": temperature, "repeats": repeats, "models": {}}
    model = MoETransformer(cfg, device=torch.device(device)).init_weights(seed=seed, std=0.02 if cfg.hidden_size
                                                                             > 1024 else 0.3)
    for kind in ("random", "copying"):
        if kind == "copying":  # the same weights, made right by construction
            make_copying(model)
        built = engines(model, settings, base)
        report["runner"] = type(next(iter(built.values())).runner).__name__
        runs: dict[str, list[dict]] = {name: [] for name in built}
        for engine in built.values():  # warm-up: kernels compile, graphs are captured; not timed
            measure(engine, prompts, params)
        for _ in range(repeats):  # interleaved: every setting once per round
            for name, engine in built.items():
                runs[name].append(measure(engine, prompts, params))
        plain_tokens = runs["off"][0]["token_ids"]
        figures = {}
        for name, rs in runs.items():
            figures[name] = {
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                "tokens_per_s_min": min(r["tokens_per_s"] for r in rs),
                "tokens_per_s_max": max(r["tokens_per_s"] for r in rs),
                "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in rs),
                "decode_ms_per_iteration": statistics.median(r["decode_ms_per_iteration"] for r in rs),
                "decode_iterations": rs[0]["decode_iterations"], "acceptance_rate": rs[0]["acceptance_rate"],
                "compilations_timed": sum(r["compilations"] for r in rs),
                "graphs_captured_timed": sum(r["graphs_captured"] for r in rs),
                "greedy_tokens_equal_plain": temperature > 0 or all(r["token_ids"] == plain_tokens for r in rs)}
        off = figures["off"]["tokens_per_s"]
        for f in figures.values():
            f["speedup"] = f["tokens_per_s"] / off
        report["models"][kind] = figures
        del built
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return report


def _name(k: int | None) -> str:
    return "off" if k is None else f"mtp-k{k}"


def table(report: dict) -> str:
    lines = [f"MTP speculative decoding, preset {report['preset']} on {report['device']} ({report['runner']}): "
             f"{report['rows']} rows, {report['prompt_len']}-token prompts, {report['new_tokens']} new tokens, "
             f"T={report['temperature']}, median of {report['repeats']} [min-max]",
             f"{'model':8} {'setting':8} {'tok/s':>10} {'[min-max]':>17} {'speedup':>8} {'iters':>6} {'accept':>7} "
             f"{'decode tok/s':>12} {'ms/iter':>8} {'greedy=':>7} {'compiled':>8}"]
    for kind, figures in report["models"].items():
        for name, f in figures.items():
            span = f"[{f['tokens_per_s_min']:.1f}-{f['tokens_per_s_max']:.1f}]"
            lines.append(f"{kind:8} {name:8} {f['tokens_per_s']:10.1f} {span:>17} {f['speedup']:8.2f} "
                         f"{f['decode_iterations']:6d} {f['acceptance_rate']:7.3f} "
                         f"{f['decode_tokens_per_s']:12.1f} {f['decode_ms_per_iteration']:8.2f} "
                         f"{str(f['greedy_tokens_equal_plain']):>7} {f['compilations_timed']:8d}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=4, help="prompts generated together (decode rows)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--k", type=int, default=2, help="measure speculative k = 1..K beside plain decoding")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--runner", default="auto", choices=("auto", "eager", "cuda"),
                    help="both sides' runner: auto = the CUDA runner with graphs on a GPU, the portable one on CPU")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/mtp.json"))
    args = ap.parse_args(argv)
    report = run(args.preset, args.device, args.rows, args.prompt_len, args.new_tokens, args.k, args.repeats,
                 args.temperature, runner=args.runner)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(table(report))
    return report


if __name__ == "__main__":
    main()
