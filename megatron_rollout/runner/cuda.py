"""The CUDA runner: decode (D) as CUDA-graph replays on a high-priority stream, prefill (P) on its
own stream (piecewise graphs on one rank, eager on many), over the same weights and the same paged
KV, on one rank or many (docs/design.md §3, §5, §6, §8).

What it adds to `base.ModelRunner` (same `forward(inputs, phase) -> Forward` contract, so the
engine and the mux driver are unchanged):

- **D graphs.** A pure decode batch (one new token per span) is padded to the next bucket size
  and replayed from a graph captured once per bucket. The graph reads static int32 buffers
  (`StaticDecodeLayout`) refilled by one pinned copy; the KV cache and the weights keep their
  addresses, since `update_weights` copies in place (the expert weights are stacked views,
  `Experts.restack`; over a Megatron trainer's storage, the trainer's own stacks,
  `weights.megatron_experts`, which its in-place optimizer steps write). Replacing `cache` drops
  the graphs; `engine.sleep` releases them with their pools and `restore_graphs` captures the
  same buckets again (`engine.memory`), except where the KV and the weights sleep in
  address-stable memory: the cache object and every address stay, and so do the graphs.
  `stats["graph_captures"]` counts the captures (decode, piecewise, verify and draft). On one rank buckets are
  captured lazily, when first used.
- **P and mixed graphs (one rank).** A P forward, or a `chunked` mixed step, of up to 4,096 new
  tokens replays as pieces between attention calls, one CUDA graph per token bucket
  (`runner.piecewise`, `RunnerConfig.prefill_graph_tokens`), in a pool of its own; larger ones,
  and every P forward on many ranks, run eagerly.
- **Many ranks.** With a `DistComm` the graphs capture D's collectives on D's own communicators:
  the ATP all-reduce, the padded ADP all-gather and the low-latency expert exchange, all of static
  shape with counts consumed on the device (`CommConfig.counts="device"`, the default on CUDA;
  with host-read counts the model is not graph-safe and D runs eagerly). Capture runs real
  warm-up forwards, whose collectives must pair up across ranks, so every bucket is captured at
  once at the first D forward (every rank runs that forward at the same step: D iterations are
  collective), and the ranks then agree over the CPU group whether all captures succeeded; if one
  failed anywhere, every rank drops its graphs and runs D eagerly (same collectives, same shapes).
  A rank replays whichever bucket its own rows need: the collectives' shapes do not depend on it.
- **Streams and events.** D runs on `d_stream` (high priority), P on `p_stream`; the comm's
  router is bound to these two streams (`Router.bind_streams`), so every collective a phase issues
  runs on that phase's stream, and the registered conflicting P collective runs on `d_stream`
  right after D's iteration, after an event from P's stream, with P's stream waiting for its
  completion (docs/design.md §6 rule 3). A forward first waits for the caller's stream (weight copies,
  earlier host-to-device copies) when it starts; a P forward's later segments wait for nothing on
  the host side (weights cannot change during an epoch, P's and D's KV blocks are disjoint). The
  result is handed back through an event, so sampling on the caller's stream reads finished
  logits. P's KV writes are only read by D after the P epoch completed (the engine promotes
  requests after sampling them), and D's by P only after D's step was sampled.
- **Asynchronous P.** P's forward is the model's generator, resumed segment by segment by the
  mux driver; every resume runs on `p_stream` and nothing in it synchronises with the host (the
  device expert exchange, `kernels.moe`, or the comm's sync-free exchanges), so the host enqueues P
  and returns to D at once. When the model's generator finishes, the runner yields `COMPLETION`
  (layer -1) until P's event has fired instead of blocking, so D iterations keep running while the
  GPU finishes P's tail. Across ranks this is safe because by then every collective of P is
  enqueued, and the drivers agree on the poll: the turnstile publishes no boundary for a
  completion poll, checks only published boundaries at its rendezvous and ends the epoch only
  when every rank reports P finished; `off`/`chunked` run P to its end (the poll then only spins
  on this rank); the naive baseline agrees on "P done" through its own rendezvous.
- **Deferred checks.** The sync-free dispatch domains accumulate sequence-number disagreements
  on the device; after each forward their counters are copied to pinned memory on the forward's
  stream and read once that copy has completed, at a later forward (never waiting): a rank-order
  mismatch raises `SequenceMismatch` there.
- **Fused ops.** `kernels.fused.install_fused_ops` chooses the Triton kernel set for the model's
  small ops (`MoETransformer.use_ops`) where they apply (`RunnerConfig.fused_ops`), after the
  expert exchange is installed.

`EngineConfig.runner` (`RunnerConfig`) picks the runner (`kind`) and holds this runner's knobs.

- **Speculative decoding (MTP, one rank).** `forward_hidden` and `forward_mtp` serve
  `engine.drafting`: in D the verify forward (a row's pending token and its k drafts) and the MTP
  layer's forwards run as decode graphs over one-query rows (`runner.speculative.flatten`), a
  row's positions marked as one run so that GQA attention reads their history once (`MAX_RUN`), one
  graph per `DecodeOutput` and row bucket, captured lazily in the decode graphs' pool; a D batch
  past the largest bucket runs eagerly. P and mixed forwards replay piecewise graphs of hidden
  states (`PiecewiseGraph(hidden=True)`), their MTP layer runs eagerly. Rejected drafts need
  nothing from the runner: the next forward rewrites their K/V. Many ranks are refused (these
  graphs are not captured collectively).
- **MLA.** A multi-latent-attention model (DeepSeek-V3) attends through `kernels.mla_attention`
  (`registry.resolve_mla_attention`), in its decode graphs and between its piecewise P graphs'
  pieces alike; of the fused small ops it uses those it calls (norms, SwiGLU, the combine).
- **SM partitions.** With `RunnerConfig.decode_sms` P's stream is a green context over the device
  minus that many SMs (`runner.partition`). Under `mux` a decode iteration then runs beside the
  prefill segment in flight on SMs no prefill block holds, instead of waiting for its blocks to
  retire. P's piecewise graphs are captured on that stream and replay on its SMs. `partition`
  "held": D's stream and graphs keep the whole device. "split": while a P forward is in flight
  (from its first step until the device has finished it) D replays graphs captured on a green
  context of the held-back SMs alone, one per bucket and output, captured on first use; otherwise
  its whole-device graphs. `benchmarks.pd_overlap` measures both shapes on stand-ins
  (docs/benchmarks.md).

FP8 experts (`model.fp8`, stacked) are captured like bf16 ones on one rank (`kernels.moe_triton`'s
weight-only kernels). Left out: speculative decoding on many ranks, the MTP layer of P forwards in
graphs, FP8 experts on several ranks (such models run D eagerly), and SM partitions on many ranks.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import itertools
import logging
from bisect import bisect_left
from collections.abc import Hashable, Iterator, Sequence

import torch

from megatron_rollout.comm.facade import LocalComm
from megatron_rollout.forward import BoundaryPoint, Forward, Site, run_to_end
from megatron_rollout.kernels.layout import KernelPagedBatch, StaticDecodeLayout, TableCache, build_layout
from megatron_rollout.kernels.moe import DeviceLocalComm, install_device_exchange
from megatron_rollout.kernels.registry import resolve_attention, resolve_mla_attention
from megatron_rollout.kv.paged import PagedKVCache
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.multiplex.routing import PhaseStreams
from megatron_rollout.runner.base import CapturedGraphs, ModelRunner, Runner
from megatron_rollout.runner.config import RUNNER_ENV, RunnerConfig
from megatron_rollout.runner.partition import GreenStream, shared_partition
from megatron_rollout.runner.piecewise import PiecewiseGraph, SharedOutputs, release_rng_after_failed_capture
from megatron_rollout.runner.speculative import flatten
from megatron_rollout.types import Axis, Phase, SeqSpan, SpanInput

log = logging.getLogger(__name__)

PREFILL_HIDDEN = "prefill-hidden"
"""`CapturedGraphs.speculative`'s name for a piecewise P graph of hidden states."""
MAX_RUN = 8
"""Verify and draft graphs: a row and up to 7 drafts read their history once (`DecodeMeta.runs`);
longer runs are cut."""
COMPLETION = BoundaryPoint(-1, Site.MOE_DATA)
"""Yielded by an asynchronous P forward after its last layer while the device finishes it."""


def make_runner(model: MoETransformer, cache: PagedKVCache, config: RunnerConfig) -> Runner:
    """The runner `config.kind` names, chosen here only: `CudaRunner` for a model on CUDA, one rank
    or many ("auto", "cuda"), else `ModelRunner` ("auto", "eager")."""
    if config.kind == "eager" or (config.kind == "auto" and model.device.type != "cuda"):
        if config.decode_sms:
            raise ValueError(f"RunnerConfig.decode_sms={config.decode_sms} partitions the CUDA runner's prefill "
                             f"stream; the portable runner (kind {config.kind!r}, model on {model.device}) has none")
        return ModelRunner(model, cache)
    if model.device.type != "cuda":
        raise RuntimeError(f"runner kind 'cuda' (--runner cuda, or ${RUNNER_ENV}=cuda) needs a single-rank model "
                           f"on a CUDA device, or a multi-rank one whose DistComm is on CUDA (NCCL); got "
                           f"{model.device} with {type(model.comm).__name__}")
    return CudaRunner(model, cache, config)


class DecodeOutput(enum.Enum):
    """What a decode graph computes for each of its one-token rows."""

    LOGITS = "logits"
    """Plain decoding: the model's step, logits [rows, V]."""
    HIDDEN = "hidden"
    """Speculative verification (`runner.speculative.flatten`): the decoder's last hidden states [rows, H]."""
    MTP = "mtp"
    """Drafting: the first MTP layer over static `hidden` [rows, H] and next `tokens`, its output [rows, H]."""


class DecodeGraph:
    """One captured decode step for batches of up to `rows`: `static.fill` loads a batch into the
    static inputs (and, for `DecodeOutput.MTP`, the caller the static `hidden`), `graph.replay()`
    runs the step, `out` holds its result: logits [rows, V] by default (`output`)."""

    def __init__(self, runner: "CudaRunner", rows: int, output: DecodeOutput = DecodeOutput.LOGITS) -> None:
        self.rows, self.output = rows, output
        self.static = StaticDecodeLayout(rows, runner.table_width, runner.cache.block_size, runner.kernels,
                                         runner.q_heads, runner.kv_heads, runner.head_dim, runner.device,
                                         runner.num_sms, max_run=1 if output is DecodeOutput.LOGITS else MAX_RUN)
        self.attn = KernelPagedBatch(runner.cache, self.static.layout, runner.kernels)
        self.hidden = torch.zeros(rows, runner.cfg.hidden_size, dtype=runner.cfg.torch_dtype, device=runner.device) \
            if output is DecodeOutput.MTP else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        self.stream: torch.cuda.Stream | None = None
        """The stream it was captured on, which it replays on (D's, or D's partition's)."""

    def _step(self, model: MoETransformer) -> torch.Tensor:
        s = self.static
        if self.output is DecodeOutput.HIDDEN:
            return run_to_end(model.hidden_step(s.tokens, s.positions, self.attn, Phase.D))
        if self.output is DecodeOutput.MTP:
            return run_to_end(model.mtp_step(s.tokens, s.positions, self.hidden, self.attn, Phase.D))
        return run_to_end(model.step(s.tokens, s.positions, self.attn, Phase.D, logits_index=s.logits_rows))

    def capture(self, model: MoETransformer, stream: torch.cuda.Stream, pool, collective: bool) -> None:
        """Two warm-up steps, then the captured one. `collective`: the step issues NCCL collectives;
        the capture then tolerates other threads' CUDA calls (the process group's watchdog queries
        its events while a graph is being captured)."""
        self.static.fill_padding()
        self.stream = stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks its kernels, NCCL sets up
                self._step(model)
        stream.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        mode = "thread_local" if collective else "global"
        try:
            with torch.no_grad(), torch.cuda.graph(self.graph, pool=pool, stream=stream, capture_error_mode=mode):
                self.out = self._step(model)
        except BaseException:
            release_rng_after_failed_capture(stream.device)
            raise


class _DomainProbe:
    """The deferred sequence checks of the comm's sync-free dispatch domains, without a host wait:
    after a forward their counters are copied to pinned memory on the forward's stream (one buffer
    per stream, so P and D copies never share one), and read once that copy has completed."""

    def __init__(self, comm) -> None:
        domain_of = getattr(comm, "domain", None)
        found = [domain_of(p) for p in Phase] if domain_of is not None else []
        self.domains = [d for d in found if d is not None and getattr(d, "sync_free", False)]
        self._host: dict[int, list[torch.Tensor]] = {}
        self._pending: dict[int, torch.cuda.Event] = {}

    def after(self, stream: torch.cuda.Stream) -> None:
        if not self.domains:
            return
        key = stream.stream_id
        if key not in self._host:
            self._host[key] = [torch.zeros(d.ep_size, dtype=torch.int64, pin_memory=True) for d in self.domains]
        with torch.cuda.stream(stream):
            for buf, domain in zip(self._host[key], self.domains):
                buf.copy_(domain.fault_counters, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
        self._pending[key] = event

    def poll(self) -> None:
        """Raise `SequenceMismatch` for a domain whose completed snapshot shows one."""
        for key, event in list(self._pending.items()):
            if event.query():
                del self._pending[key]
                for buf, domain in zip(self._host[key], self.domains):
                    domain.check(buf.tolist())  # pinned host memory: reads no device


class CudaRunner:
    """`ModelRunner`'s contract on CUDA: graphs for D, streams for P and D, async P; one or many ranks."""

    def __init__(self, model: MoETransformer, cache: PagedKVCache, config: RunnerConfig | None = None) -> None:
        if model.device.type != "cuda":
            raise RuntimeError(f"CudaRunner needs a model on CUDA, got {model.device}")
        self.model, self.config = model, config or RunnerConfig()
        self.cfg = model.cfg
        self.device = model.device
        self.multi_rank = not isinstance(model.comm, LocalComm)
        """The model's comm crosses ranks (a `DistComm`): graphs are captured collectively."""
        if self.cfg.multi_latent_attention:  # one latent row per token: `kernels.mla_attention`
            self.kernels = resolve_mla_attention(self.config.attention, self.cfg.kv_lora_rank, self.device)
        else:
            self.kernels = resolve_attention(self.config.attention, self.device)
        self.q_heads = self.kv_heads = self.head_dim = 0
        self._set_dims(cache)
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.d_stream = torch.cuda.Stream(self.device, priority=self.config.d_priority)
        self.p_partition: GreenStream | None = None
        """P's green context when `RunnerConfig.decode_sms` holds SMs back from it (`runner.partition`)."""
        self.d_partition: GreenStream | None = None
        """D's green context of the held-back SMs (`RunnerConfig.partition` "split"), used beside P."""
        if self.config.decode_sms:
            if self.multi_rank:
                raise ValueError("RunnerConfig.decode_sms is for one rank: P's collectives on a green context's "
                                 "stream have not been run")
            self.p_partition, self.d_partition = shared_partition(self.config.decode_sms, self.device,
                                                                  decode_too=self.config.partition == "split")
        self.p_stream = self.p_partition.stream if self.p_partition else torch.cuda.Stream(self.device, priority=0)
        self._p_in_flight = 0  # P forwards issued and not yet complete on the device
        router = getattr(model.comm, "router", None)
        if router is not None:  # the comm's collectives must run on the streams the phases run on
            router.bind_streams(PhaseStreams(p=self.p_stream, d=self.d_stream))
        self.graph_safe = install_device_exchange(model)
        if not self.graph_safe:
            log.warning("MoE layers are not graph-safe (experts neither stacked bf16 nor stacked FP8, FP8 experts "
                        "on several ranks, or a multi-rank comm that reads counts on the host): decode runs eagerly")
        self.fused = self._install_fused_ops()
        self.expert_kernels = self._choose_expert_kernels()
        self._probe = _DomainProbe(model.comm)
        self._graphs: dict[int, DecodeGraph] = {}
        self._spec_graphs: dict[tuple[DecodeOutput, int], DecodeGraph] = {}  # verify and draft graphs (one rank)
        self._beside: dict[tuple[DecodeOutput, int], DecodeGraph] = {}  # D's graphs on its partition ("split")
        self.beside_capture_error: str | None = None  # why they failed (D then runs on the whole device)
        self.spec_capture_error: str | None = None  # why they failed to capture (they then run eagerly)
        self._p_graphs: dict[int, PiecewiseGraph] = {}  # P / mixed forwards by token bucket (one rank)
        self._p_hidden: dict[int, PiecewiseGraph] = {}  # the same, of hidden states (speculative decoding)
        self._p_pool = None  # their pool: never shared with decode graphs (see runner.piecewise)
        self._tables = TableCache()  # eager and piecewise forwards' block tables, by row key
        self._p_outputs = self._shared_outputs()  # their attention outputs, shared by the buckets
        self.prefill_capture_error: str | None = None  # why piecewise P capture failed (P then runs eagerly)
        self._captured = False  # multi-rank: the collective capture of every bucket was attempted
        self._weights_ptr = model.embedding.word_embeddings.weight.data_ptr()  # see _graphable
        self._pool = None
        self.capture_error: str | None = None
        self._cache = cache
        self.stats = {"graph_replays": 0, "graph_captures": 0, "eager_forwards": 0, "piecewise_forwards": 0,
                      "completion_polls": 0, "verify_replays": 0, "draft_replays": 0}

    def _install_fused_ops(self) -> dict:
        if not self.config.fused_ops:
            return {"backend": "none", "installed": False, "reason": "RunnerConfig.fused_ops is False"}
        from megatron_rollout.kernels.fused import install_fused_ops

        return install_fused_ops(self.model)

    def _choose_expert_kernels(self) -> dict:
        """Measure the small-batch expert kernels once (Triton vs grouped GEMM) and keep the faster."""
        if not self.config.measure_expert_kernels or not self.graph_safe or \
                not isinstance(self.model.comm, DeviceLocalComm):
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
            self.drop_graphs()  # decode graphs read the old tensors; P graphs' pool goes with the KV
        self._cache = cache
        if cache is not None:
            self._set_dims(cache)

    def _set_dims(self, cache: PagedKVCache | None) -> None:
        """Query heads, cached heads and attention output width of this rank, from its cache. Under
        MLA the cache holds one row for every local query head, and the output that matters is the
        latent (`kv_lora_rank` wide: the split-K workspace's width)."""
        self.table_width = -(-self.cfg.max_position_embeddings // (cache.block_size if cache is not None else 16))
        if cache is None:
            return
        self.kv_heads = cache.k.shape[2]
        if self.cfg.multi_latent_attention:
            self.q_heads = self.cfg.num_attention_heads // self.model.comm.size(Axis.ATP)
            self.head_dim = self.cfg.kv_lora_rank
        else:
            self.q_heads = self.kv_heads * self.cfg.heads_per_group
            self.head_dim = self.cfg.kv_channels

    # -- public -------------------------------------------------------------------------------
    def forward(self, inputs: list[SpanInput], phase: Phase) -> Forward:
        """Logits [rows sampled, V] for the spans with `sample`, in input order."""
        self._probe.poll()
        if phase is Phase.D and self.multi_rank and not self._captured and self.config.use_graphs:
            self._captured = True  # every rank's first D forward: capture every bucket together
            self._capture_collectively(self.graph_sizes)
        graph = self._decode_graph(inputs) if phase is Phase.D else None
        return self._replay(graph, inputs) if graph is not None else self._eager(inputs, phase)

    @property
    def overlaps_host(self) -> bool:
        """A forward issued ahead runs while the host works (`engine.ahead`): one rank only."""
        return not self.multi_rank

    def forward_fed(self, inputs: list[SpanInput], tokens: torch.Tensor) -> torch.Tensor | None:
        """`Runner.forward_fed`: on one rank, a decode graph replay whose token slots are copied on
        the device from `tokens`; None where the rows need an eager forward or many ranks."""
        graph = None if self.multi_rank else self._decode_graph(inputs)
        return None if graph is None else run_to_end(self._replay(graph, inputs, tokens))

    def capture(self, batch_sizes: Sequence[int] | None = None, speculative: Sequence[str] = (),
                plain: bool = True, plain_decode: Sequence[int] = ()) -> bool:
        """Capture decode graphs now (largest first, sharing one memory pool) and, on one rank, the
        piecewise P graphs of every token bucket, and (`partition` "split") D's graphs on its
        partition; False if decode capture failed (decode then runs eagerly; `capture_error` says
        why; `prefill_capture_error` for P, `beside_capture_error` for D's partition). On many
        ranks, every rank must call it at the same point (the warm-ups run collectives).
        `speculative`: the drafting outputs ("hidden" to verify, "mtp" to draft) to capture too, in the
        buckets of `batch_sizes`, with the piecewise hidden-state P graphs; otherwise a drafting
        engine captures each on first use, inside its first rollout. `plain=False` leaves out the
        plain decode and P graphs, which a drafting engine never replays; the result is then whether
        every verify and draft graph was captured (False on many ranks: drafting runs eagerly there).
        `plain_decode`: with `plain=False`, the plain decode graphs of these sizes still (n-gram
        drafting decodes its undrafted steps ahead on them, `engine.drafting`)."""
        if not plain and not speculative:
            raise ValueError("capture(plain=False) needs the speculative outputs to capture instead")
        if not (self.config.use_graphs and self.graph_safe):
            return False
        sizes = batch_sizes or self.graph_sizes
        if self.multi_rank:
            self._captured = True
            return self._capture_collectively(sizes) if plain else False
        decode = all(self._try_graph(rows) is not None for rows in sorted(sizes if plain else plain_decode,
                                                                          reverse=True))
        for hidden in ((False,) if plain else ()) + ((True,) if speculative else ()):
            for tokens in sorted(self.config.prefill_graph_tokens, reverse=True) if self.graph_safe else ():
                if self._prefill_graph(tokens, hidden) is None:
                    break
        buckets = sorted({b for b in map(self.bucket, sizes) if b is not None}, reverse=True)
        drafting = all(all(self._capture_spec(output, b) is not None for b in buckets)
                       for output in map(DecodeOutput, speculative))
        if self.d_partition is not None:  # "split": the same graphs on D's partition, for D beside P
            beside = ((DecodeOutput.LOGITS,) if plain else ()) + tuple(map(DecodeOutput, speculative))
            for output, b in itertools.product(beside, buckets):
                if self._beside_graph(output, b) is None:
                    break  # failed there: D stays on the whole device beside P (`beside_capture_error`)
        return decode if plain else drafting and decode

    # -- for measurement: the parts benchmarks time, without the engine around them ------------
    PER_FORWARD_SETTINGS = ("use_graphs", "graph_batch_sizes", "prefill_graph_tokens", "prefill_graph_rows",
                            "async_prefill")
    """The `RunnerConfig` fields read at every forward (`configured` may swap them); the others are
    read once, when the runner is built."""

    def decode_graph(self, rows: int) -> DecodeGraph:
        """The decode graph of the bucket holding `rows` rows, captured now if it is not yet (on
        many ranks, every rank must call it at the same point). Load a batch with
        `graph.static.fill(spans, tokens)` and time `graph.graph.replay()` on `d_stream`."""
        bucket = self.bucket(rows)
        if bucket is None:
            raise ValueError(f"no decode graph holds {rows} rows: the buckets are {self.graph_sizes} "
                             f"(RunnerConfig.graph_batch_sizes); ask for at most {max(self.graph_sizes, default=0)}")
        return self._graph(bucket)

    def forward_eager(self, inputs: list[SpanInput], phase: Phase) -> Forward:
        """`forward` without a decode graph: D batches run eagerly; P and mixed forwards run as
        piecewise graphs where `prefill_bucket` names a bucket, else eagerly (inside
        `configured(...)` with `prefill_graph_tokens=()` they always run eagerly)."""
        return self._eager(inputs, phase)

    def prefill_bucket(self, inputs: list[SpanInput]) -> int | None:
        """The token bucket whose piecewise graph a P or mixed forward of `inputs` replays, or None
        (it runs eagerly: many ranks, graphs off or failed, or too many tokens or sampled rows)."""
        return self._prefill_bucket(inputs)

    @property
    def captured(self) -> CapturedGraphs:
        """The decode and piecewise prefill buckets captured now."""
        spec = [(output.value, rows) for output, rows in self._spec_graphs]
        return CapturedGraphs(tuple(sorted(self._graphs)), tuple(sorted(self._p_graphs)),
                              tuple(sorted(spec + [(PREFILL_HIDDEN, tokens) for tokens in self._p_hidden])))

    def release_graphs(self) -> CapturedGraphs:
        """`Runner.release_graphs`: every graph and pool dropped (`drop_graphs`); the buckets held."""
        held = self.captured
        torch.cuda.synchronize(self.device)  # no replay still reads a pool being freed
        self.drop_graphs()
        return held

    def restore_graphs(self, held: CapturedGraphs) -> str:
        """`Runner.restore_graphs`: on one rank the buckets held are captured now, over the current
        weights (re-allocated weights have new addresses, which is not a re-bind: graphs stay on);
        on many ranks capture is collective and runs at the first decode step, on every rank alike."""
        self._weights_ptr = self.model.embedding.word_embeddings.weight.data_ptr()
        if self.multi_rank:
            return f"{held.describe()} to capture at the first decode step (collective on many ranks)"
        if not (self.config.use_graphs and self.graph_safe):
            return "nothing captured: decode runs eagerly" + (f" ({self.capture_error})" if self.capture_error else "")
        decode = sum(self._try_graph(rows) is not None for rows in sorted(held.decode, reverse=True))
        spec = sum((self._prefill_graph(size, hidden=True) if output == PREFILL_HIDDEN else
                    self._capture_spec(DecodeOutput(output), size)) is not None
                   for output, size in sorted(held.speculative, key=lambda h: -h[1]))
        prefill = 0
        for tokens in sorted(held.prefill, reverse=True):
            if self._prefill_graph(tokens) is None:
                break
            prefill += 1
        return (f"captured {decode} of {len(held.decode)} decode, {spec} of {len(held.speculative)} verify/draft "
                f"and {prefill} of {len(held.prefill)} prefill graphs")

    def drop_graphs(self) -> None:
        """Forget every captured graph, decode and piecewise, with their memory pools; they are
        captured again on next use. Needed after the model's layers were replaced (other kernels,
        other weight formats): a graph replays the kernels it captured."""
        self._graphs.clear()
        self._spec_graphs.clear()
        self._beside.clear()
        self._pool = None
        self._p_graphs.clear()
        self._p_hidden.clear()
        self._p_pool, self._p_outputs = None, self._shared_outputs()
        self._captured = False

    @contextlib.contextmanager
    def configured(self, config: RunnerConfig) -> Iterator[None]:
        """Run with `config` inside the block and with the runner's own config after it (neither
        config is changed). Only `PER_FORWARD_SETTINGS` may differ from the runner's config."""
        fixed = [f.name for f in dataclasses.fields(config)
                 if f.name not in self.PER_FORWARD_SETTINGS and getattr(config, f.name) != getattr(self.config, f.name)]
        if fixed:
            raise ValueError(f"RunnerConfig fields {fixed} are read when a CudaRunner is built and cannot be "
                             f"swapped: build another runner, or change only {self.PER_FORWARD_SETTINGS}")
        saved, self.config = self.config, config
        try:
            yield
        finally:
            self.config = saved

    def _shared_outputs(self) -> SharedOutputs:
        return SharedOutputs(max(self.config.prefill_graph_tokens, default=0))

    def bucket(self, rows: int) -> int | None:
        sizes = self.graph_sizes
        i = bisect_left(sizes, rows)
        return sizes[i] if i < len(sizes) else None

    @property
    def graph_sizes(self) -> tuple[int, ...]:
        """The configured buckets a graph can hold: on many ranks at most D's static exchange
        capacity (`CommConfig.d_max_tokens` rows per replica); larger batches run eagerly."""
        limit = getattr(getattr(self.model.comm, "config", None), "d_max_tokens", None) if self.multi_rank else None
        return tuple(b for b in self.config.graph_batch_sizes if limit is None or b <= limit)

    # -- decode graphs ------------------------------------------------------------------------
    def _graphable_weights(self) -> bool:
        if self.graph_safe and self.model.embedding.word_embeddings.weight.data_ptr() != self._weights_ptr:
            # WeightStore.bind re-pointed every parameter: captured graphs would read the old
            # tensors. Forwards run eagerly from now on (bind is meant for eager engines; it runs
            # on every rank alike, so all ranks stop replaying together).
            log.warning("parameters were re-bound (WeightStore.bind): CUDA graphs dropped, forwards run eagerly")
            self.graph_safe = False
            self._graphs.clear()
            self._spec_graphs.clear()
            self._beside.clear()
            self._p_graphs.clear()
            self._p_hidden.clear()
            self._p_outputs = self._shared_outputs()
        return self.graph_safe

    def _graphable(self, inputs: list[SpanInput]) -> bool:
        self._graphable_weights()
        if not (self.config.use_graphs and self.graph_safe and inputs) or self.bucket(len(inputs)) is None:
            return False
        return all(i.span.new == 1 and i.sample and len(i.span.table) <= self.table_width for i in inputs)

    def _decode_graph(self, inputs: list[SpanInput]) -> DecodeGraph | None:
        """The decode graph these one-token rows replay in (captured on first use on one rank; on
        many ranks only those captured together), or None: they run eagerly."""
        if not self._graphable(inputs):
            return None
        bucket = self.bucket(len(inputs))
        if self._beside_prefill():
            graph = self._beside_graph(DecodeOutput.LOGITS, bucket)
            if graph is not None:
                return graph
        return self._graphs.get(bucket) if self.multi_rank else self._try_graph(bucket)

    # -- D beside P on its own SMs (`RunnerConfig.partition` "split") ------------------------
    def _beside_prefill(self) -> bool:
        """D runs on its partition now: split SMs, and a P forward in flight."""
        return self.d_partition is not None and self._p_in_flight > 0

    @property
    def _d_now(self) -> torch.cuda.Stream:
        """The stream D's eager forwards run on now."""
        return self.d_partition.stream if self._beside_prefill() else self.d_stream

    def _beside_graph(self, output: DecodeOutput, bucket: int) -> DecodeGraph | None:
        """The `output` graph of `bucket` captured on D's partition (on first use, in the decode
        graphs' pool), or None after a capture failed there: D then replays its whole-device graphs."""
        graph = self._beside.get((output, bucket))
        if graph is not None or self.beside_capture_error is not None:
            return graph
        graph = self._capture_into(self._beside, output, bucket, self.d_partition.stream)
        if isinstance(graph, str):  # D must not stop: it runs on the whole device beside P
            log.warning("decode graph capture on the %d-SM partition failed, D runs on the whole device beside P: %s",
                        self.d_partition.sms, graph)
            self.beside_capture_error = graph
            return None
        return graph

    def _capture_into(self, store: dict[tuple[DecodeOutput, int], DecodeGraph], output: DecodeOutput, bucket: int,
                      stream: torch.cuda.Stream) -> DecodeGraph | str:
        """The `output` graph of `bucket` captured now on `stream`, in the decode graphs' pool, and
        kept in `store`; or, if capture fails, why (and `store` emptied: its graphs stay unused)."""
        try:
            graph = self._new_graph(bucket, output, stream, collective=False)
        except Exception as exc:
            store.clear()
            torch.cuda.synchronize(self.device)
            return f"{type(exc).__name__}: {exc}"
        store[(output, bucket)] = graph
        return graph

    def _new_graph(self, rows: int, output: DecodeOutput, stream: torch.cuda.Stream, collective: bool) -> DecodeGraph:
        """The `output` graph of `rows` one-query rows captured now on `stream`, in the decode graphs'
        pool; raises if the capture fails."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = DecodeGraph(self, rows, output)
        graph.capture(self.model, stream, self._pool, collective=collective)
        self.stats["graph_captures"] += 1
        return graph

    def _graph(self, rows: int) -> DecodeGraph:
        graph = self._graphs.get(rows)
        if graph is None:
            graph = self._graphs[rows] = self._new_graph(rows, DecodeOutput.LOGITS, self.d_stream, self.multi_rank)
            log.info("captured decode graph for %d rows", rows)
        return graph

    def _try_graph(self, rows: int) -> DecodeGraph | None:
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

    def _capture_collectively(self, sizes: Sequence[int]) -> bool:
        """Every bucket on every rank (a failure does not stop the others: the warm-ups' collectives
        must keep pairing up), then one agreement over the CPU group; all keep graphs or none does."""
        failed = None
        if self.graph_safe and self.cache is not None:
            for rows in sorted(sizes, reverse=True):
                try:
                    self._graph(rows)
                except Exception as exc:  # capture itself runs no collective: the ranks stay aligned
                    failed = failed or f"{rows} rows: {type(exc).__name__}: {exc}"
                    log.warning("decode graph capture for %d rows failed: %s", rows, exc)
                    torch.cuda.synchronize(self.device)
        else:
            failed = "not graph-safe" if self.cache is not None else "no KV cache"
        views = self.model.comm.all_gather_object(failed, context="decode graph capture")
        problems = {r: v for r, v in enumerate(views) if v is not None}
        if problems:
            if self._graphs or failed is None:
                log.warning("decode graphs dropped on every rank, decode runs eagerly: failed on rank(s) %s",
                            problems)
            self.graph_safe = False
            self.capture_error = f"capture failed on rank(s) {problems}"
            self._graphs.clear()
            return False
        return True

    _REPLAYS = {DecodeOutput.LOGITS: "graph_replays", DecodeOutput.HIDDEN: "verify_replays",
                DecodeOutput.MTP: "draft_replays"}

    def _replay(self, graph: DecodeGraph, inputs: list[SpanInput], tokens: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None, runs: list[int] | None = None) -> Forward:
        """The graph over `inputs` (one token each); `tokens` [rows] replace their token ids and
        `hidden` [rows, H] fills an MTP graph's input, both device tensors; `runs`: `inputs` are
        `flatten`'s rows of rows with these new-position counts (`StaticDecodeLayout.fill`). Returns
        a view of the graph's output: read it before this graph, or another sharing its pool,
        replays again."""
        n, stream = len(inputs), graph.stream
        caller = torch.cuda.current_stream()
        stream.wait_stream(caller)  # also: `tokens` and `hidden`, made on the caller's stream
        with torch.cuda.stream(stream):
            graph.static.fill([i.span for i in inputs], [i.token_ids[0] for i in inputs], [i.key for i in inputs],
                              runs)
            if tokens is not None:
                graph.static.tokens[:n].copy_(tokens)
            if hidden is not None:
                graph.hidden[:n].copy_(hidden)
            graph.graph.replay()
        self._probe.after(stream)
        caller.wait_stream(stream)
        self.stats[self._REPLAYS[graph.output]] += 1
        return graph.out[:n]
        yield  # a generator with no boundary (the graph holds D's whole forward)

    # -- speculative decoding (`runner.speculative`, one rank): verify and draft graphs ---------
    def forward_hidden(self, inputs: list[SpanInput], phase: Phase) -> Forward:
        """`Runner.forward_hidden`: in D, the rows' positions as one-query rows
        (`runner.speculative.flatten`) replayed in the verify graph of their bucket; P, mixed
        forwards and batches past the largest bucket run eagerly."""
        self._probe.poll()
        if phase is Phase.D:
            rows = flatten(inputs)
            graph = self._spec_graph(DecodeOutput.HIDDEN, rows)
            if graph is not None:
                return self._replay(graph, rows, runs=[i.span.new for i in inputs])
        return self._eager(inputs, phase, DecodeOutput.HIDDEN)

    def forward_mtp(self, spans: list[SeqSpan], hidden: torch.Tensor, next_tokens: torch.Tensor,
                    phase: Phase, keys: Sequence[Hashable | None] | None = None) -> Forward:
        """`Runner.forward_mtp`, placed as `forward_hidden`: in D, one-query rows in a draft graph."""
        self._probe.poll()
        if not spans:  # one rank (many are refused): no collective waits for this forward
            return _value(hidden[:0])
        keys = keys if keys is not None else [None] * len(spans)
        inputs = [SpanInput(s, [0] * s.new, True, k) for s, k in zip(spans, keys, strict=True)]  # tokens: `next_tokens`
        if phase is Phase.D:
            rows = flatten(inputs)
            graph = self._spec_graph(DecodeOutput.MTP, rows)
            if graph is not None:
                return self._replay(graph, rows, next_tokens, hidden, [s.new for s in spans])
        return self._eager(inputs, phase, DecodeOutput.MTP, next_tokens, hidden)

    def _spec_graph(self, output: DecodeOutput, rows: list[SpanInput]) -> DecodeGraph | None:
        """The `output` graph of the bucket holding these one-token rows, captured on first use (in
        the decode graphs' pool), or None: they run eagerly (graphs off, many ranks, no bucket, a
        table too wide, or a capture that failed: verify and draft graphs stay off from then on)."""
        if self.multi_rank or not self._graphable(rows):
            return None
        bucket = self.bucket(len(rows))
        beside = self._beside_graph(output, bucket) if self._beside_prefill() else None
        return beside or self._capture_spec(output, bucket)

    def _capture_spec(self, output: DecodeOutput, bucket: int) -> DecodeGraph | None:
        if self.spec_capture_error is not None:
            return None
        graph = self._spec_graphs.get((output, bucket))
        if graph is not None:
            return graph
        graph = self._capture_into(self._spec_graphs, output, bucket, self.d_stream)
        if isinstance(graph, str):  # drafting must not stop: its forwards run eagerly
            log.warning("%s graph capture for %d rows failed, speculative decoding runs eagerly: %s",
                        output.value, bucket, graph)
            self.spec_capture_error = graph
            return None
        log.info("captured %s graph for %d one-query rows", output.value, bucket)
        return graph

    # -- P and mixed forwards as piecewise graphs (one rank) -----------------------------------
    def _prefill_bucket(self, inputs: list[SpanInput]) -> int | None:
        if not self.config.use_graphs or not self.graph_safe or self.multi_rank or self.prefill_capture_error:
            return None
        n, r = sum(i.span.new for i in inputs), sum(1 for i in inputs if i.sample)
        buckets = self.config.prefill_graph_tokens
        i = bisect_left(buckets, n)
        if n == 0 or i == len(buckets) or r > min(buckets[i], self.config.prefill_graph_rows):
            return None
        return buckets[i]

    def _prefill_graph(self, tokens: int, hidden: bool = False) -> PiecewiseGraph | None:
        """The piecewise graph of `tokens` tokens (of hidden states: `hidden`), captured on first use;
        None (eager from now on) if capture fails."""
        graphs = self._p_hidden if hidden else self._p_graphs
        graph = graphs.get(tokens)
        if graph is not None or self.prefill_capture_error is not None:  # callers checked graph_safe, one rank
            return graph
        try:
            if self._p_pool is None:
                self._p_pool = torch.cuda.graph_pool_handle()
            graph = PiecewiseGraph(tokens, min(tokens, self.config.prefill_graph_rows), self.device, hidden)
            graph.capture(self.model, self.p_stream, self._p_pool, self._p_outputs)
        except Exception as exc:  # P must not stop: it runs eagerly
            log.warning("piecewise capture of %d tokens failed, P and mixed forwards run eagerly: %s", tokens, exc)
            self.prefill_capture_error = f"{type(exc).__name__}: {exc}"
            self._p_graphs.clear()
            self._p_hidden.clear()
            torch.cuda.synchronize(self.device)
            return None
        graphs[tokens] = graph
        self.stats["graph_captures"] += 1
        log.info("captured piecewise forward for %d tokens (%d pieces)", tokens, len(graph.pieces))
        return graph

    # -- eager forwards (P, mixed chunked batches, decode batches past the largest bucket) ----
    def _eager(self, inputs: list[SpanInput], phase: Phase, output: DecodeOutput = DecodeOutput.LOGITS,
               tokens: torch.Tensor | None = None, hidden: torch.Tensor | None = None) -> Forward:
        """The forward of `inputs` on the phase's stream, what `output` names (`tokens` and `hidden`:
        the MTP layer's inputs); a plain P or mixed one through its piecewise graph where one holds it.
        Where D has a partition to move to ("split"), a P forward counts as in flight from its first
        step until the device has finished it; no other runner pays for the count."""
        forward = self._run_eager(inputs, phase, output, tokens, hidden)
        return self._in_flight(forward) if phase is Phase.P and self.d_partition is not None else forward

    def _in_flight(self, forward: Forward) -> Forward:
        self._p_in_flight += 1
        try:
            return (yield from forward)
        finally:
            self._p_in_flight -= 1

    def _run_eager(self, inputs: list[SpanInput], phase: Phase, output: DecodeOutput,
                   tokens: torch.Tensor | None, hidden: torch.Tensor | None) -> Forward:
        stream = self.p_stream if phase is Phase.P else self._d_now
        caller = torch.cuda.current_stream()
        self._graphable_weights()  # drops every graph if the parameters were re-bound
        bucket = self._prefill_bucket(inputs) if output is not DecodeOutput.MTP else None
        graph = self._prefill_graph(bucket, hidden=output is DecodeOutput.HIDDEN) if bucket is not None else None
        self.stats["piecewise_forwards" if graph is not None else "eager_forwards"] += 1
        with torch.cuda.stream(stream):
            stream.wait_stream(caller)  # weight copies and earlier host-to-device copies
            layout = build_layout([i.span for i in inputs], [i.token_ids for i in inputs], [i.sample for i in inputs],
                                  self.cache.block_size, self.kernels, self.q_heads, self.kv_heads,
                                  self.head_dim, self.device, self.num_sms, [i.key for i in inputs], self._tables)
            attn = KernelPagedBatch(self.cache, layout, self.kernels)
            if graph is not None:
                gen = graph.run(layout, attn)
            elif output is DecodeOutput.HIDDEN:
                gen = self.model.hidden_step(layout.tokens, layout.positions, attn, phase)
            elif output is DecodeOutput.MTP:
                gen = self.model.mtp_step(tokens, layout.positions, hidden, attn, phase)
            else:
                gen = self.model.step(layout.tokens, layout.positions, attn, phase, logits_index=layout.logits_rows)
        while True:
            # Each segment runs on the phase's stream: its kernels and its collectives (the router
            # moves the registered conflicting one to D's stream, with events both ways).
            with torch.cuda.stream(stream):
                try:
                    point = next(gen)
                except StopIteration as stop:
                    logits = stop.value
                    break
            yield point
        self._probe.after(stream)
        done = torch.cuda.Event()
        done.record(stream)
        if self.config.async_prefill and phase is Phase.P:
            while not done.query():  # rank-safe: see "Asynchronous P" in the module docstring
                self.stats["completion_polls"] += 1
                yield COMPLETION
        caller = torch.cuda.current_stream()
        caller.wait_event(done)
        logits.record_stream(caller)
        return logits


def _value(value: torch.Tensor) -> Forward:
    """A forward with no work: returns `value` at once."""
    return value
    yield
