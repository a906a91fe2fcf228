"""The host's share of a decode step, measured without a GPU (issue 14's host-time item).

A decode step on the GPU is a graph replay of a few ms; everything the host does around it (plan,
inputs, the static layout's refill, sampling, bookkeeping) runs while the GPU idles unless it is
overlapped, so it is worth timing by itself, on any machine:

- `engine`: wall time of `RolloutEngine.step()` with a runner that returns logits at once (no
  model), every request decoding: the engine's own host time per step at a batch size.
- `fill`: `StaticDecodeLayout.fill` of a decode batch, full (every table entry converted from
  Python ints each step) against keyed (`SpanInput.key`: only a table's new entries), at long
  and short contexts. `verify fill`: the same for a verify forward's one-query rows, each row
  drafting 0 to 4 tokens, a new count every step (the rows after it move).
- `layout`: `build_layout` of a `chunked` mixed step (decode rows and a 2,048-token prefill chunk,
  as an eager or piecewise forward builds it every time), full against through a `TableCache`.
  `turn layout`: the same for a 16,384-token prefill epoch over sessions' next turns, whose tables
  the cache holds from their previous turns.
- `sample`: one decode step's draw of a batch of rows over a 151,936-token vocabulary (Qwen3's), on
  `--device`, issued and read back: greedy, ours at temperature 1 (a host uniform per row, an inverse
  CDF on the device) and a reference exponential race over every row at once (vLLM's unseeded
  draw), interleaved.
- `verdicts` (`ROWSxK`): the sampled rows of one drafting step decided (temperature 1, 151,936 ids,
  each row K random drafts, 0 for none) row by row (`speculative.verify`, or `sample_row` for a row
  without drafts: each a host read of its own, the executor's path before `verify_lookup`) against
  all at once (`speculative.verify_lookup`: one read), interleaved, on `--device` (a GPU is where the
  per-row reads cost: each waits for the device).
- `lookup`: one n-gram lookup and the sync of one new token (`drafts.NgramIndex.propose`, `sync`),
  as a decode step does for each drafting row, over contexts of given lengths: text-like ids
  (Zipf-distributed, where suffixes mostly recur far back or not at all), ids drawn uniformly
  from Qwen3's 151,936 (what `trace.replay` appends as each turn's input: no suffix recurs), and
  a context whose last 300 tokens repeat (where the latest match is recent: the case drafts pay in).
- `append`: `Session.append` of a turn of given length (ids uniform over the model's vocabulary,
  as `trace.replay` appends each turn's input): the per-token checks a turn's tokens get before
  the engine takes them, in microseconds per 1,000 tokens.
- `startup` (`--startup TRACE.jsonl`): a replay's start-up, which no step record covers: the first
  turn of each conversation of a trace drawn, appended and submitted, in ms and us per token.
- `drafting`: the engine's step as in `engine`, plain against n-gram drafting (`~ngram:4`),
  interleaved. The instant runner's logits make every row repeat one token, so after a few steps
  every draft is accepted and each row emits k + 1 tokens a step: the most host work a drafting
  step does (verdicts, the tokens' bookkeeping, the next lookups). On the GPU that work sits
  between a verify forward and the next, which are not issued ahead (only steps that draft nothing
  are, where the engine decodes ahead).

Repeats interleave the variants; medians and [min-max] over them. Run:
`python -m benchmarks.host` (CPU; the figures are this machine's host, not the GPU
machine's).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_rollout.forward import Forward
from megatron_rollout.kernels.layout import StaticDecodeLayout
from megatron_rollout.kernels.registry import PortableAttention
from megatron_rollout.kv.paged import SeqSpan
from megatron_rollout.runner.base import SpanInput
from megatron_rollout.types import Phase


class InstantRunner:
    """A runner without a model: zero logits for the sampled rows (zero hidden states for a
    speculative forward, which `model`'s head turns into logits), at once."""

    def __init__(self, cache, vocab: int, model=None) -> None:
        self.cache, self.vocab, self.model = cache, vocab, model

    def forward(self, inputs: list[SpanInput], phase: Phase) -> Forward:
        return self._zeros(sum(1 for i in inputs if i.sample), self.vocab)

    def forward_hidden(self, inputs: list[SpanInput], phase: Phase) -> Forward:
        return self._zeros(sum(i.span.new for i in inputs), self.model.cfg.hidden_size)

    def _zeros(self, rows: int, width: int) -> Forward:
        return torch.zeros(rows, width)
        yield  # a forward with no boundary


LOOKUP_VOCAB = 151_936
"""Qwen3's vocabulary: the ids of the lookup stage's contexts."""


def _summary(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def _engine_step(rows: int, rep: int, drafts: int | None, prompt: int = 48, steps: int = 50) -> tuple[float, float]:
    """(host ms per engine step, tokens emitted per step) with `rows` decoding requests (tiny-moe
    bookkeeping, no model), n-gram drafts of `drafts` tokens or none."""
    from megatron_rollout.engine import EngineConfig, KVConfig, RolloutEngine, SamplingParams, SchedulerConfig
    from megatron_rollout.engine.config import SpeculativeConfig
    from megatron_rollout.model.config import PRESETS
    from megatron_rollout.model.transformer import MoETransformer

    cfg = PRESETS["tiny-moe"]
    warm = 8  # the prefill, then decode only (drafts find the repeated token after a few steps)
    per_row = (warm + steps) * (1 + (drafts or 0)) + 16  # no row finishes while timed
    model = MoETransformer(cfg).init_weights(rep)  # its head turns the zero hidden states into logits
    engine = RolloutEngine(model, EngineConfig(
        scheduler=SchedulerConfig("off", max_batch_tokens=rows * prompt, max_decode_rows=rows),
        kv=KVConfig(num_blocks=rows * ((prompt + per_row) // 16 + 2)),
        speculative=SpeculativeConfig("ngram", drafts) if drafts else None))
    engine.runner = engine.executor.runner = InstantRunner(engine.runner.cache, cfg.vocab_size, model)
    rng = np.random.default_rng(rep)
    params = SamplingParams(temperature=0.0, max_new_tokens=per_row, ignore_stop=True)
    for _ in range(rows):
        engine.add_request(rng.integers(0, cfg.vocab_size, prompt).tolist(), params)
    for _ in range(warm):
        engine.step()
    before = engine.stats.decode_tokens
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    spent = time.perf_counter() - t0
    return spent / steps * 1e3, (engine.stats.decode_tokens - before) / steps


def engine_step_ms(rows: int, prompt: int = 48, steps: int = 50, repeats: int = 3) -> dict[str, float]:
    """Host ms per engine step with `rows` decoding requests (tiny-moe bookkeeping, no model)."""
    return _summary([_engine_step(rows, rep, None, prompt, steps)[0] for rep in range(repeats)])


LOOKUP_KINDS = ("text", "uniform", "loop")


def lookup_us(length: int, kind: str, steps: int = 200, repeats: int = 3) -> dict[str, float]:
    """Microseconds of one `propose(4)` and one one-token `sync` of an `NgramIndex(2, 4)` over a
    `length`-token context, `kind` "text" (Zipf ids), "uniform" (ids uniform over `LOOKUP_VOCAB`) or
    "loop" (its last 300 tokens said 3 more times), and the share of lookups that proposed drafts."""
    from megatron_rollout.drafts import NgramIndex

    samples, proposed = [], 0
    for rep in range(repeats):
        rng = np.random.default_rng(rep)
        tokens = (rng.integers(0, LOOKUP_VOCAB, length + steps) if kind == "uniform" else
                  np.minimum(rng.zipf(1.2, length + steps), LOOKUP_VOCAB - 1)).tolist()
        context, extra = tokens[:length], tokens[length:]
        if kind == "loop":  # the period goes on through the timed steps
            period = context[-300:]
            context += period * 3
            extra = period * (1 + steps // len(period))
        index = NgramIndex(2, 4)
        index.sync(context)
        t0 = time.perf_counter()
        for i in range(steps):
            proposed += bool(index.propose(4))
            context.append(extra[i])
            index.sync(context)
        samples.append((time.perf_counter() - t0) / steps * 1e6)
    return {**_summary(samples), "proposed": proposed / (steps * repeats)}


def drafting_step_ms(rows: int, drafts: int = 4, steps: int = 40, repeats: int = 3) -> dict[str, dict[str, float]]:
    """Host ms per engine step, plain (`plain`) against n-gram drafting (`ngram:<drafts>`), interleaved,
    with the tokens each emitted per step (module docstring)."""
    variants = {"plain": None, f"ngram:{drafts}": drafts}
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    for rep in range(repeats):
        for key, k in variants.items():
            samples[key].append(_engine_step(rows, rep, k, steps=steps))
    return {key: {**_summary([ms for ms, _ in v]), "tokens_per_step": statistics.median(t for _, t in v)}
            for key, v in samples.items()}


def fill_ms(rows: int, blocks: int, steps: int = 40, repeats: int = 5, drafts: int = 0) -> dict[str, dict[str, float]]:
    """Host ms per `StaticDecodeLayout.fill` of `rows` rows of `blocks`-entry tables, every row
    gaining a block every 16 steps, full against keyed, interleaved. `drafts` > 0: a verify forward's
    fill, as the CUDA runner makes it (`runner.speculative.flatten`): each row drafts 0 to `drafts`
    tokens, a new count every step, so the one-query rows after it move up or down."""
    from megatron_rollout.runner.speculative import flatten

    rng = np.random.default_rng(0)
    tables = [[int(b) for b in rng.integers(0, 1 << 20, blocks)] for _ in range(rows)]
    layouts = {m: StaticDecodeLayout(rows * (1 + drafts), blocks + steps, 16, PortableAttention(), 32, 4, 128,
                                     torch.device("cpu"), 132, max_run=1 + drafts) for m in ("full", "keyed")}
    samples: dict[str, list[float]] = {m: [] for m in layouts}
    for _ in range(repeats):
        for mode, layout in layouts.items():
            spent = 0.0
            for step in range(steps):
                if step % 16 == 0:
                    for table in tables:
                        table.append(int(rng.integers(0, 1 << 20)))
                counts = rng.integers(0, drafts + 1, rows).tolist()
                flat = flatten([SpanInput(SeqSpan(tuple(t), 16 * len(t) - 1, 1 + d), [1] * (1 + d), True, (r, 0))
                                for r, (t, d) in enumerate(zip(tables, counts))])
                t0 = time.perf_counter()
                layout.fill([f.span for f in flat], [1] * len(flat), [f.key for f in flat] if mode == "keyed" else None,
                            [1 + d for d in counts] if drafts else None)
                spent += time.perf_counter() - t0
            samples[mode].append(spent / steps * 1e3)
    return {m: _summary(v) for m, v in samples.items()}


def layout_ms(rows: int, blocks: int, chunk: int = 2048, steps: int = 20, repeats: int = 3
              ) -> dict[str, dict[str, float]]:
    """Host ms per `build_layout` of a `chunked` mixed step: `rows` decode rows of `blocks`-entry
    tables, every row gaining a block every 16 steps, and a prefill chunk of `chunk` tokens of a prompt
    prefilled from its start (its table grows by the chunk each step; a new prompt each repeat);
    without a `TableCache` (`full`) against with one (`keyed`), interleaved."""
    from megatron_rollout.kernels.layout import TableCache, build_layout

    rng = np.random.default_rng(0)
    tables = [[int(b) for b in rng.integers(0, 1 << 20, blocks)] for _ in range(rows)]
    caches = {"full": None, "keyed": TableCache()}
    samples: dict[str, list[float]] = {m: [] for m in caches}
    for _ in range(repeats):
        for mode, cache in caches.items():
            spent = 0.0
            tables[rows:] = [[]]  # the prompt being prefilled: a chunk a step from its start
            for step in range(steps):
                if step % 16 == 0:
                    for table in tables[:rows]:
                        table.append(int(rng.integers(0, 1 << 20)))
                tables[rows] += [int(b) for b in rng.integers(0, 1 << 20, chunk // 16)]
                spans = [SeqSpan(tuple(t), 16 * len(t) - 1, 1) for t in tables[:rows]]
                spans.append(SeqSpan(tuple(tables[rows]), 16 * len(tables[rows]) - chunk, chunk))
                tokens = [[1]] * rows + [[1] * chunk]
                t0 = time.perf_counter()
                build_layout(spans, tokens, [True] * (rows + 1), 16, PortableAttention(), 32, 4, 128,
                             torch.device("cpu"), keys=[*range(rows), (rows, len(samples[mode]))], cache=cache)
                spent += time.perf_counter() - t0
            samples[mode].append(spent / steps * 1e3)
    return {m: _summary(v) for m, v in samples.items()}


def turn_layout_ms(requests: int, blocks: int, tokens: int = 16_384, repeats: int = 5) -> dict[str, dict[str, float]]:
    """Host ms per `build_layout` of a prefill epoch of `tokens` new tokens over `requests` sessions'
    next turns, each session's table `blocks` entries long, the new turn's blocks at its end: without
    a `TableCache` (`full`) against one that holds each session's table from its previous turn
    (`keyed`, keyed by `Seq.table_key`), interleaved."""
    from megatron_rollout.kernels.layout import TableCache, build_layout

    rng = np.random.default_rng(0)
    per = tokens // requests
    new_blocks = -(-per // 16)
    tables = [tuple(int(b) for b in rng.integers(0, 1 << 20, blocks)) for _ in range(requests)]
    spans = [SeqSpan(t, 16 * (blocks - new_blocks), per) for t in tables]
    ids = [rng.integers(0, LOOKUP_VOCAB, per).tolist() for _ in range(requests)]
    samples: dict[str, list[float]] = {"full": [], "keyed": []}
    for _ in range(repeats):
        for mode in samples:
            cache = TableCache() if mode == "keyed" else None
            if cache is not None:  # the previous turn: every table but this turn's blocks
                for r, t in enumerate(tables):
                    cache.entries((r, 0), t[:blocks - new_blocks])
            t0 = time.perf_counter()
            build_layout(spans, ids, [True] * requests, 16, PortableAttention(), 32, 4, 128, torch.device("cpu"),
                         keys=[(r, 0) for r in range(requests)], cache=cache)
            samples[mode].append((time.perf_counter() - t0) * 1e3)
    return {m: _summary(v) for m, v in samples.items()}


def append_us(tokens: int, repeats: int = 5) -> dict[str, dict[str, float]]:
    """Microseconds per 1,000 tokens of one `Session.append` of `tokens` ids (tiny-moe, no model)."""
    from megatron_rollout.engine import EngineConfig, KVConfig, RolloutEngine
    from megatron_rollout.model.config import PRESETS
    from megatron_rollout.model.transformer import MoETransformer

    cfg = PRESETS["tiny-moe"]
    engine = RolloutEngine(MoETransformer(cfg).init_weights(0), EngineConfig(kv=KVConfig(num_blocks=64)))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, tokens).tolist()
    samples = []
    for _ in range(repeats):
        session = engine.open_session()
        t0 = time.perf_counter()
        session.append(ids)
        samples.append((time.perf_counter() - t0) * 1e6 / (tokens / 1000))
        session.close()
    return {"append": _summary(samples)}


def startup_ms(trace_path: str, repeats: int = 5) -> dict[str, Any]:
    """A replay's start-up without a model: each conversation's first turn of the trace at
    `trace_path` drawn (`trace.replay.input_ids`), appended to a new session and
    submitted, on a fresh engine (tiny-moe bookkeeping, a KV pool and context that hold the trace);
    ms for all of them, and us per token."""
    from megatron_rollout.engine import EngineConfig, KVConfig, RolloutEngine, SamplingParams
    from megatron_rollout.model.config import PRESETS
    from megatron_rollout.model.transformer import MoETransformer
    from megatron_rollout.trace.replay import input_ids
    from megatron_rollout.trace.schema import group_conversations, load_trace

    cfg = PRESETS["tiny-moe"]
    firsts = [turns[0] for turns in group_conversations(load_trace(trace_path)).values()]
    tokens = sum(t.input_tokens for t in firsts)
    longest = max(t.input_tokens + t.output_tokens for t in firsts)
    model = MoETransformer(cfg).init_weights(0)
    samples = []
    for _ in range(repeats):
        engine = RolloutEngine(model, EngineConfig(kv=KVConfig(num_blocks=tokens // 16 + 16 * len(firsts)),
                                                   max_model_len=longest + 16, allow_long_context=True))
        t0 = time.perf_counter()
        for i, turn in enumerate(firsts):
            session = engine.open_session()
            session.append(input_ids(0, i, turn, cfg.vocab_size))
            session.submit(SamplingParams(temperature=0.0, max_new_tokens=turn.output_tokens, ignore_stop=True))
        samples.append((time.perf_counter() - t0) * 1e3)
    summary = _summary(samples)
    return {"turns": len(firsts), "tokens": tokens, "ms": summary, "us_per_token": 1e3 * summary["median"] / tokens}


def sample_ms(rows: int, device: str = "cpu", vocab: int = 151_936, repeats: int = 5) -> dict[str, dict[str, float]]:
    """ms of one decode step's draw of `rows` rows on `device`, issued and read back (`sampler.sample`):
    greedy (`t0`), ours at temperature 1 with a generator per row (`t1`: each row's uniform drawn on
    the host, an inverse CDF over the whole vocabulary on the device), and a reference `noise`, one
    exponential race for every row at once (probabilities over i.i.d. Exp(1) noise, the argmax: the
    draw vLLM makes for unseeded requests), interleaved. `issue_ms`: the host's time until the draw is
    issued; the rest runs while the host waits for its copy."""
    from megatron_rollout.engine import SamplingParams
    from megatron_rollout.engine.sampler import PendingDraw

    dev = torch.device(device)
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3).to(dev, torch.bfloat16)
    gens = [torch.Generator().manual_seed(i) for i in range(rows)]
    noise = torch.empty(rows, vocab, device=dev)

    def ours(temperature: float) -> Callable[[], float]:
        params = [SamplingParams(temperature=temperature)] * rows

        def run() -> float:
            t0 = time.perf_counter()
            draw = PendingDraw(logits, params, gens)
            issued = time.perf_counter()
            draw.result(range(rows))
            return issued - t0
        return run

    def race() -> float:
        t0 = time.perf_counter()
        token = (logits.float().softmax(-1) / noise.exponential_()).argmax(-1)
        issued = time.perf_counter()
        token.tolist()
        return issued - t0

    variants = {"t0": ours(0.0), "t1": ours(1.0), "noise": race}
    for run in variants.values():  # warm
        run()
    total: dict[str, list[float]] = {k: [] for k in variants}
    issue: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for key, run in variants.items():
            t0 = time.perf_counter()
            issue[key].append(run() * 1e3)
            total[key].append((time.perf_counter() - t0) * 1e3)
    return {k: {**_summary(total[k]), "issue_ms": statistics.median(issue[k])} for k in variants}


def verdicts_ms(rows: int, drafts: int, device: str = "cpu", vocab: int = 151_936, repeats: int = 5
                ) -> dict[str, dict[str, float]]:
    """Host ms to decide one step's `rows` sampled rows of `drafts` drafts each, row by row (`rows`)
    against at once (`at_once`), interleaved, the logits on `device` (module docstring)."""
    from megatron_rollout.engine import SamplingParams
    from megatron_rollout.engine.sampler import sample_row
    from megatron_rollout.engine.speculative import LookupRow, verify, verify_lookup

    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows * (drafts + 1), vocab, generator=gen) * 3).to(device, torch.bfloat16)
    params = SamplingParams(temperature=1.0)
    asks = [LookupRow(r * (drafts + 1), tuple(torch.randint(0, vocab, (drafts,), generator=gen).tolist()), params,
                      torch.Generator().manual_seed(r)) for r in range(rows)]

    def one_by_one() -> None:
        for a in asks:
            if a.drafts:
                verify(logits[a.start:a.start + drafts + 1], list(a.drafts), None, params, a.generator)
            else:
                sample_row(logits[a.start], params, a.generator)

    variants = {"rows": one_by_one, "at_once": lambda: verify_lookup(logits, asks)}
    for run in variants.values():  # warm
        run()
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for key, run in variants.items():
            t0 = time.perf_counter()
            run()
            samples[key].append((time.perf_counter() - t0) * 1e3)
    return {k: _summary(v) for k, v in samples.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.host", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16,64,256", help="decode batch sizes of the engine stage")
    ap.add_argument("--fill", default="16x1300,64x1300,64x128", help="rows x table entries of the fill stage")
    ap.add_argument("--verify-fill", default="16x1300,16x3750,64x1300",
                    help="rows x table entries of the verify fill stage (up to 4 drafts a row; '' skips it)")
    ap.add_argument("--layout", default="16x1300,64x1300,16x3750",
                    help="decode rows x table entries of the mixed-step layout stage ('' skips it)")
    ap.add_argument("--turn-layout", default="8x1300,32x3750",
                    help="sessions x table entries of the next-turn prefill layout stage ('' skips it)")
    ap.add_argument("--append", default="5000,50000", help="turn lengths of the append stage ('' skips it)")
    ap.add_argument("--sample", default="1,16,64", help="batch sizes of the sample stage ('' skips it)")
    ap.add_argument("--drafting", default="1,16,64", help="batch sizes of the drafting stage ('' skips it)")
    ap.add_argument("--verdicts", default="16x0,64x0,64x4",
                    help="rows x drafts of the sampled verdicts stage ('' skips it)")
    ap.add_argument("--device", default="cpu", help="the sample and verdicts stages' device (cpu, cuda)")
    ap.add_argument("--lookup", default="1000,17000,60000", help="context lengths of the lookup stage ('' skips it)")
    ap.add_argument("--startup", default="", metavar="TRACE.jsonl",
                    help="the start-up stage: submit the first turn of each conversation of this trace ('' skips it)")
    ap.add_argument("--compare", default=None, metavar="DIR",
                    help="only print DIR's host-before-*.json against its host-after-*.json as a table")
    args = ap.parse_args(argv)
    if args.compare:
        from benchmarks.report import host_table
        print(host_table(Path(args.compare)))
        return 0
    torch.set_num_threads(1)
    out: dict[str, Any] = {"torch": torch.__version__, "engine_step_ms": {}, "fill_ms": {}, "verify_fill_ms": {},
                           "layout_ms": {}, "turn_layout_ms": {}, "append_us": {}, "sample_ms": {},
                           "drafting_step_ms": {}, "verdicts_ms": {}, "lookup_us": {}, "startup": {}}
    for rows in (int(r) for r in args.rows.split(",") if r):
        out["engine_step_ms"][rows] = engine_step_ms(rows)
    for rows in (int(r) for r in args.drafting.split(",") if r):
        out["drafting_step_ms"][rows] = drafting_step_ms(rows)
    for spec in (s for s in args.verdicts.split(",") if s):
        rows, drafts = (int(v) for v in spec.split("x"))
        out["verdicts_ms"][spec] = verdicts_ms(rows, drafts, args.device)
    for length in (int(n) for n in args.lookup.split(",") if n):
        out["lookup_us"][length] = {kind: lookup_us(length, kind) for kind in LOOKUP_KINDS}
    for spec in (s for s in args.fill.split(",") if s):
        rows, blocks = (int(v) for v in spec.split("x"))
        out["fill_ms"][spec] = fill_ms(rows, blocks)
    for spec in (s for s in args.verify_fill.split(",") if s):
        rows, blocks = (int(v) for v in spec.split("x"))
        out["verify_fill_ms"][spec] = fill_ms(rows, blocks, drafts=4)
    for spec in (s for s in args.layout.split(",") if s):
        rows, blocks = (int(v) for v in spec.split("x"))
        out["layout_ms"][spec] = layout_ms(rows, blocks)
    for spec in (s for s in args.turn_layout.split(",") if s):
        requests, blocks = (int(v) for v in spec.split("x"))
        out["turn_layout_ms"][spec] = turn_layout_ms(requests, blocks)
    for tokens in (int(n) for n in args.append.split(",") if n):
        out["append_us"][tokens] = append_us(tokens)
    for rows in (int(r) for r in args.sample.split(",") if r):
        out["sample_ms"][rows] = sample_ms(rows, args.device)
    if args.startup:
        out["startup"] = startup_ms(args.startup)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
