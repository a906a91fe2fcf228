"""The vLLM peer: the same trace, token ids and model shape through vLLM's async engine (docs/design.md §9).

`python -m benchmarks.vllm_peer --trace T.jsonl --out vllm.json --model qwen3-30b-a3b-12l`
runs in its own process (the benchmark starts it after its own engines have freed the GPU). It
writes a directory holding only `config.json` (`Qwen3MoeForCausalLM` with the preset's sizes and
layer count) and starts `vllm.v1.engine.async_llm.AsyncLLM` on it with dummy weights (or ours: below), prefix
caching on, CUDA graphs and torch.compile as vLLM chooses by itself, and its own defaults for
everything else (the JSON records what it chose: token budget, sequences, block size, graph mode,
the attention backend lines of its log).

The replay is closed loop, with the rules of `trace.replay`: one coroutine per conversation; turn 0
is released at the pass start + its wait, turn k > 0 `wait_ms` after turn k-1 finished; a turn sends
the whole history (earlier turns' new ids and generated ids) plus its new ids, from
`trace.make.input_ids` (the same ids our replay appends), forced to the trace's output length
(`min_tokens = max_tokens`, `ignore_eos`, so that both engines do the same work). Greedy, or at
`--temperature` T > 0 sampled at T (RL rollouts sample at 1). Unseeded by default, vLLM's best
setting: the model runner vLLM 0.26 picks for Qwen3-MoE (V1) draws every unseeded row's noise in one
launch, and a seeded request's with a launch of its own per request and step. `--turn-seeds` seeds
each turn as our replay seeds it (`trace.replay.turn_seed`, from `--seed`, the conversation's index
and the turn), at that cost. Sampled tokens are not expected to match ours either way (another sampler on
other kernels); the figures are what compares. vLLM's prefix cache finds the history,
as our sessions keep it. Per token budget (`--budgets`: `default` is vLLM's own): `--warmups`
untimed passes over the whole trace (vLLM JIT-compiles during its first pass), then `--passes` timed
passes, each after `reset_prefix_cache()`. The JSON is rewritten after every pass, so a killed run
keeps what it measured; `--deadline-s` stops before a pass that would not fit. `--in-process` runs
vLLM the way RL frameworks colocate it with a trainer: `LLMEngine` with its engine core in this
process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), stepped by `closed_loop_stepped` (same replay rules);
its budgets are keyed `<budget>/in-process`. One process runs one mode (the benchmark starts one per
mode).

`--weights FILE` gives vLLM our model's weights (`save_weights`: one safetensors file under Hugging Face
Qwen3-MoE names, which `benchmarks.rollout` writes from the model its replays ran) in place of its
dummy init: both engines then compute one function (up to the order of their bf16 sums), so the
drafts' acceptance is comparable. vLLM's dummy init (every value, norms included, uniform in +-1e-3) is another model,
whose greedy outputs repeat differently. With `--speculative`, each pass also reports vLLM's drafted and
accepted tokens, counted by a stat logger of ours (`DraftCounts`; `AsyncLLM` turns its stats on for
a logger, `LLMEngine` needs them on, so they are on in process with drafts, off elsewhere).
`--drawn-weights SEED:STD` gives it the same weights with no file: once vLLM is up on its dummy init,
its worker draws our random model's tensors one at a time (`benchmarks.random_weights.draw_weights`, the
draw `random_model` makes) and loads them in place through vLLM's own reload (`draw_into`), which
keeps the storage its CUDA graphs read. The 48-layer preset's 61 GB file does not fit the device's
disk; this needs none.

`--serve` keeps one budget's engine up for the benchmark to interleave its passes with our replays
(`benchmarks.rollout --vllm-interleave`): after the warm-up passes it answers `ready`, then runs one
timed pass for each `pass` line on stdin and answers with its report, until `quit` or the end of
stdin. Answers are JSON lines on `--reply-fd` (vLLM logs to stdout, so replies need a channel of
their own). Both engines then hold their memory at once, so `--kv-cache-gb` gives vLLM a fixed
KV cache (`kv_cache_memory_bytes`) where its release has that field.

The figures are the replay report's: makespan, p50/p99 request, p99 trajectory, mean/p99 TTFT,
tokens/s; decode wait is not measured by vLLM (null). `--speculative ngram:K` turns on vLLM's own
prompt-lookup speculation (K tokens, suffixes of 2 to 4 tokens matched, as our `~ngram:K` drafts), keyed
`<budget>~ngram:K`, so that our drafting is compared with the peer's. Left out: vLLM's own tuning knobs
beyond the token budget and speculation, several GPUs.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import math
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

import numpy as np

from benchmarks.agreement import digest, turn_key
from megatron_rollout.model.config import PRESETS, ModelConfig
from megatron_rollout.trace.make import conversation_inputs
from megatron_rollout.trace.replay import turn_seed
from megatron_rollout.trace.schema import ConversationId, TraceRequest, group_conversations, load_trace

log = logging.getLogger("benchmarks.vllm_peer")

ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
       "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_CACHE_ROOT": "/tmp/vllm-cache"}
"""Environment the peer needs on a machine without network access: offline Hub, no usage reports, a
writable cache, and vLLM's own sampler rather than FlashInfer's."""


def hf_config(cfg: ModelConfig, max_model_len: int) -> dict[str, Any]:
    """config.json of a `Qwen3MoeForCausalLM` with `cfg`'s shapes (every layer MoE, no shared expert)."""
    if cfg.moe_shared_expert_intermediate_size or any(not cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        raise ValueError("the vLLM peer builds Qwen3-MoE shapes: every layer MoE, no shared expert; "
                         f"got layer kinds {[cfg.is_moe_layer(i) for i in range(cfg.num_layers)]}")
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.kv_channels, "intermediate_size": max(cfg.ffn_hidden_size, 6144),
        "moe_intermediate_size": cfg.moe_ffn_hidden_size, "num_experts": cfg.num_moe_experts,
        "num_experts_per_tok": cfg.moe_router_topk, "norm_topk_prob": cfg.moe_renormalize_topk,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu", "attention_bias": False,
        "rms_norm_eps": cfg.layernorm_epsilon, "rope_theta": cfg.rotary_base, "rope_scaling": None,
        "max_position_embeddings": max(cfg.max_position_embeddings, max_model_len),
        "tie_word_embeddings": cfg.tie_word_embeddings, "use_sliding_window": False, "sliding_window": None,
        "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
        "output_router_logits": False, "router_aux_loss_coef": 0.001, "initializer_range": 0.02,
    }


def write_model_dir(path: Path, cfg: ModelConfig, max_model_len: int, weights: Path | None = None) -> Path:
    """config.json, and `weights` linked in as model.safetensors (None: no weights file, for the dummy init)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(cfg, max_model_len), indent=1))
    link = path / "model.safetensors"
    link.unlink(missing_ok=True)
    if weights is not None:
        if not weights.is_file():
            raise SystemExit(f"--weights {weights}: no such file")
        link.symlink_to(weights.resolve())
    return path


def save_weights(model, cfg: ModelConfig, path: Path) -> Path:
    """`model`'s weights (a whole `MoETransformer`) as one safetensors file under the Hugging Face
    Qwen3-MoE names the peer's config.json describes, for `--weights`."""
    from megatron_rollout.model.checkpoint import QWEN3_MOE, save_safetensors

    hf_config(cfg, cfg.max_position_embeddings)  # a shape the peer cannot build fails before the copy
    return save_safetensors(model, cfg, path, QWEN3_MOE)


class DraftCounts:
    """vLLM's speculation counters summed over its steps: a per-engine stat logger (vLLM's
    `StatLoggerBase` interface, duck-typed so that this module imports without vLLM)."""

    def __init__(self) -> None:
        self.drafts = self.drafted = self.accepted = 0

    def __call__(self, vllm_config: Any, engine_index: int = 0) -> DraftCounts:
        return self  # the factory vLLM calls once per engine

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        spec = getattr(scheduler_stats, "spec_decoding_stats", None)
        if spec is not None:
            self.drafts += spec.num_drafts
            self.drafted += spec.num_draft_tokens
            self.accepted += spec.num_accepted_tokens

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, *args: Any) -> None:
        pass

    def snapshot(self) -> tuple[int, int, int]:
        return self.drafts, self.drafted, self.accepted

    def since(self, before: tuple[int, int, int]) -> dict[str, Any]:
        """The counts since `snapshot()` gave `before`, as a pass report's fields."""
        drafts, drafted, accepted = (a - b for a, b in zip(self.snapshot(), before))
        return {"drafts": drafts, "drafted_tokens": drafted, "accepted_tokens": accepted,
                "acceptance": accepted / drafted if drafted else None}


# -- the closed-loop driver (engine-agnostic: tested on CPU with a fake engine) ------------------
class _Delta(Protocol):
    token_ids: Sequence[int]


class _Output(Protocol):
    outputs: Sequence[_Delta]
    finished: bool


TurnParams = Callable[[int, int, int], Any]
"""`make_params(output_tokens, conversation_index, turn)`: a turn's sampling parameters. The loops
name the turn (its conversation's index in the trace's order of first appearance, as `trace.replay`
numbers them, and its turn number) so that a sampled turn can be seeded as our replay seeds it."""


class AsyncGenerateEngine(Protocol):
    """What the driver needs of `AsyncLLM`."""

    def generate(self, prompt: Any, sampling_params: Any, request_id: str) -> AsyncIterator[_Output]: ...


@dataclass(frozen=True)
class TurnRecord:
    """One finished turn (times are time.perf_counter)."""

    conversation: ConversationId
    turn: int
    arrival: float
    first_token: float | None
    finish: float
    new_tokens: int
    prompt_tokens: int
    output_tokens: int
    error: str | None = None
    digest: str | None = None
    """`benchmarks.agreement.digest` of the turn's generated ids."""


async def closed_loop(engine: AsyncGenerateEngine, requests: Sequence[TraceRequest],
                      inputs: dict[ConversationId, list[list[int]]], make_prompt: Callable[[list[int]], Any],
                      make_params: TurnParams, tag: str) -> tuple[float, list[TurnRecord]]:
    """Replay `requests` once; returns (start, records in finish order). A turn that fails ends
    its conversation (recorded with its error; later turns are not sent)."""
    start = time.perf_counter()
    records: list[TurnRecord] = []

    async def conversation(index: int, key: ConversationId, turns: list[TraceRequest]) -> None:
        history: list[int] = []
        ready = start
        for k, turn in enumerate(turns):
            delay = ready + turn.wait_ms / 1e3 - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            history.extend(inputs[key][k])
            arrival, first, generated, error = time.perf_counter(), None, [], None
            try:
                params = make_params(turn.output_tokens, index, turn.turn)
                async for out in engine.generate(make_prompt(list(history)), params, request_id=f"{tag}-{key}-{k}"):
                    new = list(out.outputs[0].token_ids) if out.outputs else []
                    if new and first is None:
                        first = time.perf_counter()
                    generated.extend(new)
                    if out.finished:
                        break
            except Exception as exc:  # the engine refused or failed the turn: end the conversation
                error = f"{type(exc).__name__}: {exc}"
            finish = time.perf_counter()
            records.append(TurnRecord(key, k, arrival, first, finish, len(inputs[key][k]), len(history),
                                      len(generated), error, digest(generated)))
            if error is not None:
                log.warning("conversation %r turn %d failed: %s", key, k, error)
                return
            history.extend(generated)
            ready = finish

    await asyncio.gather(*(conversation(index, key, turns)
                           for index, (key, turns) in enumerate(group_conversations(requests).items())))
    return start, records


class _StepOutput(Protocol):
    request_id: str
    outputs: Sequence[_Delta]
    finished: bool


class SteppedEngine(Protocol):
    """What the in-process driver needs of `LLMEngine` (vLLM without its engine-core process)."""

    def add_request(self, request_id: str, prompt: Any, params: Any) -> Any: ...

    def step(self) -> Sequence[_StepOutput]: ...


def closed_loop_stepped(engine: SteppedEngine, requests: Sequence[TraceRequest],
                        inputs: dict[ConversationId, list[list[int]]], make_prompt: Callable[[list[int]], Any],
                        make_params: TurnParams, tag: str) -> tuple[float, list[TurnRecord]]:
    """`closed_loop`'s replay on an engine the caller steps in its own thread, as an RL trainer that
    keeps vLLM in process does: turns are added when due, `step()` runs while any is in flight, and
    the host sleeps only while nothing is. Same rules and records as `closed_loop`."""
    start = time.perf_counter()
    records: list[TurnRecord] = []
    conversations = group_conversations(requests)
    index = {key: i for i, key in enumerate(conversations)}
    history: dict[ConversationId, list[int]] = {key: [] for key in conversations}
    due: list[tuple[float, int, ConversationId]] = [(start + turns[0].wait_ms / 1e3, 0, key)
                                                    for key, turns in conversations.items()]
    live: dict[str, tuple[ConversationId, int, float, list[float | None], list[int]]] = {}

    def finish(key: ConversationId, k: int, arrival: float, first: float | None, generated: list[int],
               error: str | None) -> None:
        end = time.perf_counter()
        records.append(TurnRecord(key, k, arrival, first, end, len(inputs[key][k]), len(history[key]),
                                  len(generated), error, digest(generated)))
        if error is not None:
            log.warning("conversation %r turn %d failed: %s", key, k, error)
            return
        history[key].extend(generated)
        if k + 1 < len(conversations[key]):
            due.append((end + conversations[key][k + 1].wait_ms / 1e3, k + 1, key))

    while due or live:
        now = time.perf_counter()
        due.sort(key=lambda d: d[0])
        while due and due[0][0] <= now:
            _, k, key = due.pop(0)
            history[key].extend(inputs[key][k])
            rid, arrival = f"{tag}-{key}-{k}", time.perf_counter()
            try:
                turn = conversations[key][k]
                params = make_params(turn.output_tokens, index[key], turn.turn)
                engine.add_request(rid, make_prompt(list(history[key])), params)
            except Exception as exc:  # refused: the conversation ends here
                finish(key, k, arrival, None, [], f"{type(exc).__name__}: {exc}")
                continue
            live[rid] = (key, k, arrival, [None], [])
        if not live:
            if due:
                time.sleep(max(0.0, min(d[0] for d in due) - time.perf_counter()))
            continue
        for out in engine.step():
            key, k, arrival, first, generated = live[out.request_id]
            new = list(out.outputs[0].token_ids) if out.outputs else []
            if new and first[0] is None:
                first[0] = time.perf_counter()
            generated.extend(new)
            if out.finished:
                del live[out.request_id]
                finish(key, k, arrival, first[0], generated, None)
    records.sort(key=lambda r: r.finish)
    return start, records


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q, method="linear")) if values else None


def report(start: float, records: Sequence[TurnRecord], total_requests: int) -> dict[str, Any]:
    """The replay report's figures (`trace.metrics` definitions) from one pass's records."""
    done = [r for r in records if r.error is None]
    failed_convs = {r.conversation for r in records if r.error is not None}
    spans: dict[ConversationId, tuple[float, float]] = {}
    for r in done:
        if r.conversation in failed_convs:
            continue
        a, b = spans.get(r.conversation, (r.arrival, r.finish))
        spans[r.conversation] = (min(a, r.arrival), max(b, r.finish))
    makespan = max((r.finish for r in records), default=start) - start
    ttfts = [r.first_token - r.arrival for r in done if r.first_token is not None]
    out_tokens = sum(r.output_tokens for r in done)
    return {
        "schedule": "vllm", "requests": len(done), "failed": len(records) - len(done),
        "skipped": total_requests - len(records), "input_tokens": sum(r.new_tokens for r in done),
        "output_tokens": out_tokens, "makespan_s": makespan,
        "p50_request_s": _pct([r.finish - r.arrival for r in done], 50),
        "p99_request_s": _pct([r.finish - r.arrival for r in done], 99),
        "p99_trajectory_s": _pct([b - a for a, b in spans.values()], 99),
        "mean_ttft_s": float(np.mean(ttfts)) if ttfts else None, "p99_ttft_s": _pct(ttfts, 99),
        "mean_decode_wait_ms": None, "tokens_per_s": out_tokens / makespan if makespan > 0 else None,
        "digests": {turn_key(r.conversation, r.turn): r.digest for r in done},
    }


def median_report(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each numeric figure's median over `reports` (None where no report has it); per-turn fields
    (`digests`) stay in the reports."""
    out: dict[str, Any] = {}
    for key in reports[0] if reports else ():
        if isinstance(reports[0][key], dict):
            continue
        values = [r[key] for r in reports if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
        out[key] = float(np.median(values)) if values else reports[0][key]
    return out


# -- vLLM ------------------------------------------------------------------------------------------
def _vllm_choices(engine) -> dict[str, Any]:
    """What vLLM chose by itself, read from its config (each read guarded: fields move between releases)."""
    cfg = getattr(engine, "vllm_config", None)
    picks = {
        "max_num_batched_tokens": ("scheduler_config", "max_num_batched_tokens"),
        "max_num_seqs": ("scheduler_config", "max_num_seqs"),
        "chunked_prefill": ("scheduler_config", "enable_chunked_prefill"),
        "block_size": ("cache_config", "block_size"),
        "prefix_caching": ("cache_config", "enable_prefix_caching"),
        "gpu_memory_utilization": ("cache_config", "gpu_memory_utilization"),
        "num_gpu_blocks": ("cache_config", "num_gpu_blocks"),
        "cudagraph_mode": ("compilation_config", "cudagraph_mode"),
        "compilation_mode": ("compilation_config", "mode"),
        "cudagraph_capture_sizes": ("compilation_config", "cudagraph_capture_sizes"),
        "attention_backend_config": ("attention_config", "backend"),
        "max_model_len": ("model_config", "max_model_len"),
        "enforce_eager": ("model_config", "enforce_eager"),
    }
    out: dict[str, Any] = {}
    for name, (part, attr) in picks.items():
        value = getattr(getattr(cfg, part, None), attr, None)
        out[name] = value if isinstance(value, (int, float, bool, str, type(None))) else str(value)
        if isinstance(value, (list, tuple)):
            out[name] = list(value)[:64]
    return out


def _engine_args(model_dir: Path, max_model_len: int, budget: int | None, args, in_process: bool = False):
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    load = "safetensors" if args.weights else "dummy"
    # Stats stay off but where drafts are counted in process: `AsyncLLM` turns them on by itself for a
    # stat logger (`DraftCounts`), `LLMEngine` calls its loggers only with them on (vLLM 0.26)
    quiet = not (in_process and args.speculative)
    kwargs = dict(model=str(model_dir), dtype="bfloat16", load_format=load, skip_tokenizer_init=True,
                  generation_config="vllm", enable_prefix_caching=True, max_model_len=max_model_len,
                  seed=args.seed, gpu_memory_utilization=args.gpu_memory_utilization, disable_log_stats=quiet)
    if budget is not None:
        kwargs["max_num_batched_tokens"] = budget
    if args.block_size is not None:
        kwargs["block_size"] = args.block_size
    if args.kv_cache_gb is not None:
        fields = getattr(EngineArgs, "__dataclass_fields__", {})
        if "kv_cache_memory_bytes" not in fields:
            raise SystemExit("--kv-cache-gb: this vLLM's EngineArgs has no kv_cache_memory_bytes")
        kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_gb * 2 ** 30)
    if args.speculative:
        kwargs["speculative_config"] = speculative_config(args.speculative)
    return (EngineArgs if in_process else AsyncEngineArgs)(**kwargs)


def speculative_config(text: str) -> dict[str, Any]:
    """'ngram:K' -> vLLM's prompt-lookup speculation with K tokens and our drafter's match lengths (2..4)."""
    method, _, k = text.partition(":")
    if method != "ngram" or not k.isdigit() or int(k) < 1:
        raise SystemExit(f"--speculative {text!r}: the peer's speculation is 'ngram:K' with K >= 1")
    return {"method": "ngram", "num_speculative_tokens": int(k), "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def drawn_weights(text: str) -> tuple[int, float]:
    """'SEED:STD' -> (seed, std) of the random weights `--drawn-weights` draws into vLLM."""
    seed, _, std = text.partition(":")
    try:
        seed_n, std_x = int(seed), float(std)
    except ValueError:
        seed_n, std_x = -1, 0.0
    if seed_n < 0 or not 0 < std_x < float("inf"):
        raise SystemExit(f"--drawn-weights {text!r}: expected SEED:STD, a seed >= 0 and a std > 0 (e.g. 0:0.02)")
    return seed_n, std_x


def draw_into(worker, cfg: ModelConfig | str, seed: int, std: float, device=None) -> int:
    """Run by vLLM's worker (`collective_rpc`): our random model's weights (`draw_weights`), drawn on its
    device one tensor at a time, loaded through `reload_weights` under their Hugging Face names;
    returns how many HF tensors it loaded. `cfg`: a config, or a preset's name (what reaches vLLM's
    core intact: its messages carry a dataclass as a dict)."""
    import torch

    from benchmarks.random_weights import draw_weights
    from megatron_rollout.model.checkpoint import QWEN3_MOE, hf_items
    from megatron_rollout.model.config import PRESETS

    cfg = PRESETS[cfg] if isinstance(cfg, str) else cfg
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    loaded = 0

    def stream():
        nonlocal loaded
        for item in hf_items(draw_weights(cfg, device, seed, std), cfg, QWEN3_MOE):
            loaded += 1
            yield item

    with torch.no_grad():
        worker.model_runner.reload_weights(weights_iterator=stream())
    return loaded


def _load_drawn(entry: dict[str, Any], args, results: list, t0: float) -> None:
    """What `--drawn-weights` loaded into a started engine (`collective_rpc`'s one result per worker),
    and how long it took since `t0`."""
    seed, std = args.drawn
    entry["drawn_weights"] = {"seed": seed, "std": std, "hf_tensors": list(results)}
    entry["weights_load_s"] = time.perf_counter() - t0


def temperature(text: str) -> float:
    """`--temperature`: a finite number >= 0 (0: greedy), refused before vLLM starts."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"takes a finite number >= 0 (0: greedy), got {text!r}")
    return value


def _sampling(args) -> TurnParams:
    """The loops' `make_params`: greedy at `--temperature` 0, else sampled at it, each turn seeded as
    our replay seeds it (`trace.replay.turn_seed`, from `--seed`) with `--turn-seeds`, else unseeded."""
    return functools.partial(_turn_params, args.temperature, args.seed if args.turn_seeds else None)


def _turn_params(temperature: float, seed: int | None, n: int, conversation_index: int, turn: int):
    """One turn's `SamplingParams`: exactly `n` tokens whatever it draws, so both engines do the same work."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    seeded = {"seed": turn_seed(seed, conversation_index, turn)} if temperature > 0 and seed is not None else {}
    return SamplingParams(temperature=temperature, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False,
                          output_kind=RequestOutputKind.DELTA, **seeded)


class Control:
    """The `--serve` channel: commands from `commands`, one JSON line a reply to `replies`."""

    def __init__(self, commands: TextIO, replies: TextIO) -> None:
        self.commands, self.replies = commands, replies

    def reply(self, **message: Any) -> None:
        self.replies.write(json.dumps(message, default=str) + "\n")
        self.replies.flush()

    def command(self) -> str:
        """The next command; the end of the input is `quit` (the benchmark went away)."""
        return self.commands.readline().strip() or "quit"


def _passes(args, deadline: float, entry: dict[str, Any], control: Control | None) -> Iterator[int]:
    """The pass indices to run: the warm-ups, then `args.passes` timed ones while the deadline
    allows, or under `control` one timed pass per `pass` command, each answered with its report
    (the caller has recorded it in `entry` when the next index is asked for)."""
    last = None
    for i in range(args.warmups):
        t = time.perf_counter()
        yield i
        last = time.perf_counter() - t
    if control is None:
        for i in range(args.warmups, args.warmups + args.passes):
            if _no_time_for(i, last, deadline, args, entry):
                return
            t = time.perf_counter()
            yield i
            last = time.perf_counter() - t
        return
    control.reply(event="ready", budget=entry["budget"], startup_s=entry.get("startup_s"),
                  warmups=[w["makespan_s"] for w in entry.get("warmups", [])])
    i = args.warmups
    while (command := control.command()) == "pass":
        if time.perf_counter() > deadline:
            entry["stopped"] = f"deadline: {args.deadline_s:.0f} s passed before pass {i}"
            control.reply(event="stopped", reason=entry["stopped"])
            continue
        yield i
        control.reply(event="pass", index=i, report=entry["passes"][-1])
        i += 1
    if command != "quit":
        control.reply(event="error", reason=f"unknown command {command!r}")


def _no_time_for(i: int, last: float | None, deadline: float, args, entry: dict[str, Any]) -> bool:
    if last is not None and time.perf_counter() + 1.3 * last > deadline:
        entry["stopped"] = f"deadline: {args.deadline_s:.0f} s would pass during pass {i}"
        return True
    return False


def _record_pass(entry: dict[str, Any], i: int, rep: dict[str, Any], args) -> None:
    """Passes before `args.warmups` warm vLLM up (it JIT-compiles during its first); the rest are timed."""
    if i < args.warmups:
        entry.setdefault("warmups", []).append(rep)
    else:
        entry["passes"].append(rep)
        entry["median"] = median_report(entry["passes"])
    log.info("vllm budget %s pass %d%s: makespan %.2f s", entry["budget"], i,
             " (warm-up)" if i < args.warmups else "", rep["makespan_s"])


def _run_budget_in_process(budget: int | None, model_dir: Path, requests: list[TraceRequest], inputs,
                           max_model_len: int, args, deadline: float, write: Callable[[dict], None],
                           control: Control | None = None) -> dict[str, Any]:
    """One budget on `LLMEngine` in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set before vLLM is
    imported), stepped by `closed_loop_stepped`: how RL frameworks colocate vLLM with their trainer."""
    from vllm import TokensPrompt
    from vllm.v1.engine.llm_engine import LLMEngine

    entry: dict[str, Any] = {"budget": _key(budget, True, args.speculative), "passes": [], "in_process": True,
                             "temperature": args.temperature, "turn_seeds": args.turn_seeds}
    t0 = time.perf_counter()
    counts, loggers = _draft_counts(args)
    engine = LLMEngine.from_engine_args(_engine_args(model_dir, max_model_len, budget, args, in_process=True),
                                        **loggers)
    entry["startup_s"] = time.perf_counter() - t0
    if args.drawn:
        t0 = time.perf_counter()
        _load_drawn(entry, args, engine.collective_rpc(draw_into, args=(args.model, *args.drawn)), t0)
    entry["chosen"] = _vllm_choices(engine)
    write(entry)
    for i in _passes(args, deadline, entry, control):
        engine.reset_prefix_cache()
        before = counts.snapshot()
        start, records = closed_loop_stepped(engine, requests, inputs, lambda ids: TokensPrompt(prompt_token_ids=ids),
                                             _sampling(args), tag=f"i{budget}-p{i}")
        _record_pass(entry, i, _pass_report(start, records, requests, counts, before, args), args)
        write(entry)
    return entry


def _draft_counts(args) -> tuple[DraftCounts, dict[str, Any]]:
    """The counter, and the engine's `from_engine_args` keywords that install it (none without drafts)."""
    counts = DraftCounts()
    return counts, ({"stat_loggers": [counts]} if args.speculative else {})


def _pass_report(start: float, records: Sequence[TurnRecord], requests: Sequence[TraceRequest],
                 counts: DraftCounts, before: tuple[int, int, int], args) -> dict[str, Any]:
    rep = report(start, records, len(requests))
    return {**rep, **counts.since(before)} if args.speculative else rep


def _key(budget: int | None, in_process: bool, speculative: str | None = None) -> str:
    drafts = f"~{speculative}" if speculative else ""
    return f"{budget if budget is not None else 'default'}{drafts}{'/in-process' if in_process else ''}"


async def _run_budget(budget: int | None, model_dir: Path, requests: list[TraceRequest], inputs, max_model_len: int,
                      args, deadline: float, write: Callable[[dict], None],
                      control: Control | None = None) -> dict[str, Any]:
    from vllm import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    entry: dict[str, Any] = {"budget": _key(budget, False, args.speculative), "passes": [],
                             "temperature": args.temperature, "turn_seeds": args.turn_seeds}
    t0 = time.perf_counter()
    counts, loggers = _draft_counts(args)
    engine = AsyncLLM.from_engine_args(_engine_args(model_dir, max_model_len, budget, args), **loggers)
    entry["startup_s"] = time.perf_counter() - t0
    if args.drawn:
        t0 = time.perf_counter()
        _load_drawn(entry, args, await engine.collective_rpc(draw_into, args=(args.model, *args.drawn)), t0)
    entry["chosen"] = _vllm_choices(engine)
    write(entry)

    def prompt(ids: list[int]):
        return TokensPrompt(prompt_token_ids=ids)

    passes = _passes(args, deadline, entry, control)
    try:  # (a command is awaited in a thread: the engine's output loop keeps running meanwhile)
        while (i := await asyncio.to_thread(next, passes, None)) is not None:
            await engine.reset_prefix_cache()
            before = counts.snapshot()
            params = _sampling(args)
            start, records = await closed_loop(engine, requests, inputs, prompt, params, tag=f"b{budget}-p{i}")
            _record_pass(entry, i, _pass_report(start, records, requests, counts, before, args), args)
            write(entry)
    finally:
        engine.shutdown()
    return entry


def _log_lines(path: Path | None, words: tuple[str, ...] = ("backend", "Using", "cudagraph", "torch.compile")) -> list:
    if path is None or not path.exists():
        return []
    lines = [ln.strip()[:300] for ln in path.read_text(errors="replace").splitlines() if any(w in ln for w in words)]
    return lines[:40]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.vllm_peer", description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True, help="JSONL trace (trace.schema)")
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--model", default="qwen3-30b-a3b-12l", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0,
                    help="input token ids and, sampled, each turn's seed (as the benchmark's --seed)")
    ap.add_argument("--temperature", type=temperature, default=0.0,
                    help="of every turn: 0 greedy, > 0 sampled (unseeded unless --turn-seeds)")
    ap.add_argument("--turn-seeds", action="store_true",
                    help="sampled: seed each turn as our replay does (vLLM then draws row by row; default: off, "
                         "its best)")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the preset's, or the trace's context")
    ap.add_argument("--budgets", default="default", help="comma-separated max_num_batched_tokens; 'default' = vLLM's")
    ap.add_argument("--passes", type=int, default=3, help="timed passes per budget (after the warm-up passes)")
    ap.add_argument("--warmups", type=int, default=2, help="untimed passes first (vLLM JIT-compiles during its first)")
    ap.add_argument("--in-process", action="store_true",
                    help="vLLM's engine core in this process (LLMEngine, VLLM_ENABLE_V1_MULTIPROCESSING=0), stepped by "
                         "the replay's own loop, as RL frameworks colocate it; default: AsyncLLM, its core apart")
    ap.add_argument("--speculative", default=None, metavar="ngram:K",
                    help="vLLM's prompt-lookup speculation, K tokens (budgets keyed '<budget>~ngram:K')")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--block-size", type=int, default=None,
                    help="vLLM's KV block size in tokens (cache_config.block_size); default: its own")
    ap.add_argument("--kv-cache-gb", type=float, default=None,
                    help="vLLM's KV cache in GiB (kv_cache_memory_bytes) instead of what its memory profile leaves")
    ap.add_argument("--serve", action="store_true",
                    help="one budget: warm up, answer 'ready', then one timed pass per 'pass' line on stdin "
                         "(module docstring); for the benchmark's interleaved passes")
    ap.add_argument("--reply-fd", type=int, default=None, help="--serve: the file descriptor answers go to")
    ap.add_argument("--deadline-s", type=float, default=480.0, help="stop before a pass that would end later")
    ap.add_argument("--log", default=None, help="vLLM's log file (read back for its backend choices)")
    ap.add_argument("--model-dir", default="/tmp/mr-vllm-model")
    ap.add_argument("--weights", default=None, metavar="FILE",
                    help="our model's weights (`save_weights`) for vLLM to load; default: vLLM's dummy init")
    ap.add_argument("--drawn-weights", default=None, metavar="SEED:STD",
                    help="our random model's weights (`benchmarks.rollout --seed/--weight-std`) drawn inside vLLM's "
                         "worker and loaded in place, with no file (module docstring)")
    return ap


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parser().parse_args(argv)
    if args.turn_seeds and not args.temperature:
        raise SystemExit("--turn-seeds seeds sampled turns: give --temperature > 0 (greedy turns draw nothing)")
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    if args.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    deadline = time.perf_counter() + args.deadline_s
    if args.speculative:
        speculative_config(args.speculative)  # a bad spec fails here, not after vLLM has started
    args.drawn = drawn_weights(args.drawn_weights) if args.drawn_weights else None  # (seed, std)
    if args.drawn:
        if args.weights:
            raise SystemExit("--weights and --drawn-weights: give vLLM one of them")
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # `draw_into` reaches its core's worker pickled
    budgets = [None if b.strip() == "default" else int(b) for b in args.budgets.split(",") if b.strip()]
    if args.serve and (len(set(budgets)) != 1 or args.reply_fd is None):
        raise SystemExit(f"--serve runs one budget with a --reply-fd, got --budgets {args.budgets!r} "
                         f"and --reply-fd {args.reply_fd!r}")
    cfg = PRESETS[args.model]
    requests = load_trace(args.trace)
    from megatron_rollout.trace.make import max_context

    need = max_context(requests) + 16
    max_model_len = args.max_model_len or max(cfg.max_position_embeddings, need)
    inputs = conversation_inputs(requests, args.seed, cfg.vocab_size)
    model_dir = write_model_dir(Path(args.model_dir), cfg, max_model_len, Path(args.weights) if args.weights else None)
    out = Path(args.out)
    result: dict[str, Any] = {"ran": False, "model": args.model, "max_model_len": max_model_len,
                              "trace": args.trace, "requests": len(requests), "temperature": args.temperature,
                              "turn_seeds": args.turn_seeds, "budgets": {},
                              "weights": args.weights or ("drawn " + args.drawn_weights if args.drawn_weights
                                                          else "dummy")}
    try:
        import vllm

        result["vllm"] = vllm.__version__
    except Exception as exc:
        result["error"] = f"vllm does not import: {type(exc).__name__}: {exc}"
        out.write_text(json.dumps(result, indent=1))
        return 1

    def write(entry: dict | None = None) -> None:
        if entry is not None:
            result["budgets"][str(entry["budget"])] = entry
        done = {k: e for k, e in result["budgets"].items() if e.get("median")}
        if done:
            best = min(done, key=lambda k: done[k]["median"]["makespan_s"])
            result.update(ran=True, best_budget=best, median=done[best]["median"], repeats=done[best]["passes"])
        result["log_lines"] = _log_lines(Path(args.log) if args.log else None)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=str))
        tmp.replace(out)

    control = Control(sys.stdin, os.fdopen(args.reply_fd, "w")) if args.serve else None
    for budget in dict.fromkeys(budgets):
        key = _key(budget, args.in_process, args.speculative)
        if time.perf_counter() + 90 > deadline:  # a start-up alone takes about a minute
            result.setdefault("skipped_budgets", []).append(key)
            if control is not None:
                control.reply(event="error", reason=f"no time left to start vLLM at {key}")
            continue
        try:
            if args.in_process:
                _run_budget_in_process(budget, model_dir, requests, inputs, max_model_len, args, deadline, write,
                                       control)
            else:
                asyncio.run(_run_budget(budget, model_dir, requests, inputs, max_model_len, args, deadline, write,
                                        control))
        except Exception as exc:  # one budget failing must not lose the others
            log.exception("vLLM at budget %s failed", key)
            result["budgets"][key] = {"budget": key, "error": f"{type(exc).__name__}: {exc}"}
            if control is not None:
                control.reply(event="error", reason=result["budgets"][key]["error"])
        write()
    write()
    return 0 if result.get("ran") else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # vLLM's background threads must not keep the process alive
