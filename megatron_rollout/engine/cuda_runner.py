"""The CUDA runner: decode (D) as CUDA-graph replays on a high-priority stream, prefill (P) eager
on its own stream, over the same weights and the same paged KV (DESIGN.md §3, §8).

What it adds to `runner.ModelRunner` (same `forward(inputs, phase) -> Forward` contract, so the
engine and the mux driver are unchanged):

- **D graphs.** A pure decode batch (one new token per span) is padded to the next bucket size
  and replayed from a graph captured once per bucket (lazily, or all at once by `capture`). The
  graph reads static int32 buffers (`StaticDecodeLayout`) refilled by one pinned copy; the KV
  cache and the weights keep their addresses, since `update_weights` copies in place (the expert
  weights are stacked views, `Experts.restack`). Replacing `cache` (engine.release_kv /
  reclaim_kv) drops the graphs; they are captured again on next use.
- **Streams and events.** D runs on `d_stream` (high priority), P on `p_stream`. Each forward
  first waits for the caller's stream (weight copies, earlier host-to-device copies); its result
  is handed back through an event, so sampling on the caller's stream reads finished logits.
  P's KV writes are only read by D after the P epoch completed (the engine promotes requests
  after sampling them), and D's by P only after D's step was sampled, so no other cross-stream
  ordering is needed on one rank.
- **Asynchronous P.** P's forward is the model's generator, resumed segment by segment by the
  mux driver; every resume runs on `p_stream` and nothing in it synchronises with the host (the
  device expert exchange, `kernels.moe`), so the host enqueues P and returns to D at once. When
  the model's generator finishes, the runner yields `COMPLETION` boundaries until P's event has
  fired instead of blocking, so D iterations keep running while the GPU finishes P's tail. This
  is safe on one rank only (boundary counts would differ between ranks); `make_runner` gives
  this runner to single-rank models only.

`EngineConfig.runner` (`RunnerConfig`) picks the runner (`kind`) and holds this runner's knobs.

Green contexts (SM partitions for D and P) are measured by `bench.micro` and not used here: see
docs/benchmarks.md. Left out: multi-rank graphs (collectives inside captured graphs), MTP
lookahead, and FP8 expert GEMMs inside graphs (such models run D eagerly).
"""
from __future__ import annotations

import logging
import os
from bisect import bisect_left
from collections.abc import Sequence

import torch

from megatron_rollout.engine.config import RunnerConfig
from megatron_rollout.engine.runner import ModelRunner, Runner, SpanInput
from megatron_rollout.forward import BoundaryPoint, Forward, Site, run_to_end
from megatron_rollout.kernels.layout import KernelPagedBatch, StaticDecodeLayout, build_layout
from megatron_rollout.kernels.moe import install_device_exchange
from megatron_rollout.kernels.registry import resolve_attention
from megatron_rollout.kv.paged import PagedKVCache
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.types import Phase

log = logging.getLogger(__name__)

COMPLETION = BoundaryPoint(-1, Site.MOE_DATA)
"""Yielded by an asynchronous P forward after its last layer while the device finishes it."""

RUNNER_ENV = "MEGATRON_ROLLOUT_RUNNER"
"""auto | eager | cuda: the default of the CLI's `--runner` and of `make_runner` without a config."""


CudaRunnerConfig = RunnerConfig
"""The CUDA runner's knobs are `RunnerConfig`'s (`EngineConfig.runner`); the old name stays."""


def make_runner(model: MoETransformer, cache: PagedKVCache, config: RunnerConfig | None = None) -> Runner:
    """The engine's runner as `config.kind` says: `CudaRunner` for a single-rank model on CUDA
    ("auto", "cuda"), else `ModelRunner` ("auto", "eager").

    The engine always passes `EngineConfig.runner`. Without a config (scripts, tests) the kind is
    `MEGATRON_ROLLOUT_RUNNER`'s, the same convenience the CLI's `--runner` default offers."""
    config = config or RunnerConfig(kind=os.environ.get(RUNNER_ENV, "auto"))
    from megatron_rollout.comm.facade import LocalComm

    single = isinstance(model.comm, LocalComm)
    if config.kind == "eager" or (config.kind == "auto" and not (model.device.type == "cuda" and single)):
        return ModelRunner(model, cache)
    if model.device.type != "cuda" or not single:
        raise RuntimeError(f"runner kind 'cuda' ({RUNNER_ENV}=cuda or --runner cuda) needs a single-rank model "
                           f"on a CUDA device; got {model.device} with {type(model.comm).__name__}")
    return CudaRunner(model, cache, config)


class _DecodeGraph:
    """One captured decode step for batches of up to `rows`."""

    def __init__(self, runner: "CudaRunner", rows: int) -> None:
        self.rows = rows
        self.static = StaticDecodeLayout(rows, runner.table_width, runner.cache.block_size, runner.kernels,
                                         runner.q_heads, runner.kv_heads, runner.cfg.kv_channels, runner.device,
                                         runner.num_sms)
        self.attn = KernelPagedBatch(runner.cache, self.static.layout, runner.kernels)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def _step(self, model: MoETransformer) -> torch.Tensor:
        s = self.static
        return run_to_end(model.step(s.tokens, s.positions, self.attn, Phase.D, logits_index=s.logits_rows))

    def capture(self, model: MoETransformer, stream: torch.cuda.Stream, pool) -> None:
        self.static.fill_padding()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks its kernels
                self._step(model)
        stream.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self.graph, pool=pool, stream=stream):
            self.logits = self._step(model)


class CudaRunner:
    """`ModelRunner`'s contract on one GPU: graphs for D, streams for P and D, async P."""

    def __init__(self, model: MoETransformer, cache: PagedKVCache, config: RunnerConfig | None = None) -> None:
        if model.device.type != "cuda":
            raise RuntimeError(f"CudaRunner needs a model on CUDA, got {model.device}")
        self.model, self.config = model, config or RunnerConfig()
        self.cfg = model.cfg
        self.device = model.device
        self.kernels = resolve_attention(self.config.attention, self.device)
        self.q_heads = cache.k.shape[2] * self.cfg.heads_per_group if cache is not None else 0
        self.kv_heads = cache.k.shape[2] if cache is not None else 0
        self.table_width = -(-self.cfg.max_position_embeddings // (cache.block_size if cache is not None else 16))
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.d_stream = torch.cuda.Stream(self.device, priority=self.config.d_priority)
        self.p_stream = torch.cuda.Stream(self.device, priority=0)
        self.graph_safe = install_device_exchange(model)
        if not self.graph_safe:
            log.warning("MoE layers are not graph-safe (not bf16, FP8 experts, or a multi-rank comm): "
                        "decode runs eagerly")
        self.expert_kernels = self._choose_expert_kernels()
        self._graphs: dict[int, _DecodeGraph] = {}
        self._weights_ptr = model.embedding.word_embeddings.weight.data_ptr()  # see _graphable
        self._pool = None
        self.capture_error: str | None = None
        self._cache = cache
        self.stats = {"graph_replays": 0, "eager_forwards": 0, "completion_polls": 0}

    def _choose_expert_kernels(self) -> dict:
        """Measure the small-batch expert kernels once (Triton vs grouped GEMM) and keep the faster."""
        if not self.config.measure_expert_kernels or not self.graph_safe:
            return {"choice": "grouped_mm", "reason": "not measured"}
        try:
            from megatron_rollout.kernels.moe import choose_small_kernels

            return choose_small_kernels(self.model)
        except Exception as exc:  # Triton missing or failing: the grouped GEMM always works
            log.warning("small-batch expert kernels not measured, keeping grouped_mm: %s", exc)
            return {"choice": "grouped_mm", "error": f"{type(exc).__name__}: {exc}"}

    # -- the cache may be released and reclaimed by the engine ------------------------------
    @property
    def cache(self) -> PagedKVCache | None:
        return self._cache

    @cache.setter
    def cache(self, cache: PagedKVCache | None) -> None:
        if cache is not self._cache:
            self._graphs.clear()  # captured against the old tensors
            self._pool = None
        self._cache = cache
        if cache is not None:
            self.kv_heads = cache.k.shape[2]
            self.q_heads = self.kv_heads * self.cfg.heads_per_group
            self.table_width = -(-self.cfg.max_position_embeddings // cache.block_size)

    # -- public -------------------------------------------------------------------------------
    def forward(self, inputs: list[SpanInput], phase: Phase) -> Forward:
        """Logits [rows sampled, V] for the spans with `sample`, in input order."""
        if phase is Phase.D and self._graphable(inputs):
            graph = self._try_graph(self.bucket(len(inputs)))
            if graph is not None:
                return self._replay(graph, inputs)
        return self._eager(inputs, phase)

    def capture(self, batch_sizes: Sequence[int] | None = None) -> bool:
        """Capture decode graphs now (largest first, sharing one memory pool); False if capture
        failed (decode then runs eagerly; `capture_error` says why)."""
        if not (self.config.use_graphs and self.graph_safe):
            return False
        return all(self._try_graph(rows) is not None
                   for rows in sorted(batch_sizes or self.config.graph_batch_sizes, reverse=True))

    def bucket(self, rows: int) -> int | None:
        sizes = self.config.graph_batch_sizes
        i = bisect_left(sizes, rows)
        return sizes[i] if i < len(sizes) else None

    # -- decode graphs ------------------------------------------------------------------------
    def _graphable(self, inputs: list[SpanInput]) -> bool:
        if self.graph_safe and self.model.embedding.word_embeddings.weight.data_ptr() != self._weights_ptr:
            # WeightStore.bind re-pointed every parameter: captured graphs would read the old
            # tensors. Decode runs eagerly from now on (bind is meant for eager engines).
            log.warning("parameters were re-bound (WeightStore.bind): decode graphs dropped, decode runs eagerly")
            self.graph_safe = False
            self._graphs.clear()
        if not (self.config.use_graphs and self.graph_safe and inputs) or self.bucket(len(inputs)) is None:
            return False
        return all(i.span.new == 1 and i.sample and len(i.span.table) <= self.table_width for i in inputs)

    def _graph(self, rows: int) -> _DecodeGraph:
        graph = self._graphs.get(rows)
        if graph is None:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = _DecodeGraph(self, rows)
            graph.capture(self.model, self.d_stream, self._pool)
            self._graphs[rows] = graph
            log.info("captured decode graph for %d rows", rows)
        return graph

    def _try_graph(self, rows: int) -> _DecodeGraph | None:
        """The graph for `rows`, or None (and decode stays eager from now on) if capture fails."""
        try:
            return self._graph(rows)
        except Exception as exc:  # a capture failure must not stop the rollout: D runs eagerly
            log.warning("decode graph capture for %d rows failed, decode runs eagerly: %s", rows, exc)
            self.graph_safe = False
            self.capture_error = f"{type(exc).__name__}: {exc}"
            self._graphs.clear()
            torch.cuda.synchronize(self.device)
            return None

    def _replay(self, graph: _DecodeGraph, inputs: list[SpanInput]) -> Forward:
        n = len(inputs)
        caller = torch.cuda.current_stream()
        self.d_stream.wait_stream(caller)
        with torch.cuda.stream(self.d_stream):
            graph.static.fill([i.span for i in inputs], [i.token_ids[0] for i in inputs])
            graph.graph.replay()
        caller.wait_stream(self.d_stream)
        self.stats["graph_replays"] += 1
        return graph.logits[:n]
        yield  # a generator with no boundary, like the model's D forward on one rank

    # -- eager forwards (P, mixed chunked batches, decode batches past the largest bucket) ----
    def _eager(self, inputs: list[SpanInput], phase: Phase) -> Forward:
        stream = self.p_stream if phase is Phase.P else self.d_stream
        caller = torch.cuda.current_stream()
        self.stats["eager_forwards"] += 1
        with torch.cuda.stream(stream):
            stream.wait_stream(caller)
            layout = build_layout([i.span for i in inputs], [i.token_ids for i in inputs], [i.sample for i in inputs],
                                  self.cache.block_size, self.kernels, self.q_heads, self.kv_heads,
                                  self.cfg.kv_channels, self.device, self.num_sms)
            attn = KernelPagedBatch(self.cache, layout, self.kernels)
            gen = self.model.step(layout.tokens, layout.positions, attn, phase, logits_index=layout.logits_rows)
        while True:
            caller = torch.cuda.current_stream()
            with torch.cuda.stream(stream):
                stream.wait_stream(caller)
                try:
                    point = next(gen)
                except StopIteration as stop:
                    logits = stop.value
                    break
            yield point
        done = torch.cuda.Event()
        done.record(stream)
        if self.config.async_prefill and phase is Phase.P:
            while not done.query():
                self.stats["completion_polls"] += 1
                yield COMPLETION
        caller = torch.cuda.current_stream()
        caller.wait_event(done)
        logits.record_stream(caller)
        return logits
