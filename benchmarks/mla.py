"""`python -m benchmarks.mla --out mla.json`: DeepSeek-V3 on one GPU against its rooflines.

The `deepseek-v3` preset (real widths, 6 layers: about 98 GB of bf16 weights) with random weights
drawn on the device, a paged latent cache and the CUDA runner (decode graphs, piecewise P graphs,
`kernels.mla_attention`). Three parts, each warmed before it is timed, compilations counted inside
the timed regions (must be 0):

1. `decode`: one graph-replayed decode step per (rows, context) point (`micro.decode_steps`),
   against the memory roofline: the weight bytes the step touches (attention, dense layers,
   routers, shared experts, the experts its rows route to, the output layer) plus the latent rows
   it reads, over the measured copy bandwidth (`ceilings.copy_bandwidth`).
2. `prefill`: one P forward per batch spec (`micro.prefill`: piecewise graphs where a bucket holds
   it), its FLOPs (linear layers, absorbed attention, sampled logits; `bounds.prefill_flops`) over
   the measured bf16 matmul rate.
3. `kernels`: the MLA attention kernels alone on one layer: decode at each `--decode-tiles`
   launch shape (latent bytes read / time) and prefill at each `--prefill-tiles` one (FLOPs /
   time), the outputs compared with the first shape's. Where `TritonMLA`'s defaults come from.

One JSON object (`--out`, or stdout) and a log on stderr. Left out: several GPUs, FP8, MTP.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

import numpy as np
import torch

log = logging.getLogger("benchmarks.mla")


def parse_points(text: str) -> list[tuple[int, int]]:
    """"1x2048,64x2048" -> [(1, 2048), (64, 2048)]: (rows, context) decode points."""
    points = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        rows, sep, ctx = part.partition("x")
        if not sep or not rows.isdigit() or not ctx.isdigit() or int(rows) < 1 or int(ctx) < 2:
            raise ValueError(f"decode point {part!r}: expected ROWSxCONTEXT, e.g. 64x2048 (rows >= 1, context >= 2)")
        points.append((int(rows), int(ctx)))
    return points


def parse_specs(text: str) -> list[list[tuple[int, int]]]:
    """"4096;2048+2048;4x1024" -> [[(0, 4096)], [(2048, 2048)], [(0, 1024)] * 4]: prefill batches
    of spans (cached + new), `COUNTx` repeating one span."""
    specs = []
    for part in (p.strip() for p in text.split(";") if p.strip()):
        count, _, span = part.rpartition("x")
        past, _, new = span.rpartition("+")
        try:
            k, p, n = int(count or 1), int(past or 0), int(new)
        except ValueError:
            raise ValueError(f"prefill spec {part!r}: expected [COUNTx][PAST+]NEW, e.g. 4x1024 or 2048+2048") from None
        if k < 1 or p < 0 or n < 2:
            raise ValueError(f"prefill spec {part!r}: needs count >= 1, past >= 0 and new >= 2")
        specs.append([(p, n)] * k)
    return specs


def parse_tiles(text: str, names: tuple[str, ...]) -> list[dict[str, int]]:
    """"16/32,64/32" -> [{names[0]: 16, names[1]: 32}, ...]: `TritonMLA` launch shapes."""
    tiles = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        values = part.split("/")
        if len(values) != len(names) or not all(v.isdigit() and int(v) > 0 for v in values):
            raise ValueError(f"tile {part!r}: expected {'/'.join(names)} as positive ints")
        tiles.append(dict(zip(names, map(int, values))))
    return tiles


DECODE_TILE = ("decode_block_h", "decode_block_n", "decode_warps", "decode_stages")
PREFILL_TILE = ("prefill_block_h", "prefill_block_m", "prefill_block_n", "prefill_warps", "prefill_stages")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="deepseek-v3", help="a preset with multi-latent attention")
    ap.add_argument("--layers", type=int, default=0, help="override the preset's layer count (0: keep)")
    ap.add_argument("--decode", default="1x2048,16x2048,64x2048,128x4096", help="decode points ROWSxCONTEXT")
    ap.add_argument("--prefill", default="512;2048;4096;2048+2048", help="prefill specs [COUNTx][PAST+]NEW, ';'")
    ap.add_argument("--prefill-buckets", default="512,2048,4096", help="piecewise P graph token buckets")
    ap.add_argument("--decode-tiles", default="16/32/4/2,32/32/4/2,64/32/8/2,16/64/4/2",
                    help="MLA decode launch shapes " + "/".join(DECODE_TILE))
    ap.add_argument("--prefill-tiles", default="16/64/32/8/2,16/32/32/4/2,16/128/32/8/2,32/128/32/8/2",
                    help="MLA prefill launch shapes " + "/".join(PREFILL_TILE))
    ap.add_argument("--kernel-decode", default="64x4096", help="decode point of the kernel part")
    ap.add_argument("--kernel-prefill", default="2x(2048+2048)",
                    help="prefill of the kernel part, COUNTx(PAST+NEW)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-gb", type=float, default=8.0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    return ap


def _kernel_part(runner, args, rng: np.random.Generator) -> dict[str, Any]:
    """The MLA kernels alone on layer 0, at each launch shape; outputs compared with the first's."""
    from benchmarks import micro
    from benchmarks.ceilings import time_cuda
    from benchmarks.compiles import CompileCounter
    from megatron_rollout.kernels.layout import KernelPagedBatch, build_layout
    from megatron_rollout.kernels.mla_attention import TritonMLA

    cfg, cache, dev = runner.cfg, runner.cache, runner.device
    heads, r, width = runner.q_heads, cfg.kv_lora_rank, cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim
    (rows, ctx), = parse_points(args.kernel_decode)
    (pre,) = parse_specs(args.kernel_prefill.replace("(", "").replace(")", ""))
    result: dict[str, Any] = {}
    for part, spec, tiles in (("decode", [(ctx - 1, 1)] * rows, parse_tiles(args.decode_tiles, DECODE_TILE)),
                              ("prefill", pre, parse_tiles(args.prefill_tiles, PREFILL_TILE))):
        inputs = micro.random_inputs(spec, cache.block_size, cache.num_blocks, cfg.vocab_size, rng)
        n = sum(p.span.new for p in inputs)
        gen = torch.Generator(device=dev).manual_seed(n)
        q = torch.randn(n, heads, width, device=dev, dtype=cfg.torch_dtype, generator=gen)
        row = torch.randn(n, 1, width, device=dev, dtype=cfg.torch_dtype, generator=gen)
        if part == "decode":
            work = {"kv_bytes": sum(p + m for p, m in spec) * width * cache.k.element_size()}
        else:
            pairs = sum(m * p + m * (m + 1) / 2 for p, m in spec)
            work = {"flops": pairs * heads * (2 * width + 2 * r)}
        rows_out: dict[str, Any] = {}
        first = None
        for tile in tiles:
            name = "/".join(str(v) for v in tile.values())
            kernels = TritonMLA(r)
            for key, value in tile.items():
                setattr(kernels, key, value)
            try:
                layout = build_layout([i.span for i in inputs], [i.token_ids for i in inputs], [True] * len(inputs),
                                      cache.block_size, kernels, heads, 1, r, dev, runner.num_sms)
                batch = KernelPagedBatch(cache, layout, kernels)
                out = batch.attend(0, q, row, row)[..., :r].float()  # compiles, outside the count
                with CompileCounter() as counter:
                    seconds = time_cuda(lambda b=batch: b.attend(0, q, row, row), iters=args.iters)
            except Exception as exc:  # a launch shape that does not build here is a result, not a failure
                rows_out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                continue
            got = {"ms": seconds * 1e3, "compiles": counter.counts.total}
            got.update({"gb_per_s": work["kv_bytes"] / seconds / 1e9} if "kv_bytes" in work
                       else {"tflops": work["flops"] / seconds / 1e12})
            if first is None:
                first = out
            else:
                got["rel_err_vs_first"] = float((out - first).norm() / first.norm().clamp_min(1e-30))
            rows_out[name] = got
            log.info("mla %s %s: %.3f ms", part, name, seconds * 1e3)
        timed = {k: v for k, v in rows_out.items() if "ms" in v}
        result[part] = {"spec": f"{len(spec)}x({spec[0][0]}+{spec[0][1]})", **work, "tiles": rows_out,
                        "best": min(timed, key=lambda k: timed[k]["ms"]) if timed else None}
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks import micro
    from benchmarks.bounds import model_costs
    from benchmarks.ceilings import copy_bandwidth, matmul_rate
    from benchmarks.random_weights import random_model
    from megatron_rollout.kv.paged import PagedKVCache
    from megatron_rollout.model.config import preset
    from megatron_rollout.runner.config import RunnerConfig
    from megatron_rollout.runner.cuda import CudaRunner

    cfg = preset(args.model).replace(dtype="bfloat16")  # the graphed paths are bf16
    if args.layers:
        cfg = cfg.replace(num_layers=args.layers, moe_layer_freq=cfg.moe_layer_freq[:args.layers])
    if not cfg.multi_latent_attention:
        raise SystemExit(f"--model {args.model} has no multi-latent attention; benchmarks.mla measures MLA models")
    points, specs = parse_points(args.decode), parse_specs(args.prefill)
    device = torch.device("cuda")
    bandwidth, peak = copy_bandwidth(device), matmul_rate(device)
    torch.cuda.empty_cache()
    model = random_model(cfg, device, seed=args.seed)
    blocks = int(args.kv_gb * 2 ** 30 // PagedKVCache.bytes_per_block(cfg, args.block_size, 1))
    cache = PagedKVCache(cfg, blocks, args.block_size, 1, device=device)
    cache.k.normal_()
    buckets = tuple(sorted({r for r, _ in points} | {1}))
    tokens = tuple(int(t) for t in args.prefill_buckets.split(",") if t.strip())
    runner = CudaRunner(model, cache, RunnerConfig(graph_batch_sizes=buckets, prefill_graph_tokens=tokens))
    if not runner.graph_safe:
        raise SystemExit(f"--model {args.model}: the MoE layers are not graph-safe here, nothing to measure")
    costs = model_costs(cfg)
    rng = np.random.default_rng(args.seed)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
        "layers": cfg.num_layers, "params_b": sum(p.numel() for p in model.parameters()) / 1e9,
        "kv_blocks": blocks, "block_size": args.block_size, "copy_bandwidth_gb_s": bandwidth / 1e9,
        "matmul_tflops": peak / 1e12, "attention": type(runner.kernels).__name__,
        "graph_safe": runner.graph_safe, "expert_kernels": runner.expert_kernels}
    log.info("%s: %.1fB parameters, %d KV blocks, copy %.0f GB/s, matmul %.0f TFLOP/s", args.model,
             result["params_b"], blocks, bandwidth / 1e9, peak / 1e12)
    with torch.no_grad():
        result["decode"] = micro.decode_steps(runner, costs, bandwidth, points, rng, iters=args.iters)
        result["prefill"] = micro.prefill(runner, costs, peak, specs, rng, rounds=args.rounds)
        result["kernels"] = _kernel_part(runner, args, rng)
    result["capture_error"] = runner.capture_error
    result["prefill_capture_error"] = runner.prefill_capture_error
    result["compiles_in_timed_regions"] = (sum(d["compiles"] for d in result["decode"])
                                           + sum(p["compiles"] for p in result["prefill"])
                                           + sum(t.get("compiles", 0) for part in result["kernels"].values()
                                                 for t in part["tiles"].values()))
    return result


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    parse_points(args.decode), parse_specs(args.prefill)  # bad arguments fail before any set-up
    parse_points(args.kernel_decode), parse_specs(args.kernel_prefill.replace("(", "").replace(")", ""))
    parse_tiles(args.decode_tiles, DECODE_TILE), parse_tiles(args.prefill_tiles, PREFILL_TILE)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.mla needs a CUDA GPU: run it on the GPU machine")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    text = json.dumps(run(args), indent=1, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
