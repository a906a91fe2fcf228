"""The resharding path's speed: a TP/EP-sharded Megatron trainer's weights gathered into full rollout
tensors (`megatron_rollout.weights.megatron_reshard.gather_megatron_state`), bytes and GB/s.

`--ranks` processes form one world: gloo on CPU (the default), NCCL with one GPU per rank
(`--backend nccl`). Each rank holds Megatron's slices of the preset's model in its dtype (values are
ones: the bandwidth does not depend on them; `gather_megatron_state` still checks every full shape),
with TP and EP each either the whole world or 1 (`--tp`, `--ep`). One warm-up gather, then
`--repeats` timed ones; reported per rank: bytes gathered (every rank receives the whole model's split
tensors), buckets, and the best and median seconds and GB/s (bytes gathered / seconds).

    python -m benchmarks.reshard --model qwen3-30b-a3b --layers 1 --ranks 2 --tp 2 --ep 2
    python -m benchmarks.reshard --backend nccl --model qwen3-30b-a3b --ranks 8 --tp 8 --ep 8   # GPU

Left out: Megatron's own process-group layout for TP x EP x DP worlds (here TP and EP each span the
world or one rank), and the copy into the engine that follows (`benchmarks.hotswap` measures it).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch

from megatron_rollout.model.config import ModelConfig, preset
from megatron_rollout.model.sharding import full_shapes
from megatron_rollout.weights.megatron_reshard import DEFAULT_BUCKET_BYTES, gather_megatron_state, megatron_local_state

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReshardBenchConfig:
    model: str = "qwen3-30b-a3b"
    """Model preset (its dtype is the trainer's)."""
    num_layers: int = 1
    """Leading layers of the preset to build."""
    ranks: int = 2
    """Processes in the world."""
    tp: int = 2
    """Megatron TP: the world's size or 1."""
    ep: int = 2
    """Megatron EP: the world's size or 1."""
    backend: str = "gloo"
    """gloo (CPU tensors) or nccl (one CUDA device per rank)."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Bytes per rank per collective."""
    repeats: int = 3
    """Timed gathers after one warm-up."""

    def __post_init__(self) -> None:
        cfg = self.model_config()
        if self.ranks < 2:
            raise ValueError(f"ranks must be at least 2 (one rank gathers nothing), got {self.ranks}")
        for name in ("tp", "ep"):
            if getattr(self, name) not in (1, self.ranks):
                raise ValueError(f"{name} must be 1 or ranks ({self.ranks}), got {getattr(self, name)}")
        if self.tp == self.ep == 1:
            raise ValueError("tp and ep are both 1: nothing is sharded, nothing to gather")
        if cfg.num_moe_experts % self.ep or cfg.vocab_size % self.tp or cfg.num_query_groups % self.tp:
            raise ValueError(f"{self.model} does not split {self.tp} ways over TP and {self.ep} over EP")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {self.backend!r}")
        if self.repeats < 1 or self.bucket_bytes <= 0:
            raise ValueError(f"need repeats >= 1 and bucket_bytes > 0, got {self.repeats}, {self.bucket_bytes}")

    def model_config(self) -> ModelConfig:
        cfg = preset(self.model)
        freq = cfg.moe_layer_freq[:self.num_layers]
        if not 0 < self.num_layers <= cfg.num_layers:
            raise ValueError(f"num_layers must be in [1, {cfg.num_layers}] for {self.model}, got {self.num_layers}")
        return cfg.replace(num_layers=self.num_layers, moe_layer_freq=freq)


def _rank(rank: int, port: int, config: ReshardBenchConfig, queue) -> None:
    import time

    import torch.distributed as dist

    try:
        device = torch.device("cuda", rank) if config.backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(config.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=config.ranks, timeout=timedelta(seconds=300))
        cfg = config.model_config()
        full = {n: torch.empty(s, dtype=cfg.torch_dtype, device="meta") for n, s in full_shapes(cfg).items()}
        meta = megatron_local_state(full, cfg, rank if config.tp > 1 else 0, config.tp,
                                    rank if config.ep > 1 else 0, config.ep)
        local = {n: torch.ones(t.shape, dtype=t.dtype, device=device) for n, t in meta.items()}
        world, alone = dist.group.WORLD, [dist.new_group([r]) for r in range(config.ranks)][rank]
        tp_group, ep_group = (world if config.tp > 1 else alone), (world if config.ep > 1 else alone)
        runs = []
        for _ in range(config.repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            got = gather_megatron_state(local, cfg, tp_group, ep_group, config.bucket_bytes)
            runs.append((time.perf_counter() - t0, got.stats))
            del got
        seconds = [s for s, _ in runs[1:]]
        stats = runs[-1][1]
        queue.put((rank, {"bytes_gathered": stats.bytes_gathered, "buckets": stats.buckets,
                          "local_bytes": sum(t.numel() * t.element_size() for t in local.values()),
                          "seconds_best": min(seconds), "seconds_median": statistics.median(seconds),
                          "gb_per_s_best": stats.bytes_gathered / min(seconds) / 1e9,
                          "gb_per_s_median": stats.bytes_gathered / statistics.median(seconds) / 1e9}))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))


def run(config: ReshardBenchConfig) -> dict[str, Any]:
    """Run the gathers on `config.ranks` processes; the JSON-ready result."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, port, config, queue), daemon=True) for r in range(config.ranks)]
    for p in procs:
        p.start()
    try:
        per_rank = dict(queue.get(timeout=1800) for _ in range(config.ranks))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = {r: v["error"] for r, v in per_rank.items() if "error" in v}
    if errors:
        raise RuntimeError(f"reshard benchmark ranks failed: {errors}")
    cfg = config.model_config()
    model_bytes = sum(torch.Size(s).numel() for s in full_shapes(cfg).values()) * cfg.torch_dtype.itemsize
    slowest = max(per_rank.values(), key=lambda v: v["seconds_median"])
    return {"config": asdict(config), "model_bytes": model_bytes, "host": socket.gethostname(),
            "cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "bytes_gathered_per_rank": slowest["bytes_gathered"], "buckets": slowest["buckets"],
            "seconds_median_slowest_rank": slowest["seconds_median"],
            "gb_per_s_median_slowest_rank": slowest["gb_per_s_median"],
            "per_rank": [per_rank[r] for r in range(config.ranks)]}


def main(argv: list[str] | None = None) -> None:
    d = ReshardBenchConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=d.model)
    p.add_argument("--layers", type=int, default=d.num_layers)
    p.add_argument("--ranks", type=int, default=d.ranks)
    p.add_argument("--tp", type=int, default=d.tp)
    p.add_argument("--ep", type=int, default=d.ep)
    p.add_argument("--backend", default=d.backend, choices=("gloo", "nccl"))
    p.add_argument("--bucket-mib", type=float, default=d.bucket_bytes / (1 << 20))
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--out", default=None, help="JSON path")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = ReshardBenchConfig(model=args.model, num_layers=args.layers, ranks=args.ranks, tp=args.tp, ep=args.ep,
                                backend=args.backend, bucket_bytes=int(args.bucket_mib * (1 << 20)),
                                repeats=args.repeats)
    result = run(config)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{config.model} x{config.num_layers} layers ({result['model_bytes'] / 1e9:.2f} GB), {config.ranks} ranks "
          f"{config.backend}, TP={config.tp} EP={config.ep}: {result['bytes_gathered_per_rank'] / 1e9:.3f} GB "
          f"gathered per rank in {result['buckets']} buckets, {result['seconds_median_slowest_rank']:.3f} s "
          f"(median, slowest rank), {result['gb_per_s_median_slowest_rank']:.2f} GB/s")


if __name__ == "__main__":
    main()
