"""What the CLI runs: build the model and engine from arguments, run, and report at rank 0.

Kept apart from `cli.py` so that the CLI stays an argument list and this stays testable.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
from pathlib import Path

import torch

from megatron_rollout.engine import RolloutEngine, SamplingParams
from megatron_rollout.kv.paged import PagedKVCache
from megatron_rollout.model.checkpoint import load_model
from megatron_rollout.model.config import PRESETS, ModelConfig
from megatron_rollout.options import check_writable, engine_config
from megatron_rollout.types import Axis

log = logging.getLogger(__name__)


def _device(args: argparse.Namespace) -> str:
    """`--device` checked: cpu, or cuda (cuda:N) when torch sees a GPU."""
    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda (cuda:N), got {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: torch sees no CUDA device (torch {torch.__version__}, built for CUDA "
                         f"{torch.version.cuda}); use --device cpu, or check CUDA_VISIBLE_DEVICES and the driver")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return name


def build_model(args: argparse.Namespace):
    """(model, runtime) for these arguments; runtime is None on one process."""
    world = args.atp * args.adp
    if args.ep is not None and args.ep != world:
        raise ValueError(f"--ep must equal --atp x --adp ({world}) with expert tensor parallel 1, got {args.ep}")
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != world:  # else every rank would run its own copy (world 1) or wait for absent ranks
        raise ValueError(f"{launched} processes were launched (WORLD_SIZE={launched}) but --atp {args.atp} x "
                         f"--adp {args.adp} = {world}: give --atp/--adp whose product is {launched}, or launch "
                         f"{world} process(es) (torchrun --nproc_per_node {world})")
    if world == 1:
        device = _device(args)
        check_memory(args, None, torch.device(device))
        return load_model(args.model, device=device), None
    from megatron_rollout.distributed import Runtime

    runtime = Runtime.start(args.atp, args.adp, device=_device(args), timeout_s=args.timeout,
                            comm=engine_config(args).comm)
    check_memory(args, runtime.comm, runtime.device)
    return load_model(args.model, comm=runtime.comm, device=runtime.device), runtime


def _model_config(spec: str) -> ModelConfig | None:
    """The shape `--model` names (a preset, or a checkpoint's config.json); None when it names
    neither (`load_model` says what is wrong)."""
    if spec in PRESETS:
        return PRESETS[spec]
    if not (Path(spec) / "config.json").is_file():
        return None
    import transformers

    from megatron_rollout.model.checkpoint import config_from_hf

    return config_from_hf(transformers.AutoConfig.from_pretrained(spec))


def available_bytes(device: torch.device) -> int | None:
    """Memory one rank can still take on `device`: the GPU's free memory, or on CPU the host's
    MemAvailable (capped by a cgroup v2 limit) shared by this host's ranks; None where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        free = int(meminfo["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        free = min(free, int(limit) - used) if limit != "max" else free
    except (OSError, ValueError):
        pass
    return free // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_memory(args: argparse.Namespace, comm, device: torch.device) -> None:
    """Refuse, before anything is allocated, a model whose weights (this rank's shard, sized on
    the meta device) and KV cache exceed the memory available to this rank: a clear error instead
    of an allocator traceback or the kernel's OOM killer. A lower bound: activations come on top."""
    cfg = _model_config(args.model)
    available = available_bytes(device)
    if cfg is None or available is None:
        return
    from megatron_rollout.model.transformer import MoETransformer

    shard = MoETransformer(cfg, comm, "meta")
    weights = sum(p.numel() * p.element_size() for p in shard.parameters())
    atp = comm.size(Axis.ATP) if comm is not None else 1
    kv = args.num_blocks * PagedKVCache.bytes_per_block(cfg, args.block_size, cfg.num_query_groups // atp)
    if weights + kv > available:
        raise ValueError(f"--model {args.model} needs at least {_size(weights + kv)} per rank on {device} "
                         f"({_size(weights)} of {cfg.dtype} weights, {_size(kv)} of KV cache for "
                         f"--num-blocks {args.num_blocks} x --block-size {args.block_size}) but "
                         f"{_size(available)} are available: use a smaller model (tiny-moe, "
                         f"qwen3-30b-a3b-12l), a device with more memory, more ranks (--atp/--adp), or fewer "
                         f"--num-blocks")


def build_engine(args: argparse.Namespace, timeline=None, model=None, runtime=None, schedule: str | None = None):
    """(engine, runtime) for these arguments (reusing `model`/`runtime` when given)."""
    if model is None:
        model, runtime = build_model(args)
    config = engine_config(args, schedule)
    if runtime is None:
        return RolloutEngine(model, config, timeline=timeline), None
    return runtime.engine(model, config, timeline=timeline), runtime


def _output(result) -> dict:
    logprobs = [lp if math.isfinite(lp) else None for lp in result.logprobs]  # JSON has no NaN or inf
    return {"token_ids": result.token_ids, "logprobs": logprobs, "finish_reason": result.finish_reason.value,
            "weight_version": result.weight_version, **({"error": result.error} if result.error else {})}


def run_generate(args: argparse.Namespace) -> dict | None:
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, seed=args.seed)
    _check_outputs(args, [None])
    timeline = _timeline(args)
    engine, runtime = build_engine(args, timeline)
    if runtime is None:
        results = engine.generate(args.prompt_ids, params)
    else:
        results = runtime.generate(engine, args.prompt_ids, params)
    _write_timeline(args, timeline, runtime)
    if runtime is not None and not runtime.is_main:
        return None
    return {"outputs": [_output(r) for r in results]}


def run_replay(args: argparse.Namespace) -> dict | None:
    """One report, or {"runs": [...]} when several schedules are compared in this one process
    (same model, same trace, one after the other)."""
    from megatron_rollout.trace.replay import replay
    from megatron_rollout.trace.schema import load_trace

    schedules = args.schedule.split(",")
    _check_outputs(args, schedules if len(schedules) > 1 else [None])
    requests = load_trace(args.trace)
    model, runtime = build_model(args)
    reports = []
    for schedule in schedules:
        timeline = _timeline(args)
        engine, _ = build_engine(args, timeline, model, runtime, schedule)
        opts = dict(seed=args.seed, progress=not args.no_progress, vocab_size=model.cfg.vocab_size, schedule=schedule)
        if runtime is None:
            reports.append(replay(engine, requests, **opts)[0].to_dict())
        else:
            reports.append(runtime.replay(engine, requests, **opts))
        _write_timeline(args, timeline, runtime, schedule if len(schedules) > 1 else None)
    if runtime is not None and not runtime.is_main:
        return None
    return reports[0] if len(reports) == 1 else {"runs": reports}


def _timeline(args: argparse.Namespace):
    if not args.timeline:
        return None
    from megatron_rollout.trace.timeline import Timeline

    return Timeline()


def _check_outputs(args: argparse.Namespace, schedules: list[str | None]) -> None:
    """The files this run will write, checked before it starts (on the rank that writes them)."""
    if args.timeline and int(os.environ.get("RANK", "0")) == 0:
        for schedule in schedules:
            check_writable(_timeline_path(args.timeline, schedule), "--timeline")


def _timeline_path(path: str, schedule: str | None) -> str:
    """timeline.json, or per schedule of a comparison: timeline.off.json, ..."""
    if schedule is None:
        return path
    stem, dot, ext = path.rpartition(".")
    return f"{stem}.{schedule}.{ext}" if dot else f"{path}.{schedule}"


def _write_timeline(args: argparse.Namespace, timeline, runtime, schedule: str | None = None) -> None:
    if timeline is None:
        return
    if runtime is not None:
        timeline = runtime.gather_timeline(timeline)
        if timeline is None:
            return
    timeline.write_chrome_trace(_timeline_path(args.timeline, schedule))
