"""The Hugging Face transformers peer: continuous batching on the same model shape and trace.

transformers 5.x ships continuous batching (`model.generate_batch`, and underneath it
`model.init_continuous_batching()` -> a manager with `add_request` / `get_result` running a
paged-attention loop in a background thread). This module builds the same architecture with
random weights (`Qwen3MoeForCausalLM` for the Qwen3-MoE presets, through
`model.checkpoint.hf_config_from`), checks cheaply that the API exists, and replays the trace with
the same rules as `trace.replay`: turn k of a conversation is submitted `wait_ms` after turn k-1
finished, outputs are forced to the trace's lengths (no EOS), greedy. transformers keeps no
session KV between requests, so every turn resubmits the whole conversation so far and prefills
it again: that is the peer as it is, and the report says so.

Everything is bounded by `budget_s`; what did not run, or did not finish, is reported with the
reason instead of raising. Left out: any tuning of the peer beyond its defaults.
"""
from __future__ import annotations

import heapq
import logging
import time
from typing import Any

import numpy as np
import torch

from megatron_rollout.model.config import ModelConfig
from megatron_rollout.trace.schema import TraceRequest, group_conversations

log = logging.getLogger(__name__)


def build_hf_model(cfg: ModelConfig, device: str, seed: int = 0):
    """A random-weight transformers model with `cfg`'s shapes, on `device`, in cfg's dtype."""
    from transformers import AutoModelForCausalLM

    from megatron_rollout.model.checkpoint import QWEN3_MOE, hf_config_from

    hf_cfg = hf_config_from(cfg, QWEN3_MOE)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(cfg.torch_dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_cfg)
    finally:
        torch.set_default_dtype(default)
    return model.to(device=device, dtype=cfg.torch_dtype).eval()


def replay_hf(model, requests: list[TraceRequest], vocab_size: int, seed: int, budget_s: float) -> dict[str, Any]:
    """Replay `requests` through transformers' continuous-batching manager within `budget_s`."""
    from transformers import GenerationConfig

    convs = list(group_conversations(requests).items())
    gen_cfg = GenerationConfig(max_new_tokens=max(r.output_tokens for r in requests), do_sample=False,
                               eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gen_cfg)
    attn_impl = getattr(model.config, "_attn_implementation", None)
    manager.start()
    start = time.perf_counter()
    contexts: list[list[int]] = [[] for _ in convs]
    next_turn = [0] * len(convs)
    releases = [(start + turns[0].wait_ms / 1e3, i) for i, (_, turns) in enumerate(convs)]
    heapq.heapify(releases)
    inflight: dict[str, tuple[int, float]] = {}
    done: list[dict[str, float]] = []
    deadline = start + budget_s
    error = None
    try:
        while (releases or inflight) and time.perf_counter() < deadline:
            now = time.perf_counter()
            while releases and releases[0][0] <= now:
                _, i = heapq.heappop(releases)
                turn = convs[i][1][next_turn[i]]
                rng = np.random.default_rng([seed, i, turn.turn])
                contexts[i] += rng.integers(0, vocab_size, size=turn.input_tokens).tolist()
                rid = f"c{i}t{turn.turn}"
                manager.add_request(list(contexts[i]), request_id=rid, max_new_tokens=turn.output_tokens)
                inflight[rid] = (i, time.perf_counter())
            result = manager.get_result(timeout=0.005)
            if result is None:
                if hasattr(manager, "is_running") and not manager.is_running():
                    raise RuntimeError("the continuous-batching thread stopped")
                continue
            if result.request_id not in inflight:
                continue
            if hasattr(result, "is_finished") and not result.is_finished():
                continue
            i, arrival = inflight.pop(result.request_id)
            finish = time.perf_counter()
            tokens = list(getattr(result, "generated_tokens", []) or [])
            contexts[i] += tokens
            turn = convs[i][1][next_turn[i]]
            done.append({"arrival": arrival, "finish": finish, "output_tokens": len(tokens),
                         "input_tokens": turn.input_tokens, "conversation": i})
            next_turn[i] += 1
            if next_turn[i] < len(convs[i][1]):
                heapq.heappush(releases, (finish + convs[i][1][next_turn[i]].wait_ms / 1e3, i))
    except Exception as exc:  # the peer's failure is a result, not a crash of the benchmark
        error = f"{type(exc).__name__}: {exc}"
        log.warning("transformers peer failed: %s", error)
    finally:
        try:
            manager.stop(block=True, timeout=10)
        except Exception as exc:
            log.warning("stopping the transformers manager failed: %s", exc)
    total = len(requests)
    finished = len(done) == total and error is None
    out: dict[str, Any] = {"requests_total": total, "requests_done": len(done), "finished": finished,
                           "attn_implementation": attn_impl, "budget_s": budget_s, "error": error,
                           "note": "no session KV reuse: every turn re-prefills its whole conversation"}
    if done:
        completions = [d["finish"] - d["arrival"] for d in done]
        out.update(makespan_s=max(d["finish"] for d in done) - start if finished else None,
                   elapsed_s=time.perf_counter() - start,
                   p99_request_s=float(np.percentile(completions, 99)),
                   output_tokens=sum(d["output_tokens"] for d in done),
                   tokens_per_s=sum(d["output_tokens"] for d in done) / (max(d["finish"] for d in done) - start))
        if finished:
            spans: dict[int, list[float]] = {}
            for d in done:
                lo, hi = spans.get(d["conversation"], [d["arrival"], d["finish"]])
                spans[d["conversation"]] = [min(lo, d["arrival"]), max(hi, d["finish"])]
            out["p99_trajectory_s"] = float(np.percentile([b - a for a, b in spans.values()], 99))
    return out


def run_peer(cfg: ModelConfig, requests: list[TraceRequest], device: str, seed: int, budget_s: float) -> dict:
    """Build the peer, check its API, replay; every failure comes back as a reason."""
    try:
        import transformers
    except ImportError as exc:
        return {"ran": False, "reason": f"transformers is not installed: {exc}"}
    info: dict[str, Any] = {"transformers": transformers.__version__}
    try:
        t0 = time.perf_counter()
        model = build_hf_model(cfg, device, seed)
        info["build_s"] = time.perf_counter() - t0
    except Exception as exc:
        return {**info, "ran": False, "reason": f"could not build the model: {type(exc).__name__}: {exc}"}
    info["generate_batch"] = hasattr(model, "generate_batch")
    info["init_continuous_batching"] = hasattr(model, "init_continuous_batching")
    if not info["init_continuous_batching"]:
        return {**info, "ran": False, "reason": "this transformers has no continuous batching API"}
    with torch.no_grad():
        result = replay_hf(model, requests, cfg.vocab_size, seed, budget_s)
    del model
    torch.cuda.empty_cache()
    return {**info, "ran": True, **result}
