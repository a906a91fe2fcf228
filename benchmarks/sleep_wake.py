"""Memory handed back between rollouts, measured: `engine.sleep()` and `engine.wake_up()` at full size.

    python -m benchmarks.sleep_wake --out benchmarks/results/sleep-wake          # one H200, both paths
    python -m benchmarks.sleep_wake --tags all --out benchmarks/results/sleep-wake-all
    python -m benchmarks.sleep_wake --model tiny-moe --device cpu --cycles 1    # smoke

A preset model with random weights (`--model`, drawn on the device) and a KV cache of `--kv-gb`
GiB are built; every decode and prefill graph bucket is captured; a greedy batch is generated.
Then, `--cycles` times: sleep `--tags` (default `kv,weights`: the graphs sleep with them where
their memory is re-allocated, and stay where it is address-stable; `all` adds the graphs
themselves), wake every tag, generate the batch again. This runs once per memory kind in
`--stable-memory` (default on CUDA: "on", the address-stable `vmm` path, then "off", the
`reallocate`/`offload` path; one engine at a time), so the two paths' seconds sit side by side.
On the `vmm` path the first cycle moves the weights into address-stable memory (graphs captured
again, once); the later cycles show the steady state.

Reported per cycle: the device's free bytes before and after the sleep and after the wake
(`torch.cuda.mem_get_info`: what a trainer sharing the GPU would see), the engine's own report
(per tag: its path, tensor bytes, the change of allocated and reserved bytes), how long the sleep
and the wake took, how many graphs were captured between the sleep and the end of the batch after
the wake (0: the graphs stayed valid), whether the graph buckets are the same, whether that batch
replayed decode graphs, and whether its tokens equal the first batch's. Written to
`<out>/sleep_wake.json` (and printed), one entry per KV memory under "runs". Left out: several
ranks (graphs are captured collectively there, at the first decode step after the wake), and a
trainer actually using the freed memory.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import time
from pathlib import Path

import torch

from benchmarks.rollout import random_model
from megatron_rollout.engine import EngineConfig, KVConfig, RolloutEngine, SamplingParams, SchedulerConfig
from megatron_rollout.kv.paged import PagedKVCache
from megatron_rollout.model.config import preset

log = logging.getLogger("benchmarks.sleep_wake")

GIB = 2 ** 30


def free_bytes(device: torch.device) -> int | None:
    """Free device memory as the driver reports it (None off CUDA)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]


def _gib(n: int | None) -> float | None:
    return None if n is None else n / GIB


def _batch(vocab: int, rows: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (rows, length), generator=gen).tolist()


def run(model_name: str, device: str, kv_gb: float = 16.0, cycles: int = 3, rows: int = 32, prompt_len: int = 256,
        new_tokens: int = 64, num_blocks: int | None = None, stable_memory: str = "auto",
        tags: tuple[str, ...] | None = None) -> dict:
    """One engine, `cycles` sleep/wake cycles of `tags` (None: all) with its KV memory `stable_memory`."""
    dev = torch.device(device)
    cfg = preset(model_name)
    block_size = 16
    blocks = num_blocks or int(kv_gb * GIB // PagedKVCache.bytes_per_block(cfg, block_size, cfg.num_query_groups))
    start = time.perf_counter()
    model = random_model(cfg, dev, seed=0)
    engine = RolloutEngine(model, EngineConfig(scheduler=SchedulerConfig(block_size=block_size),
                                               kv=KVConfig(num_blocks=blocks, stable_memory=stable_memory)))
    capture = getattr(engine.runner, "capture", None)
    if capture is not None:  # every bucket, as a long rollout would have captured: the pools at full size
        capture()
    built_s = time.perf_counter() - start
    log.info("model, engine and graphs built in %.1f s: %s", built_s, engine.runner.captured.describe())
    prompts = _batch(cfg.vocab_size, rows, prompt_len, seed=1)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    first = engine.generate(prompts, params)
    stats = getattr(engine.runner, "stats", {})
    out: dict = {"model": model_name, "device": str(dev), "stable_memory": stable_memory,
                 "kv_stable": engine.memory.kv_stable, "tags": sorted(tags) if tags else "all",
                 "kv_blocks": blocks, "kv_gib": None, "build_s": built_s,
                 "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                 "graphs": engine.runner.captured._asdict(), "batch": {"rows": rows, "prompt_tokens": prompt_len,
                                                                        "new_tokens": new_tokens}, "cycles": []}
    cache = engine.runner.cache
    out["kv_gib"] = (cache.k.nbytes + (cache.v.nbytes if cache.v is not cache.k else 0)) / GIB
    for cycle in range(cycles):
        held = engine.runner.captured
        awake = free_bytes(dev)
        t0 = time.perf_counter()
        captures = stats.get("graph_captures")
        slept = engine.sleep(tags)
        sleep_s = time.perf_counter() - t0
        asleep = free_bytes(dev)
        t0 = time.perf_counter()
        woke = engine.wake_up()
        wake_s = time.perf_counter() - t0
        rewoken = free_bytes(dev)
        replays = stats.get("graph_replays")
        again = engine.generate(prompts, params)
        record = {
            "free_gib": {"awake": _gib(awake), "asleep": _gib(asleep), "woken": _gib(rewoken)},
            "freed_gib": None if awake is None else (asleep - awake) / GIB,
            "retaken_gib": None if awake is None else (asleep - rewoken) / GIB,
            "sleep_s": sleep_s, "wake_s": wake_s, "sleep": slept, "wake": woke,
            "paths": {tag: r["path"] for tag, r in slept["tags"].items() if r["path"] is not None},
            "graph_captures": None if captures is None else stats["graph_captures"] - captures,
            "same_graph_buckets": engine.runner.captured == held,
            "graph_replays_after_wake": None if replays is None else stats["graph_replays"] - replays,
            "tokens_match": [r.token_ids for r in again] == [r.token_ids for r in first],
            "max_logprob_diff": max(abs(a - b) for x, y in zip(again, first) for a, b in zip(x.logprobs, y.logprobs)),
        }
        out["cycles"].append(record)
        log.info("%s cycle %d: freed %s GiB in %.2f s, re-took %s GiB in %.2f s, %s graphs captured, tokens "
                 "match: %s", record["paths"], cycle, record["freed_gib"], sleep_s, record["retaken_gib"], wake_s,
                 record["graph_captures"], record["tokens_match"])
    out["ok"] = all(c["tokens_match"] and c["same_graph_buckets"] for c in out["cycles"]) and \
        all(c["graph_replays_after_wake"] is None or c["graph_replays_after_wake"] > 0 for c in out["cycles"])
    out["total_s"] = time.perf_counter() - start
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b-12l")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--kv-gb", type=float, default=16.0, help="KV cache size in GiB (CUDA)")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV blocks (overrides --kv-gb)")
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--tags", default="kv,weights", help="tags to sleep, comma-separated, or 'all'")
    parser.add_argument("--stable-memory", default=None,
                        help="KV memories to run, comma-separated, of auto/on/off (default: on,off on CUDA; off)")
    parser.add_argument("--out", type=Path, default=None, help="folder for sleep_wake.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.cycles < 1:
        parser.error(f"--cycles must be >= 1, got {args.cycles}")
    # on CPU, just the blocks the batch needs (--kv-gb sizes a device's cache)
    blocks = args.num_blocks or (args.rows * -(-(args.prompt_len + args.new_tokens) // 16) if args.device == "cpu"
                                 else None)
    modes = (args.stable_memory or ("on,off" if args.device.startswith("cuda") else "off")).split(",")
    tags = None if args.tags == "all" else tuple(args.tags.split(","))
    runs = []
    for mode in modes:  # one engine at a time: the previous one is freed before the next is built
        runs.append(run(args.model, args.device, args.kv_gb, args.cycles, args.rows, args.prompt_len,
                        args.new_tokens, blocks, mode, tags))
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    result = {"runs": runs, "ok": all(r["ok"] for r in runs),
              "seconds": {r["stable_memory"]: {"sleep_s": [c["sleep_s"] for c in r["cycles"]],
                                               "wake_s": [c["wake_s"] for c in r["cycles"]]} for r in runs}}
    text = json.dumps(result, indent=1)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sleep_wake.json").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
