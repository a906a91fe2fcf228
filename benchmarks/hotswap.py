"""Hot swap at full size: how long `update_weights` takes for a whole model, three ways.

    python -m benchmarks.hotswap --model qwen3-30b-a3b --json      # one H200, < 3 min
    python -m benchmarks.hotswap --model tiny-moe --device cpu --json   # smoke
    python -m benchmarks.hotswap --model qwen3-30b-a3b --narrow --device cpu   # host work

- copy: `engine.update_weights(full_state)` from a second full-size state on the same device
  (validation of every tensor, then a copy into the engine's persistent buffers);
- bind: `engine.weights.bind(local_state)`, zero-copy (parameters re-pointed; validation only);
- reshard: the source is laid out like a TP 2 trainer (each split tensor as two halves, SwiGLU
  fc1 as [gate; up] halves), gathered to full tensors on the device, then copied.

Memory: the engine's model plus a second full state does not leave room for the rest on a
141 GB device with `qwen3-30b-a3b` (61 GB in bf16), so a source holds half the layers and
lends them to the other half too (layer i + L/2 reads layer i's tensors): every byte of the model
is still validated and copied, and the tensors are far larger than any cache. Reported per mode:
the median of `--repeats` warm repeats (one untimed warm-up first), weight GB/s (model bytes /
time), and the share of the device's copy bandwidth that the copy's read+write traffic reaches.
Decode graphs are captured before the copies and must be the same objects after them (a copy
keeps addresses, so nothing is recaptured); bind re-points parameters, so it runs last.
`--narrow` keeps the preset's layers, experts and so every one of its tensors (12,627 for
`qwen3-30b-a3b`) but shrinks their sizes (`NARROW`), so the per-tensor host work of an update
(validation, name mapping, one copy launch per tensor) dominates: it runs on a CPU in seconds.
Left out: host-to-device sources (a trainer on another device), multi-rank reshards (NCCL).
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.random_weights import random_model
from megatron_rollout.engine import EngineConfig, KVConfig, RolloutEngine, SamplingParams, SchedulerConfig
from megatron_rollout.model.config import ModelConfig, preset
from megatron_rollout.model.sharding import full_shapes

log = logging.getLogger("benchmarks.hotswap")

_LAYER = "decoder.layers."


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Read+write bytes per second of one device copy (the ceilings' figure on CUDA)."""
    if device.type == "cuda":
        from benchmarks.ceilings import copy_bandwidth as cuda_copy

        return cuda_copy(device, nbytes)
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(times)


def lenders(cfg: ModelConfig) -> dict[str, str | None]:
    """Every full name -> the name whose tensor a half-layers source lends it (layer i + ceil(L/2)
    borrows layer i's tensor of the same name and shape), or None where the source holds its own."""
    shapes, half = full_shapes(cfg), (cfg.num_layers + 1) // 2
    out: dict[str, str | None] = {}
    for name in shapes:
        out[name] = None
        if name.startswith(_LAYER):
            layer, rest = name[len(_LAYER):].split(".", 1)
            src = f"{_LAYER}{int(layer) - half}.{rest}"
            if int(layer) >= half and shapes.get(src) == shapes[name]:
                out[name] = src
    return out


def half_layer_state(cfg: ModelConfig, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """Every full name -> a random tensor, the upper half of the layers borrowing the lower half's."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, src in lenders(cfg).items():
        out[name] = out[src] if src is not None else torch.randn(
            full_shapes(cfg)[name], generator=gen, device=device, dtype=cfg.torch_dtype).mul_(0.02)
    return out


def tp2_split(name: str, full: torch.Tensor) -> list[torch.Tensor]:
    """A TP 2 trainer's two slices of `name` (routed experts and norms are whole: one entry)."""
    from megatron_rollout.weights.megatron_layout import tp_split_dim

    dim = tp_split_dim(name)
    if dim is None:
        return [full]
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2)
        return [torch.cat([g, u]) for g, u in zip(gate.chunk(2), up.chunk(2))]
    return [t.contiguous() for t in full.chunk(2, dim=dim)]


def _timed(fn: Callable[[], None], device: torch.device, repeats: int) -> list[float]:
    fn()  # warm-up: allocator, first-call paths
    _sync(device)
    times = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return times


def _report(times: list[float], model_bytes: int, copy_bw: float, traffic: float) -> dict:
    median = statistics.median(times)
    return {"median_s": median, "times_s": times, "weight_gbps": model_bytes / median / 1e9,
            "fraction_of_copy_bandwidth": traffic * model_bytes / median / copy_bw}


def _graph_ids(engine: RolloutEngine) -> dict[int, int] | None:
    graphs = getattr(engine.runner, "_graphs", None)
    return None if graphs is None else {rows: id(g) for rows, g in graphs.items()}


NARROW = dict(hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16, ffn_hidden_size=64,
              moe_ffn_hidden_size=32, vocab_size=512)
"""`--narrow`: the sizes that replace the preset's (counts of layers and experts stay)."""


def run(model_name: str, device: str, repeats: int = 3, bw_bytes: int = 4 << 30, narrow: bool = False) -> dict:
    dev = torch.device(device)
    cfg = preset(model_name)
    if narrow:
        cfg = cfg.replace(**{k: v for k, v in NARROW.items() if getattr(cfg, k)},
                          moe_shared_expert_intermediate_size=32 if cfg.moe_shared_expert_intermediate_size else 0)
    copy_bw = copy_bandwidth(dev, bw_bytes if dev.type == "cuda" else 64 << 20)
    start = time.perf_counter()
    model = random_model(cfg, dev, seed=0)  # drawn on the device: init_weights draws on the host (minutes at 30B)
    config = EngineConfig(scheduler=SchedulerConfig("off", block_size=16), kv=KVConfig(num_blocks=64))
    engine = RolloutEngine(model, config)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    built_s = time.perf_counter() - start
    log.info("model and engine built in %.1f s (%.1f GB)", built_s, model_bytes / 1e9)
    prompts, params = [[1, 2, 3], [4, 5, 6, 7]], SamplingParams(temperature=0.0, max_new_tokens=4)
    engine.generate(prompts, params)  # decode graphs captured here on a GPU
    graphs_before = _graph_ids(engine)
    log.info("first generate done at %.1f s", time.perf_counter() - start)
    version = [engine.weight_version]

    def bump() -> int:
        version[0] += 1
        return version[0]

    out: dict = {"model": model_name, "narrow": narrow, "tensors": len(full_shapes(cfg)), "device": str(dev),
                 "model_bytes": model_bytes, "repeats": repeats,
                 "copy_bandwidth_gbps": copy_bw / 1e9, "build_s": built_s, "modes": {}}
    # (a) copy from a second full-size state on the device
    source = half_layer_state(cfg, dev, seed=1)
    times = _timed(lambda: engine.update_weights(source, bump()), dev, repeats)
    out["modes"]["copy"] = _report(times, model_bytes, copy_bw, traffic=2)
    log.info("copy: %s (at %.1f s)", out["modes"]["copy"], time.perf_counter() - start)
    probe = "decoder.layers.0.self_attention.linear_qkv.weight"
    last = f"{_LAYER}{cfg.num_layers - 1}.input_layernorm.weight"
    verified = torch.equal(model.get_parameter(probe), source[probe]) and \
        torch.equal(model.get_parameter(last), source[last])
    replays = getattr(engine.runner, "stats", {}).get("graph_replays")
    engine.generate(prompts, params)  # decode under the copied weights: the same graphs must replay
    graphs_after = _graph_ids(engine)
    replays_after = getattr(engine.runner, "stats", {}).get("graph_replays")
    out["graphs"] = {"captured_before": sorted(graphs_before) if graphs_before is not None else None,
                     "same_after_copy": graphs_before == graphs_after,
                     "replays_after_copy": None if replays is None else replays_after - replays}
    source.clear()  # free it before the next source
    # (c) reshard from a TP 2 layout: gather the halves on the device, then copy
    lend = lenders(cfg)
    split = half_layer_state(cfg, dev, seed=2)
    tp2 = {name: tp2_split(name, t) for name, t in split.items() if lend[name] is None}
    del split

    def reshard() -> None:
        from megatron_rollout.weights.megatron_layout import join_tp

        full = {name: join_tp(name, parts) for name, parts in tp2.items()}
        for name, src in lend.items():
            if src is not None:
                full[name] = full[src]
        engine.update_weights(full, bump())

    times = _timed(reshard, dev, repeats)
    log.info("reshard timed (at %.1f s)", time.perf_counter() - start)
    out["modes"]["reshard"] = _report(times, model_bytes, copy_bw, traffic=2)  # the copy's r+w; joins on top
    # Routed experts are whole under TP (ETP = 1): only attention, dense MLPs, shared experts,
    # embedding and output layer are joined from halves.
    from megatron_rollout.weights.megatron_layout import tp_split_dim

    itemsize = torch.empty(0, dtype=cfg.torch_dtype).element_size()
    joined = sum(torch.Size(shape).numel() * itemsize for n, shape in full_shapes(cfg).items()
                 if tp_split_dim(n) is not None)
    out["modes"]["reshard"]["joined_bytes_fraction"] = joined / model_bytes
    tp2.clear()
    # (b) bind: zero-copy, last (it re-points the parameters; graphs are dropped on next use)
    local = dict(half_layer_state(cfg, dev, seed=3))
    times = _timed(lambda: engine.weights.bind(local, bump()), dev, repeats)
    log.info("bind timed (at %.1f s)", time.perf_counter() - start)
    out["modes"]["bind"] = _report(times, model_bytes, copy_bw, traffic=1)  # validation reads only
    out["verified"] = bool(verified and model.get_parameter(probe).data_ptr() == local[probe].data_ptr())
    out["weight_version"] = engine.weight_version
    out["total_s"] = time.perf_counter() - start
    if dev.type == "cuda":
        out["max_memory_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON object (default: a summary)")
    parser.add_argument("--narrow", action="store_true",
                        help="every tensor of the preset at tiny sizes: the per-tensor host work of an update")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.repeats < 3:
        parser.error(f"--repeats must be >= 3 (a median of warm repeats), got {args.repeats}")
    result = run(args.model, args.device, args.repeats, narrow=args.narrow)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['tensors']} tensors, {result['model_bytes'] / 1e9:.3f} GB, median of {result['repeats']}")
    for mode, r in result["modes"].items():
        print(f"{mode:8s} {r['median_s'] * 1e3:9.1f} ms  {r['weight_gbps']:8.1f} GB/s of weights  "
              f"{100 * r['fraction_of_copy_bandwidth']:5.1f}% of copy bandwidth")
    print(f"decode graphs unchanged after copy: {result['graphs']['same_after_copy']}")


if __name__ == "__main__":
    main()
