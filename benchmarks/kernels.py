"""`python -m benchmarks.kernels --json`: the fused small-op kernels against the portable ops (GPU).

Why a benchmark of its own: the decode step's gap to its memory roofline at small batches is
mostly small kernels (issue 14), and `kernels.fused` replaces them; this measures what each fused
kernel saves and what the whole step gains, in one call that finishes in about a minute.

1. Per op (`rmsnorm`, `add_rmsnorm`, `qkv_norm_rope`, `router_topk`, and the experts' SwiGLU
   `silu_mul` on the tokens' top-k rows) at the model preset's sizes and 1, 16, 64 and 4,096
   tokens: the portable ops (the model's own code) and the fused kernel,
   each timed two ways: eager (median of CUDA-event timed calls: includes launch overhead) and
   inside a CUDA graph (one captured call per input set, replayed; the time per call is what a
   decode graph pays). Input sets rotate so that the graph reads more than the L2 holds where an
   op reads weights (the router's 512 KB per layer); the fused kernel's bytes over its graph time
   give its bandwidth. `--row-blocks 1,2,4,8`: the norm, QKV and SwiGLU kernels again at
   `--block-rows` tokens with each number of rows per program, interleaved: where
   `fused.NORM_BLOCK_ROWS`, `QKV_BLOCK_TOKENS` and `SILU_BLOCK_ROWS` come from.
2. The expert sort of every MoE layer: `sorted_destinations` both ways (the one-hot prefix sum and
   the stable argsort) and `kernels.expert_sort`'s kernels (unpadded, and padded as the Triton
   experts need it, beside the torch padded layout), graph-timed at the preset's experts and
   top-k for `--destinations` token counts: where `expert_sort.MAX_PAIRS` and the one-hot limit
   (`comm.exchange.ONE_HOT_LIMIT`) should sit, and what the Triton sort saves.
   The router's launch shapes (`--router-tiles`, each also at top-1) at `--router-rows` tokens,
   and the bf16 Triton experts' launch shapes (`--bf16-tiles`) at `--bf16-experts` tokens.
3. FP8 experts (`kernels.moe_triton`, stacked e4m3) against the bf16 path (`kernels.moe.routed_experts`)
   on one MoE layer at the preset's sizes, for `--fp8-experts` token counts and a small grid of
   launch shapes (`--fp8-tiles`): graph-timed at decode sizes, eager at prefill sizes (milliseconds:
   launch overhead is noise there). Where `moe_triton.DECODE_TILES` / `LARGE_TILES` come from.
4. The whole decode step, graph-replayed (`benchmarks.micro.decode_steps`: 1 x 2,048 and 64 x 2,048
   positions by default) with and without `install_fused_ops`, against the memory roofline.

Triton compilations are counted over every timed region (`benchmarks.compiles`); each region is
warmed first, so the count must be 0. One JSON object on stdout (`--json`) and/or in `--out`, then
a short table on stderr. Random bf16 inputs (never zeros). Left out: a per-kernel profiler
breakdown of the whole step and multi-GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch

log = logging.getLogger("benchmarks.kernels")

ROWS = (1, 16, 64, 4096)
L2_DEFEAT_BYTES = 96 << 20
"""Bytes of distinct inputs a graph timing cycles through (over the H200's 50 MB L2)."""
MAX_SETS = 128
FP8_TILES = ("16/64/64/4/3,16/128/64/4/3,16/64/128/4/4,64/64/64/4/3,64/128/64/8/3,128/128/64/8/3,"
             "128/64/64/4/3,128/128/128/8/3,64/128/128/8/4")


BF16_TILES = "16/64/128/4/4,16/64/64/4/3,16/32/128/4/4,16/64/256/4/4,16/128/128/4/4,16/64/128/8/4,16/64/128/4/5"
"""`moe_triton.DECODE_TILES` first, then the previous default, and neighbours in each dimension
(the 2026-12-01 expert-sort grid, benchmarks/results/2026-12-01-expert-sort)."""
ROUTER_TILES = "128/4/4/8,128/4/4/1,128/4/4/4,128/2/4/8,64/4/4/8,256/4/4/8"
"""BLOCK_K/WARPS/STAGES[/SPLIT]: the default (8 programs per row block), one program reading the
whole weight, 4, and neighbours of the default in the other dimensions."""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-30b-a3b-12l", help="model preset (sizes of the ops and the step)")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="token counts of the per-op timings")
    ap.add_argument("--decode", default="1x2048,64x2048", help="decode points ROWSxCONTEXT ('' skips the step)")
    ap.add_argument("--destinations", default="1,8,16,32,64,512,1024,2048,4096,8192",
                    help="token counts of the expert-sort timings ('' skips them)")
    ap.add_argument("--fp8-experts", default="64,1024,4096",
                    help="token counts of the FP8-expert timings ('' skips them)")
    ap.add_argument("--fp8-tiles", default=FP8_TILES,
                    help="launch shapes BLOCK_M/N_CAP/K_CAP/WARPS/STAGES, comma-separated")
    ap.add_argument("--bf16-experts", default="1,16,64",
                    help="token counts of the bf16 Triton-expert tile grid ('' skips it)")
    ap.add_argument("--bf16-tiles", default=BF16_TILES,
                    help="its launch shapes BLOCK_M/N_CAP/K_CAP/WARPS/STAGES, comma-separated (the first: the default)")
    ap.add_argument("--router-tiles", default=ROUTER_TILES,
                    help="router launch shapes BLOCK_K/WARPS/STAGES[/SPLIT], comma-separated ('' skips the grid)")
    ap.add_argument("--router-rows", default="1,64", help="token counts of the router grid")
    ap.add_argument("--row-blocks", default="",
                    help="rows per program to compare for the norm, QKV and SwiGLU kernels, e.g. 1,2,4,8 "
                         "(at --block-rows tokens; '' skips the sweep)")
    ap.add_argument("--block-rows", default="256,1024,4096", help="token counts of the --row-blocks sweep")
    ap.add_argument("--iters", type=int, default=30, help="timed repetitions per measurement")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved rounds of the expert-sort and FP8-expert timings (median, min, max over them)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object on stdout")
    ap.add_argument("--out", default=None, help="also write the JSON object to this file")
    return ap


def parse_points(spec: str) -> list[tuple[int, int]]:
    """'1x2048,64x2048' -> [(1, 2048), (64, 2048)]."""
    points = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        rows, _, context = item.partition("x")
        if not (rows.isdigit() and context.isdigit() and int(rows) > 0 and int(context) > 0):
            raise ValueError(f"decode point {item!r} must be ROWSxCONTEXT with positive integers, e.g. 64x2048")
        points.append((int(rows), int(context)))
    return points


# -- timing ---------------------------------------------------------------------------------------

def eager_us(fn: Callable[[], object], iters: int) -> float:
    from benchmarks.ceilings import time_cuda

    return time_cuda(fn, iters=iters, warmup=3) * 1e6


def graph_us(fns: list[Callable[[], object]], iters: int) -> float:
    """Microseconds per call of a CUDA graph holding one call of each of `fns` (warmed outside)."""
    from benchmarks.ceilings import time_cuda

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns[:2]:
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    seconds = time_cuda(graph.replay, iters=iters, warmup=3)
    del graph
    return seconds / len(fns) * 1e6


# -- per-op cases -----------------------------------------------------------------------------------

def _randn(shape, gen, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, device=gen.device, generator=gen) * scale).bfloat16()


def op_cases(cfg, rows: int, gen: torch.Generator) -> dict[str, dict[str, Any]]:
    """For each op: a factory of one input set, its minimal bytes, and the two implementations."""
    from megatron_rollout.kernels import fused
    from megatron_rollout.model.layers import rope_tables

    h, d, eps = cfg.hidden_size, cfg.kv_channels, cfg.layernorm_epsilon
    groups, per = cfg.num_query_groups, cfg.heads_per_group
    experts, topk = cfg.num_moe_experts, cfg.moe_router_topk

    def norm_set():
        return _randn((rows, h), gen), (1 + 0.1 * torch.randn(h, device=gen.device, generator=gen)).bfloat16()

    def add_set():
        w = (1 + 0.1 * torch.randn(h, device=gen.device, generator=gen)).bfloat16()
        return _randn((rows, h), gen), _randn((rows, h), gen), w

    def qkv_set():
        pos = torch.randint(0, cfg.max_position_embeddings, (rows,), device=gen.device, generator=gen)
        cos, sin = rope_tables(pos, d, cfg.rotary_base, torch.bfloat16)
        w = (1 + 0.1 * torch.randn(2, d, device=gen.device, generator=gen)).bfloat16()
        return _randn((rows, groups * (per + 2) * d), gen), cos, sin, w[0], w[1]

    def router_set():
        return _randn((rows, h), gen), _randn((experts, h), gen, 0.02)

    qkv_elems = rows * groups * (per + 2) * d
    cases = {
        "rmsnorm": dict(make=norm_set, bytes=2 * (2 * rows * h + h),
                        portable=lambda x, w: fused.rmsnorm_ref(x, w, eps),
                        fused=lambda x, w: fused.rmsnorm(x, w, eps)),
        "add_rmsnorm": dict(make=add_set, bytes=2 * (4 * rows * h + h),
                            portable=lambda a, b, w: fused.add_rmsnorm_ref(a, b, w, eps),
                            fused=lambda a, b, w: fused.add_rmsnorm(a, b, w, eps)),
        "qkv_norm_rope": dict(
            make=qkv_set, bytes=2 * (2 * qkv_elems + 2 * rows * d + 2 * d),
            portable=lambda x, c, s, qw, kw: fused.qkv_norm_rope_ref(x, groups, per, d, c, s, qw, kw, eps),
            fused=lambda x, c, s, qw, kw: fused.qkv_norm_rope(x, groups, per, d, c, s, qw, kw, eps)),
    }
    if experts:
        renorm, ffn, pairs = cfg.moe_renormalize_topk, cfg.moe_ffn_hidden_size, rows * topk
        cases["router_topk"] = dict(make=router_set, bytes=2 * (experts * h + rows * h) + rows * topk * (2 + 8),
                                    portable=lambda x, w: fused.router_ref(x, w, topk, renorm),
                                    fused=lambda x, w: fused.router_topk(x, w, topk, renorm))
        cases["silu_mul"] = dict(make=lambda: (_randn((pairs, 2 * ffn), gen),), bytes=2 * 3 * pairs * ffn,
                                 portable=fused.silu_mul_ref, fused=fused.silu_mul)  # the experts' (token, k) rows
    return cases


def time_ops(cfg, rows_list: list[int], iters: int, seed: int, device: str = "cuda") -> list[dict[str, Any]]:
    from benchmarks.compiles import CompileCounter
    from megatron_rollout.kernels import fused

    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for rows in rows_list:
        for name, case in op_cases(cfg, rows, gen).items():
            first = case["make"]()
            set_bytes = sum(t.numel() * t.element_size() for t in first)  # the inputs one call reads
            count = max(1, min(MAX_SETS, math.ceil(L2_DEFEAT_BYTES / set_bytes)))
            sets = [first] + [case["make"]() for _ in range(count - 1)]
            row: dict[str, Any] = {"op": name, "rows": rows, "sets": len(sets), "min_bytes": case["bytes"]}
            before = fused.LAUNCHES[name]
            for impl in ("portable", "fused"):
                fn = case[impl]
                fn(*first)  # compiles (fused) outside every timed region
                if device == "cuda":
                    torch.cuda.synchronize()
                with CompileCounter() as counter:
                    row[f"{impl}_eager_us"] = eager_us(lambda f=fn, a=first: f(*a), iters)
                    row[f"{impl}_graph_us"] = graph_us([lambda f=fn, a=s: f(*a) for s in sets], iters)
                row[f"{impl}_compiles"] = counter.counts.triton
            row["fused_launched"] = fused.LAUNCHES[name] > before  # the kernel ran, not its fallback
            row["graph_speedup"] = row["portable_graph_us"] / row["fused_graph_us"]
            row["fused_gb_s"] = case["bytes"] / (row["fused_graph_us"] * 1e-6) / 1e9
            out.append(row)
            log.info("%s rows=%d: portable %.1f us, fused %.1f us (graph)", name, rows, row["portable_graph_us"],
                     row["fused_graph_us"])
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


# -- the whole decode step --------------------------------------------------------------------------

def time_decode(cfg, points: list[tuple[int, int]], iters: int, seed: int, bandwidth: float) -> dict[str, Any]:
    """Graph-replayed decode steps with and without the fused ops, on one model and one cache."""
    import numpy as np

    from benchmarks import micro
    from benchmarks.bounds import model_costs
    from benchmarks.compiles import CompileCounter
    from benchmarks.random_weights import random_model
    from megatron_rollout.engine.config import RunnerConfig
    from megatron_rollout.forward import run_to_end
    from megatron_rollout.kernels import fused
    from megatron_rollout.kv.paged import PagedKVCache
    from megatron_rollout.runner.cuda import CudaRunner
    from megatron_rollout.types import Phase

    block = 16
    blocks = sum(r * math.ceil(c / block) for r, c in points) + 64
    model = random_model(cfg, torch.device("cuda"), seed)
    cache = PagedKVCache(cfg, blocks, block, cfg.num_query_groups, device="cuda")
    cache.k.normal_()
    cache.v.normal_()
    buckets = tuple(sorted({r for r, _ in points}))
    runner = CudaRunner(model, cache, RunnerConfig(graph_batch_sizes=buckets))
    costs = model_costs(cfg)
    result: dict[str, Any] = {"expert_kernels": runner.expert_kernels,
                              "runner_installed": fused.installed_backend(model)}
    for variant in ("portable", "fused"):
        fused.uninstall_fused_ops(model)
        if variant == "fused":
            result["install"] = fused.install_fused_ops(model)
        runner.drop_graphs()  # captured with the other variant's ops
        rng = np.random.default_rng(seed)
        with torch.no_grad():
            for rows, context in points:  # warm: captures (Triton compiles there) and one eager step
                inputs = micro.random_inputs([(context - 1, 1)] * rows, block, cache.num_blocks, cfg.vocab_size, rng)
                runner.decode_graph(rows)
                run_to_end(runner.forward_eager(inputs, Phase.D))
            torch.cuda.synchronize()
            with CompileCounter() as counter:
                result[variant] = micro.decode_steps(runner, costs, bandwidth, points, rng, iters=iters)
        result[f"{variant}_compiles"] = counter.counts.triton
    result["graph_speedup"] = [a["graph_ms"] / b["graph_ms"] for a, b in zip(result["portable"], result["fused"])]
    del runner, cache, model
    torch.cuda.empty_cache()
    return result


def interleaved_us(variants: dict[str, Callable[[], float]], rounds: int) -> tuple[dict[str, dict], int]:
    """Run each variant's timing (microseconds) once per round, every variant in every round, and
    summarise each by median, min and max over the rounds. A timing that raises (a capture that
    fails) is recorded as the variant's error. Returns (summaries, compilations in the timings)."""
    from benchmarks.compiles import CompileCounter

    samples: dict[str, list[float]] = {n: [] for n in variants}
    errors: dict[str, str] = {}
    compiles = 0
    for _ in range(rounds):
        for name, time_us in variants.items():
            if name in errors:
                continue
            with CompileCounter() as counter:
                try:
                    samples[name].append(time_us())
                except RuntimeError as exc:  # a finding, not the end of the run
                    errors[name] = f"{type(exc).__name__}: {exc}"[:300]
            compiles += counter.counts.total
    out = {}
    for name, v in samples.items():
        out[name] = ({"error": errors[name], "us": float("inf")} if name in errors else
                     {"us": statistics.median(v), "min_us": min(v), "max_us": max(v), "n": len(v)})
    return out, compiles


BLOCKED_OPS = {"rmsnorm": ("NORM_BLOCK_ROWS", "BLOCK_MIN_ROWS"), "add_rmsnorm": ("NORM_BLOCK_ROWS", "BLOCK_MIN_ROWS"),
               "qkv_norm_rope": ("QKV_BLOCK_TOKENS", "BLOCK_MIN_ROWS"),
               "silu_mul": ("SILU_BLOCK_ROWS", "SILU_BLOCK_MIN_ROWS")}
"""The fused ops that give a program a block of rows past a row count: (block constant, threshold)."""


@contextlib.contextmanager
def row_blocks(op: str, rows: int):
    """`kernels.fused` launching `op` with `rows` rows per program at every batch size, restored on
    exit."""
    from megatron_rollout.kernels import fused

    block, threshold = BLOCKED_OPS[op]
    names = {block: rows, threshold: 0}
    saved = {n: getattr(fused, n) for n in names}
    try:
        for n, v in names.items():
            setattr(fused, n, v)
        yield
    finally:
        for n, v in saved.items():
            setattr(fused, n, v)


def time_row_blocks(cfg, tokens_list: list[int], blocks: list[int], iters: int, seed: int,
                    rounds: int) -> list[dict[str, Any]]:
    """Graph time per call of each blocked op at each rows-per-program value, interleaved over
    `rounds`, on the same input sets."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for tokens in tokens_list:
        cases = op_cases(cfg, tokens, gen)
        for op in BLOCKED_OPS:
            if op not in cases:
                continue
            case = cases[op]
            first = case["make"]()
            set_bytes = sum(t.numel() * t.element_size() for t in first)
            count = max(1, min(MAX_SETS, math.ceil(L2_DEFEAT_BYTES / set_bytes)))
            sets = [first] + [case["make"]() for _ in range(count - 1)]
            variants = {}
            for b in blocks:
                with row_blocks(op, b):
                    case["fused"](*first)  # compiles outside the timed rounds
                variants[str(b)] = lambda b=b: _graph_us_with(op, b, case["fused"], sets, iters)
            torch.cuda.synchronize()
            timings, compiles = interleaved_us(variants, rounds)
            best = min(timings, key=lambda n: timings[n]["us"])
            row = {"op": op, "tokens": tokens, "sets": len(sets), "min_bytes": case["bytes"], "variants": timings,
                   "fastest": best, "compiles": compiles}
            out.append(row)
            log.info("row blocks %s at %d tokens: %s", op, tokens,
                     ", ".join(f"{n} {v['us']:.1f} us" for n, v in timings.items()))
    torch.cuda.empty_cache()
    return out


def _graph_us_with(op: str, rows: int, fn, sets, iters: int) -> float:
    with row_blocks(op, rows):  # the launch shape is fixed when the graph is captured
        return graph_us([lambda a=s: fn(*a) for s in sets], iters)


SORT_VARIANTS = ("one_hot", "argsort", "torch", "triton", "padded_torch", "padded_triton", "padded_one",
                 "padded_three")


def time_destinations(cfg, tokens_list: list[int], iters: int, seed: int, rounds: int) -> list[dict[str, Any]]:
    """The expert sort, graph-timed per call, in interleaved rounds: `sorted_destinations` by
    one-hot prefix sum and by stable argsort; the grouped path's whole layout (with each row's
    token) in torch (`torch`: `expert_sort.torch_layout`) and in Triton (`triton`: one launch up to
    `expert_sort.MAX_PAIRS` pairs, three past it); and the padded layout of the Triton experts
    (16-row blocks) both ways, and with each Triton path forced (`padded_one`, `padded_three`) up
    to 4 x `MAX_PAIRS` pairs. `faster` compares the unpadded variants."""
    from megatron_rollout.comm.exchange import sorted_destinations
    from megatron_rollout.kernels import expert_sort, moe_triton

    experts, topk = cfg.num_moe_experts, cfg.moe_router_topk
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = []

    def timing(call):
        call(sets[0])  # compiles outside the timed rounds
        return lambda: graph_us([lambda f=f: call(f) for f in sets], iters)

    for tokens in tokens_list:
        sets = [torch.randint(0, experts, (tokens * topk,), device="cuda", generator=gen) for _ in range(8)]
        variants = {"one_hot": timing(lambda f: sorted_destinations(f, experts, 1 << 62)),
                    "argsort": timing(lambda f: sorted_destinations(f, experts, 0))}
        if expert_sort.runnable(sets[0], experts):
            variants["torch"] = timing(lambda f: expert_sort.torch_layout(f, experts, 1, div=topk))
            variants["triton"] = timing(lambda f: expert_sort.expert_layout(f, experts, 1, div=topk))
            variants["padded_torch"] = timing(lambda f: expert_sort.torch_layout(f, experts, moe_triton.BLOCK_M))
            variants["padded_triton"] = timing(lambda f: expert_sort.expert_layout(f, experts, moe_triton.BLOCK_M))
            if tokens * topk <= 4 * expert_sort.MAX_PAIRS:  # where MAX_PAIRS is decided: each path forced
                for name, cap in (("padded_one", 1 << 62), ("padded_three", 0)):
                    variants[name] = timing(lambda f, cap=cap: expert_sort.expert_layout(
                        f, experts, moe_triton.BLOCK_M, max_pairs=cap))
        timed, compiles = interleaved_us(variants, rounds)
        unpadded = [n for n in timed if not n.startswith("padded")]
        rows.append({"tokens": tokens, "pairs": tokens * topk, "experts": experts, **timed, "compiles": compiles,
                     "faster": min(unpadded, key=lambda n: timed[n]["us"])})
    return rows


def time_router_tiles(cfg, rows_list: list[int], tiles_spec: str, iters: int, seed: int,
                      rounds: int) -> list[dict[str, Any]]:
    """`fused.router_topk` over a grid of launch shapes, graph-timed per call on inputs that
    defeat the L2 (as `time_ops`), in interleaved rounds; each shape also with top-1, whose
    difference from top-k is the cost of the top-k loop."""
    from megatron_rollout.kernels import fused

    experts, topk, renorm = cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_renormalize_topk
    grid = [fused.RouterTiles(*(int(v) for v in spec.split("/"))) for spec in tiles_spec.split(",") if spec.strip()]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for rows in rows_list:
        case = op_cases(cfg, rows, gen)["router_topk"]
        first = case["make"]()
        count = max(1, min(MAX_SETS, math.ceil(L2_DEFEAT_BYTES / sum(t.numel() * t.element_size() for t in first))))
        sets = [first] + [case["make"]() for _ in range(count - 1)]
        variants = {}
        for tiles in grid:
            for k in (topk, 1):
                name = "/".join(map(str, tiles if tiles.split > 1 else tiles[:3])) + ("" if k == topk else " top-1")
                def fn(x, w, t=tiles, k=k):
                    return fused.router_topk(x, w, k, renorm and k > 1, tiles=t)

                fn(*first)  # compiles outside the timed rounds
                variants[name] = (lambda f=fn: graph_us([lambda a=s: f(*a) for s in sets], iters))
        torch.cuda.synchronize()
        timed, compiles = interleaved_us(variants, rounds)
        out.append({"rows": rows, "experts": experts, "topk": topk, "variants": timed, "compiles": compiles,
                    "fastest": min((n for n in timed if "top-1" not in n), key=lambda n: timed[n]["us"])})
    return out


def _tiles(spec: str) -> list:
    from megatron_rollout.kernels import moe_triton

    return [moe_triton.Tiles(*map(int, t.split("/"))) for t in spec.split(",") if t.strip()]


def _random_experts(cfg, gen: torch.Generator):
    """One MoE layer's experts at the preset's sizes, random bf16 weights (scale 0.02), stacked."""
    from megatron_rollout.comm.facade import Shard
    from megatron_rollout.model.layers import Experts

    experts = Experts(cfg, Shard(), device="cuda")
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, device="cuda", generator=gen) * 0.02)
    experts.restack()
    return experts


def _routing(cfg, tokens: int, num: int, gen: torch.Generator):
    """Random inputs, distinct expert ids per token, and routing weights for `tokens` tokens."""
    x = _randn((tokens, cfg.hidden_size), gen)
    ids = torch.rand(tokens, num, device="cuda", generator=gen).topk(cfg.moe_router_topk, dim=-1).indices
    return x, ids, torch.rand(tokens, cfg.moe_router_topk, device="cuda", generator=gen).bfloat16()


def time_bf16_tiles(cfg, tokens_list: list[int], tiles_spec: str, iters: int, seed: int,
                    rounds: int) -> list[dict[str, Any]]:
    """The bf16 Triton experts (`moe_triton.routed_experts_triton`, what decode graphs run when
    `choose_small_kernels` picks Triton) per launch shape at decode sizes, graph-timed, in
    interleaved rounds: at a few rows only a few experts are active, so smaller n-tiles give more
    programs to read their weights."""
    from megatron_rollout.kernels import moe_triton

    gen = torch.Generator(device="cuda").manual_seed(seed)
    experts = _random_experts(cfg, gen)
    fc1, fc2 = experts.stacked()
    rows = []
    for tokens in tokens_list:
        x, ids, w = _routing(cfg, tokens, experts.num_local, gen)
        shapes = _tiles(tiles_spec)
        with torch.no_grad():
            outs = {t: moe_triton.routed_experts_triton(x, ids, w, fc1, fc2, 0, t).float() for t in shapes}  # compiles
            ref = outs[shapes[0]]
            variants = {t: (lambda t=t: graph_us([lambda: moe_triton.routed_experts_triton(x, ids, w, fc1, fc2, 0, t)],
                                                 iters)) for t in shapes}
            timed, compiles = interleaved_us(variants, rounds)
        entry = [{"tiles": t.__dict__, **r, "rel_err_vs_first": float((outs[t] - ref).norm() / ref.norm())}
                 for t, r in timed.items()]
        rows.append({"tokens": tokens, "compiles": compiles, "shapes": entry,
                     "best": min(entry, key=lambda r: r["us"])})
    return rows


def time_fp8_experts(cfg, tokens_list: list[int], tiles_spec: str, iters: int, seed: int,
                     rounds: int) -> list[dict[str, Any]]:
    """One MoE layer's routed experts: bf16 (`routed_experts`: its grouped GEMM at every size)
    against the FP8 Triton kernels per launch shape, on two copies of the same random experts (one
    left bf16, one quantised per tensor and stacked), in interleaved rounds. Shapes of 16-row tiles
    are timed at decode sizes only (under `moe.FP8_LARGE_ROWS` rows per expert), larger ones at
    prefill sizes."""
    from megatron_rollout.comm.facade import Shard
    from megatron_rollout.kernels import moe, moe_triton
    from megatron_rollout.model import fp8
    from megatron_rollout.model.layers import Experts

    tiles = _tiles(tiles_spec)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    bf16 = _random_experts(cfg, gen)
    quantised = Experts(cfg, Shard(), device="cuda")
    quantised.load_state_dict(bf16.state_dict())
    for e in quantised.local_experts:
        e.linear_fc1.fp8 = fp8.quantize_fp8(e.linear_fc1.weight)
        e.linear_fc2.fp8 = fp8.quantize_fp8(e.linear_fc2.weight)
    fp8.stack_experts_fp8(quantised)
    stacks = fp8.stacked_experts_fp8(quantised)
    num, topk = bf16.num_local, cfg.moe_router_topk
    rows = []
    for tokens in tokens_list:
        x, ids, w = _routing(cfg, tokens, num, gen)
        large = tokens * topk >= moe.FP8_LARGE_ROWS * num
        time_us = (lambda fn: eager_us(fn, max(3, iters // 3))) if large else (lambda fn: graph_us([fn], iters))
        shapes = [t for t in tiles if (t.block_m > 16) == large]
        with torch.no_grad():
            ref = moe.routed_experts(x, ids, w, bf16).float()
            errs = {}
            for t in shapes:  # the first call of each shape compiles it, outside the timings
                out = moe_triton.routed_experts_triton(x, ids, w, *stacks, 0, t).float()
                errs[t] = float((out - ref).norm() / ref.norm())
            fp8_call = moe_triton.routed_experts_triton
            variants = {"bf16": lambda: time_us(lambda: moe.routed_experts(x, ids, w, bf16))}
            variants.update({t: (lambda t=t: time_us(lambda: fp8_call(x, ids, w, *stacks, 0, t))) for t in shapes})
            timed, compiles = interleaved_us(variants, rounds)
        bf = timed.pop("bf16")
        entry: dict[str, Any] = {"tokens": tokens, "large": large, "compiles": compiles, "bf16_us": bf["us"],
                                 "bf16_min_us": bf.get("min_us"), "bf16_max_us": bf.get("max_us"),
                                 "fp8": [{"tiles": t.__dict__, **r, "rel_err_vs_bf16": errs[t]}
                                         for t, r in timed.items()]}
        best = min(entry["fp8"], key=lambda r: r["us"], default=None)
        entry["best"] = best and {**best, "over_bf16": best["us"] / entry["bf16_us"]}
        rows.append(entry)
    return rows


# -- output -----------------------------------------------------------------------------------------

def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'op':<14}{'rows':>6}{'portable us':>13}{'fused us':>10}{'x':>7}{'fused GB/s':>12}"
             f"{'eager p/f us':>16}  (graph times per call)"]
    for r in result.get("ops", []):
        lines.append(f"{r['op']:<14}{r['rows']:>6}{r['portable_graph_us']:>13.1f}{r['fused_graph_us']:>10.1f}"
                     f"{r['graph_speedup']:>7.2f}{r['fused_gb_s']:>12.0f}"
                     f"{r['portable_eager_us']:>8.0f}/{r['fused_eager_us']:<7.0f}")
    decode = result.get("decode") or {}
    if "portable" in decode:
        lines.append(f"{'decode step':<14}{'rows x ctx':>12}{'graph ms p -> f':>18}{'roofline':>10}{'f/roof':>8}"
                     f"{'eager ms p -> f':>18}")
        for a, b in zip(decode["portable"], decode["fused"]):
            lines.append(f"{'':<14}{a['rows']:>5} x {a['context']:<5}{a['graph_ms']:>9.3f} -> {b['graph_ms']:<6.3f}"
                         f"{b['roofline_ms']:>9.3f}{b['graph_over_roofline']:>8.2f}"
                         f"{a['eager_ms']:>10.2f} -> {b['eager_ms']:<6.2f}")
    for r in result.get("fp8_experts", []):
        b = r["best"] or {}
        lines.append(f"{'fp8 experts':<14}{r['tokens']:>6}  bf16 {r['bf16_us']:9.1f} us  best fp8 "
                     f"{b.get('us', float('nan')):9.1f} us {b.get('tiles', {})}")
    for r in result.get("bf16_experts", []):
        cells = "  ".join("{block_m}/{n_cap}/{k_cap}/{warps}/{stages}".format(**v["tiles"]) + f" {v['us']:.1f}"
                          for v in r["shapes"])
        lines.append(f"{'bf16 experts':<14}{r['tokens']:>6}  {cells}")
    for r in result.get("router_tiles", []):
        cells = "  ".join(f"{n} {v['us']:.1f}" for n, v in r["variants"].items())
        lines.append(f"{'router tiles':<14}{r['rows']:>6}  {cells}  -> {r['fastest']}")
    for r in result.get("row_blocks", []):
        cells = "  ".join(f"{n} {v['us']:.1f}" for n, v in r["variants"].items())
        lines.append(f"{'row blocks':<14}{r['tokens']:>6}  {r['op']:<14} {cells}  -> {r['fastest']}")
    for r in result.get("destinations", []):
        cells = "  ".join(f"{n} {r[n]['us']:.1f} us" for n in SORT_VARIANTS if n in r)
        lines.append(f"{'expert sort':<14}{r['tokens']:>6}  {cells}  -> {r['faster']}")
    lines.append(f"triton compilations in timed regions: {result.get('compiles_in_timed_regions', 'n/a')}"
                 f"   wall {result.get('wall_s', 0):.1f} s")
    return "\n".join(lines)


def emit(result: dict[str, Any], as_json: bool, out: str | None, stdout: TextIO, stderr: TextIO) -> None:
    """The JSON object on stdout (`as_json`) and/or in the file `out`, then the table on stderr (last,
    so that the end of the output shows it)."""
    text = json.dumps(result, default=str)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    if as_json:
        print(text, file=stdout, flush=True)
    print(format_table(result), file=stderr, flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.ceilings import copy_bandwidth
    from megatron_rollout.kernels import fused
    from megatron_rollout.model.config import preset

    cfg = preset(args.model)
    if cfg.dtype != "bfloat16":
        cfg = cfg.replace(dtype="bfloat16")
    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    points = parse_points(args.decode)
    t0 = time.perf_counter()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "triton": getattr(fused.triton, "__version__", None), "model": args.model,
                              "rows": rows, "decode_points": points}
    result["copy_bandwidth_gb_s"] = copy_bandwidth() / 1e9
    result["ops"] = time_ops(cfg, rows, args.iters, args.seed)
    result["ops_wall_s"] = time.perf_counter() - t0
    fp8_tokens = [int(t) for t in args.fp8_experts.split(",") if t.strip()]
    if fp8_tokens:
        result["fp8_experts"] = time_fp8_experts(cfg, fp8_tokens, args.fp8_tiles, args.iters, args.seed, args.rounds)
    bf16_tokens = [int(t) for t in args.bf16_experts.split(",") if t.strip()]
    if bf16_tokens and args.bf16_tiles and cfg.num_moe_experts:
        result["bf16_experts"] = time_bf16_tiles(cfg, bf16_tokens, args.bf16_tiles, args.iters, args.seed, args.rounds)
    router_rows = [int(t) for t in args.router_rows.split(",") if t.strip()]
    if args.router_tiles and router_rows and cfg.num_moe_experts:
        result["router_tiles"] = time_router_tiles(cfg, router_rows, args.router_tiles, args.iters, args.seed,
                                                   args.rounds)
    blocks = [int(b) for b in args.row_blocks.split(",") if b.strip()]
    if blocks:
        block_tokens = [int(t) for t in args.block_rows.split(",") if t.strip()]
        result["row_blocks"] = time_row_blocks(cfg, block_tokens, blocks, args.iters, args.seed, args.rounds)
    sort_tokens = [int(t) for t in args.destinations.split(",") if t.strip()]
    if sort_tokens:
        result["destinations"] = time_destinations(cfg, sort_tokens, args.iters, args.seed, args.rounds)
    if points:
        result["decode"] = time_decode(cfg, points, args.iters, args.seed, result["copy_bandwidth_gb_s"] * 1e9)
    compiles = sum(r["portable_compiles"] + r["fused_compiles"] for r in result["ops"])
    compiles += sum(r["compiles"] for r in result.get("destinations", []) + result.get("fp8_experts", [])
                    + result.get("router_tiles", []) + result.get("bf16_experts", []) + result.get("row_blocks", []))
    if points:
        compiles += result["decode"]["portable_compiles"] + result["decode"]["fused_compiles"]
    result["compiles_in_timed_regions"] = compiles
    result["wall_s"] = time.perf_counter() - t0
    return result


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.kernels needs a CUDA GPU (torch.cuda.is_available() is False here): run it on the "
                         "GPU machine, e.g. python -m benchmarks.kernels --json")
    from megatron_rollout.kernels import fused

    if not fused.triton_available():
        raise SystemExit("benchmarks.kernels needs Triton (import triton failed): pip install triton")
    parse_points(args.decode)  # a bad point fails before minutes of set-up
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    emit(run(args), args.json, args.out, sys.stdout, sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
