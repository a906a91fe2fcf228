"""Paged attention kernels side by side on the model's shapes: every backend that runs here, and
the Triton prefill kernel over a grid of launch settings (key block, pipeline stages, warps).

    python -m benchmarks.attention --out attention.json

For each shape (prefill spans `(cached, new)` and decode rows) and each variant: the median of
`--iters` CUDA-event timed calls of `KernelPagedBatch.attend` (decode shapes: replays of a CUDA
graph of `GRAPH_CALLS` calls, per call, since an eager decode call is bound by the host's
launches) on layer 0 of a random paged cache
(random block tables, so pages are scattered as in a real pool), the FLOP rate (prefill: 4 x
query-key pairs x query heads x head dim; decode: KV bytes read per second), the relative error
against the Triton default, and the Triton compilations counted inside the timed calls (a
variant is compiled by an untimed call first; the count must be 0). Variants are timed in
interleaved rounds (`--rounds`), so clock drift hits all alike; the JSON has every round.
`best` names the fastest Triton setting per shape (prefill shapes cross `--block-n`, `--stages`,
`--warps`; decode shapes cross the `--decode-*` lists when `--decode-block-n` is given):
`TritonAttention`'s defaults are chosen from it.

Verify shapes (`--verify`, `COUNTx(CACHED+QUERIES)`: COUNT rows, each a pending token and
QUERIES - 1 drafts after CACHED positions) time speculative decoding's verify attention as its
graphs run it: one-query rows (`runner.speculative.flatten`) in a `StaticDecodeLayout`, each row
alone (`max_run` 1: a row's history read QUERIES times) against runs (`max_run` 8: read once);
`kv_bytes` counts one read. `--verify-block-n` (with `--verify-stages`, `--verify-warps`,
`--verify-programs`) adds the runs under each setting of that grid (`TritonAttention.verify_*`),
and `best_verify` names the fastest per shape.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from benchmarks.ceilings import time_cuda
from benchmarks.compiles import CompileCounter
from benchmarks.kernels import graph_us

GRAPH_CALLS = 10
"""Decode calls per captured CUDA graph: decode shapes are timed as graph replays (per call)."""
PREFILL = ("1x(0+4096)", "8x(2048+512)", "4x(2048+1024)", "1x(0+512)")
DECODE = ("64x(2047+1)", "1x(2047+1)")
VERIFY = ("12x(16384+5)", "32x(4096+5)", "64x(2048+3)")


def parse_shape(text: str) -> list[tuple[int, int]]:
    """'8x(2048+512)' -> eight spans of 2048 cached and 512 new positions."""
    count, _, rest = text.partition("x(")
    past, _, new = rest.rstrip(")").partition("+")
    try:
        spec = [(int(past), int(new))] * int(count)
    except ValueError:
        raise ValueError(f"shape {text!r} is not COUNTx(CACHED+NEW), e.g. 8x(2048+512)") from None
    if not spec or any(p < 0 or n < 1 for p, n in spec):
        raise ValueError(f"shape {text!r}: need a count >= 1, cached >= 0, new >= 1")
    return spec


def pairs(spec: list[tuple[int, int]]) -> int:
    """Query-key pairs a causal pass over the spans computes."""
    return sum(n * p + n * (n + 1) // 2 for p, n in spec)


def triton_settings(block_n: list[int], stages: list[int], warps: list[int], phase: str = "prefill",
                    programs: list[int] | None = None) -> list[dict[str, int]]:
    """The grid of `TritonAttention` launch settings for `phase` ("prefill", "decode" or "verify";
    the last two also cross `programs`, the programs per SM that set the KV splits)."""
    grid = [{f"{phase}_block_n": b, f"{phase}_stages": s, f"{phase}_warps": w}
            for b, s, w in itertools.product(block_n, stages, warps)]
    if phase in ("decode", "verify"):
        grid = [{**g, f"{phase}_programs_per_sm": p} for g in grid for p in (programs or [8])]
    return grid


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default="32,4,128", help="query heads, kv heads, head dim (default: qwen3-30b-a3b)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefill", default=",".join(PREFILL), help="prefill shapes, COUNTx(CACHED+NEW)")
    p.add_argument("--decode", default=",".join(DECODE), help="decode shapes")
    p.add_argument("--block-n", default="64,128", help="Triton prefill key blocks to try")
    p.add_argument("--stages", default="2,3,4", help="Triton prefill pipeline stages to try")
    p.add_argument("--warps", default="4,8", help="Triton prefill warps to try")
    p.add_argument("--tile-order", default="heavy", help="Triton prefill tile orders to try: heavy (heaviest "
                   "first, the default) and/or span (span by span, ascending)")
    p.add_argument("--decode-block-n", default="", help="Triton decode key blocks to try ('' = no decode grid)")
    p.add_argument("--decode-stages", default="2,3,4")
    p.add_argument("--decode-warps", default="4,8")
    p.add_argument("--decode-programs", default="8", help="decode programs per SM to try (sets the KV splits)")
    p.add_argument("--verify", default=",".join(VERIFY), help="verify shapes, COUNTx(CACHED+QUERIES) ('' = none)")
    p.add_argument("--verify-block-n", default="", help="Triton key blocks to try for the runs ('' = no verify grid)")
    p.add_argument("--verify-stages", default="2,3")
    p.add_argument("--verify-warps", default="4,8")
    p.add_argument("--verify-programs", default="4", help="programs per SM to try for the runs (sets their splits)")
    p.add_argument("--backends", default="triton,varlen", help="backends besides the Triton grid")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON here (default: stdout)")
    return p


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


class Case:
    """One shape's inputs on a cache large enough for it."""

    def __init__(self, spec: list[tuple[int, int]], hq: int, hkv: int, d: int, block_size: int,
                 rng: np.random.Generator) -> None:
        from megatron_rollout.kv.paged import SeqSpan

        self.spec, self.hq, self.hkv, self.d, self.block_size = spec, hq, hkv, d, block_size
        need = [-(-(p + n) // block_size) for p, n in spec]
        blocks = sum(need) + 8
        perm = rng.permutation(blocks)
        self.spans, at = [], 0
        for (past, new), k in zip(spec, need):
            self.spans.append(SeqSpan(tuple(int(b) for b in perm[at:at + k]), past, new))
            at += k
        gen = torch.Generator(device="cuda").manual_seed(int(rng.integers(1 << 31)))
        dt = torch.bfloat16
        self.k_cache = torch.randn(1, blocks * block_size, hkv, d, device="cuda", dtype=dt, generator=gen)
        self.v_cache = torch.randn(1, blocks * block_size, hkv, d, device="cuda", dtype=dt, generator=gen)
        n = sum(new for _, new in spec)
        self.q = torch.randn(n, hq, d, device="cuda", dtype=dt, generator=gen)
        self.k = torch.randn(n, hkv, d, device="cuda", dtype=dt, generator=gen)
        self.v = torch.randn(n, hkv, d, device="cuda", dtype=dt, generator=gen)

    def batch(self, kernels):
        from megatron_rollout.kernels.layout import KernelPagedBatch, build_layout

        cache = types.SimpleNamespace(k=self.k_cache, v=self.v_cache, block_size=self.block_size)
        layout = build_layout(self.spans, [[0] * s.new for s in self.spans], [True] * len(self.spans),
                              self.block_size, kernels, self.hq, self.hkv, self.d, torch.device("cuda"))
        return KernelPagedBatch(cache, layout, kernels)

    def verify_batch(self, max_run: int, kernels=None):
        """The spans as a verify graph lays them out: one-query rows, runs up to `max_run`
        (`kernels`: a `TritonAttention` with its settings; None: the defaults)."""
        from megatron_rollout.kernels.layout import KernelPagedBatch, StaticDecodeLayout
        from megatron_rollout.kernels.triton_attention import TritonAttention
        from megatron_rollout.types import SeqSpan

        rows = [SeqSpan(s.table, s.past + j, 1) for s in self.spans for j in range(s.new)]
        kernels = kernels or TritonAttention()
        static = StaticDecodeLayout(len(rows), max(len(s.table) for s in self.spans), self.block_size, kernels,
                                    self.hq, self.hkv, self.d, torch.device("cuda"),
                                    torch.cuda.get_device_properties(0).multi_processor_count, max_run=max_run)
        static.fill(rows, [0] * len(rows), runs=[s.new for s in self.spans])
        cache = types.SimpleNamespace(k=self.k_cache, v=self.v_cache, block_size=self.block_size)
        return KernelPagedBatch(cache, static.layout, kernels)

    def work(self) -> dict[str, float]:
        if all(n == 1 for _, n in self.spec):
            kv = sum(p + n for p, n in self.spec) * self.hkv * self.d * 2 * 2
            return {"kv_bytes": kv}
        return {"flops": 4.0 * pairs(self.spec) * self.hq * self.d}


def _variants(backends: list[str], grid: list[dict[str, int]]) -> list[tuple[str, Any]]:
    from megatron_rollout.kernels.registry import resolve_attention
    from megatron_rollout.kernels.triton_attention import TritonAttention

    out: list[tuple[str, Any]] = [(name, resolve_attention(name, "cuda")) for name in backends]
    for setting in grid:
        k = TritonAttention()
        for attr, value in setting.items():
            setattr(k, attr, value)
        out.append(("triton " + " ".join(f"{a.split('_')[-1]}={v}" for a, v in setting.items()), k))
    return out


def _timed(case: Case, builders: dict[str, Callable[[], Any]], iters: int, rounds: int, graphed: bool
           ) -> tuple[dict[str, torch.Tensor], dict[str, list[float]], dict[str, int], dict[str, str]]:
    """Build each variant's batch and call it once (compiles, untimed; one that fails is recorded,
    not the end of the sweep), then time them all in interleaved rounds, as CUDA-graph replays of
    `GRAPH_CALLS` calls per call (`graphed`: decode, a few us of GPU per call, under the host's
    launch time) or event-timed calls. Returns (outputs, seconds of each round, compilations
    inside the timed calls, errors), by variant."""
    batches, outputs, errors = {}, {}, {}
    for name, build in builders.items():
        try:
            batches[name] = build()
            outputs[name] = batches[name].attend(0, case.q, case.k, case.v).float()
            torch.cuda.synchronize()
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"[:300]
            batches.pop(name, None)
    samples: dict[str, list[float]] = {n: [] for n in batches}
    compiles = {n: 0 for n in batches}
    for _ in range(rounds):
        for name, batch in batches.items():
            def call(b=batch):
                return b.attend(0, case.q, case.k, case.v)

            with CompileCounter() as counter:
                samples[name].append(graph_us([call] * GRAPH_CALLS, iters) / 1e6 if graphed
                                     else time_cuda(call, iters=iters))
            compiles[name] += counter.counts.total
    return outputs, samples, compiles, errors


def measure(case: Case, variants: list[tuple[str, Any]], iters: int, rounds: int) -> dict[str, Any]:
    work = case.work()
    outputs, samples, compiles, errors = _timed(case, {name: (lambda k=kernels: case.batch(k))
                                                       for name, kernels in variants},
                                                iters, rounds, graphed="kv_bytes" in work)
    ref = outputs.get(variants[0][0])
    rows = {}
    for name, times in samples.items():
        med = statistics.median(times)
        row: dict[str, Any] = {"ms": med * 1e3, "rounds_ms": [t * 1e3 for t in times], "compiles": compiles[name]}
        if "flops" in work:
            row["tflops"] = work["flops"] / med / 1e12
        else:
            row["gb_per_s"] = work["kv_bytes"] / med / 1e9
        if ref is not None:
            row["rel_err_vs_first"] = float((outputs[name] - ref).norm() / ref.norm().clamp_min(1e-30))
        rows[name] = row
    return {"spec": case.spec[0], "count": len(case.spec), **work, "variants": rows, "errors": errors}


def measure_verify(case: Case, iters: int, rounds: int, grid: list[dict[str, int]] = ()) -> dict[str, Any]:
    """Verify attention with each row alone (`max_run` 1) and in runs (`max_run` 8, the default
    settings and each of `grid`'s), graph-timed in interleaved rounds; each output against the rows'
    alone."""
    builders = {f"max_run={m}": (lambda m=m: case.verify_batch(m)) for m in (1, 8)}
    builders |= {f"max_run=8 {name}": (lambda k=kernels: case.verify_batch(8, k))
                 for name, kernels in _variants([], grid)}
    outputs, samples, compiles, errors = _timed(case, builders, iters, rounds, graphed=True)
    if {"max_run=1", "max_run=8"} - set(outputs):  # the reference pair itself must run
        raise RuntimeError(f"verify attention at {case.spec[0]} x {len(case.spec)} failed: {errors}")
    alone = outputs["max_run=1"]
    kv = sum(p + n for p, n in case.spec) * case.hkv * case.d * 2 * 2  # each row's history, read once
    ms = {n: statistics.median(t) * 1e3 for n, t in samples.items()}
    err = {n: float((o - alone).norm() / alone.norm().clamp_min(1e-30)) for n, o in outputs.items()}
    return {"spec": case.spec[0], "count": len(case.spec), "kv_bytes": kv, "compiles": sum(compiles.values()),
            "variants": {n: {"ms": ms[n], "rounds_ms": [t * 1e3 for t in samples[n]], "gb_per_s": kv / ms[n] / 1e6,
                             "rel_err_vs_alone": err[n]} for n in ms},
            "alone_over_runs": ms["max_run=1"] / ms["max_run=8"],
            "rel_err_runs_vs_alone": err["max_run=8"], "errors": errors}


def run(args: argparse.Namespace) -> dict[str, Any]:
    hq, hkv, d = _ints(args.heads)
    rng = np.random.default_rng(args.seed)
    backends = [b for b in args.backends.split(",") if b.strip()]
    grid = triton_settings(_ints(args.block_n), _ints(args.stages), _ints(args.warps))
    orders = [o.strip() for o in args.tile_order.split(",") if o.strip()]
    if not orders or set(orders) - {"heavy", "span"}:
        raise SystemExit(f"--tile-order takes heavy and/or span, got {args.tile_order!r}")
    if orders != ["heavy"]:
        grid = [{**g, "prefill_heavy_first": o == "heavy"} for g in grid for o in orders]
    decode_grid = (triton_settings(_ints(args.decode_block_n), _ints(args.decode_stages), _ints(args.decode_warps),
                                   "decode", _ints(args.decode_programs)) if args.decode_block_n.strip() else [])
    verify_grid = (triton_settings(_ints(args.verify_block_n), _ints(args.verify_stages), _ints(args.verify_warps),
                                   "verify", _ints(args.verify_programs)) if args.verify_block_n.strip() else [])
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "heads": [hq, hkv, d], "block_size": args.block_size, "iters": args.iters,
                              "rounds": args.rounds, "shapes": {}, "best": {}}
    shapes = [(s, True) for s in args.prefill.split(",") if s.strip()]
    shapes += [(s, False) for s in args.decode.split(",") if s.strip()]
    for text, prefill in shapes:
        case = Case(parse_shape(text), hq, hkv, d, args.block_size, rng)
        got = measure(case, _variants(backends, grid if prefill else decode_grid), args.iters, args.rounds)
        result["shapes"][text] = got
        tri = {n: v for n, v in got["variants"].items() if n.startswith("triton ")}
        if tri:
            result["best"][text] = min(tri, key=lambda n: tri[n]["ms"])
        print(text, {n: round(v["ms"], 4) for n, v in got["variants"].items()}, file=sys.stderr, flush=True)
        del case
        torch.cuda.empty_cache()
    for text in [s for s in args.verify.split(",") if s.strip()]:
        case = Case(parse_shape(text), hq, hkv, d, args.block_size, rng)
        got = result.setdefault("verify", {})[text] = measure_verify(case, args.iters, args.rounds, verify_grid)
        result.setdefault("best_verify", {})[text] = min(got["variants"], key=lambda n: got["variants"][n]["ms"])
        print(text, {n: round(v["ms"], 4) for n, v in got["variants"].items()}, file=sys.stderr, flush=True)
        del case
        torch.cuda.empty_cache()
    result["compiles_in_timed_regions"] = (sum(v["compiles"] for s in result["shapes"].values()
                                               for v in s["variants"].values())
                                           + sum(v["compiles"] for v in result.get("verify", {}).values()))
    return result


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    for text in [s for s in (args.prefill + "," + args.decode + "," + args.verify).split(",") if s.strip()]:
        parse_shape(text)  # a bad shape fails before any set-up
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.attention needs a CUDA GPU: run it on the GPU machine")
    result = run(args)
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

