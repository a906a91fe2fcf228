"""The runner contract and the portable runner: a batch of sequence spans -> a forward over paged KV.

A runner holds tensors and never decides anything: the engine tells it which spans to run, in
which phase, and which rows to return logits for. `forward` returns the model's generator, so the
caller chooses whether to run it to the end (decode, `off`, `chunked`) or segment by segment
(`mux` prefill). `Runner` is the protocol; `ModelRunner` (portable, any device, any rank count)
and `cuda.CudaRunner` (CUDA, one rank or many: decode graphs, phase streams) implement it,
and `cuda.make_runner` picks one from `EngineConfig.runner`. After a forward's result is
complete, a runner runs the deferred checks of the comm's sync-free dispatch domains
(`comm.alltoall.check_domains`): they read the device, so never inside a forward.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple, Protocol

import torch

from megatron_rollout.comm.alltoall import check_domains
from megatron_rollout.forward import Forward, run_to_end
from megatron_rollout.kv.paged import PagedBatch, PagedKVCache
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.types import Phase, SeqSpan, SpanInput


class CapturedGraphs(NamedTuple):
    """What a runner had captured when it let its graphs go (`Runner.release_graphs`): the buckets
    `Runner.restore_graphs` captures again."""

    decode: tuple[int, ...] = ()
    """Decode buckets (rows)."""
    prefill: tuple[int, ...] = ()
    """Piecewise prefill buckets (tokens)."""
    speculative: tuple[tuple[str, int], ...] = ()
    """Speculative decoding's verify and draft graphs: (what they compute, one-query rows)."""

    def describe(self) -> str:
        spec = f" and {len(self.speculative)} verify/draft graphs" if self.speculative else ""
        return f"{len(self.decode)} decode and {len(self.prefill)} prefill graphs{spec}"


class Runner(Protocol):
    """What the engine needs of a runner, all of it. `cache` may be set to None (the KV asleep,
    `engine.memory`) and back; `model` is the model it runs (its weights are updated in place between forwards)."""

    model: MoETransformer
    cache: PagedKVCache | None

    @property
    def overlaps_host(self) -> bool:
        """A forward issued ahead (`forward_fed`) runs on the device while the host works, so
        issuing decode ahead pays (`engine.ahead`); False where the forward runs on the host."""
        ...

    def forward(self, inputs: list[SpanInput], phase: Phase) -> Forward:
        """Logits [rows sampled, V] for the spans with `sample`, in input order. Reads and writes
        the KV blocks the spans name; returns a generator that yields at P's boundaries."""
        ...

    def forward_fed(self, inputs: list[SpanInput], tokens: torch.Tensor) -> torch.Tensor | None:
        """A D forward over one-token rows whose tokens are `tokens` [rows] on the device (drawn by
        the previous forward, not read by the host; the rows' `token_ids` are placeholders), issued
        now; its logits, or None where this runner cannot (the caller then waits for the host)."""
        ...

    def forward_hidden(self, inputs: list[SpanInput], phase: Phase) -> Forward:
        """Speculative decoding: the decoder's last hidden states [new tokens, H] (before the final
        norm) of every new token, in input order."""
        ...

    def forward_mtp(self, spans: list[SeqSpan], hidden: torch.Tensor, next_tokens: torch.Tensor,
                    phase: Phase, keys: Sequence[Hashable | None] | None = None) -> Forward:
        """Speculative decoding: the first MTP layer over the spans' new positions
        (`MoETransformer.mtp_step`); its output [N, H]. `keys`: each span's `SpanInput.key`."""
        ...

    @property
    def captured(self) -> CapturedGraphs:
        """The graphs captured now."""
        ...

    def release_graphs(self) -> CapturedGraphs:
        """Drop every captured graph and its memory pool (no forward in flight); what was captured."""
        ...

    def restore_graphs(self, held: CapturedGraphs) -> str:
        """Capture `held` again (over the current KV and weights, whose addresses may be new); says
        what was done."""
        ...


class ModelRunner:
    """The portable runner: the model's own `step` over a `PagedBatch`."""

    def __init__(self, model: MoETransformer, cache: PagedKVCache) -> None:
        self.model, self.cache = model, cache

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def overlaps_host(self) -> bool:
        """The portable runner's forward is the host's own work: nothing overlaps."""
        return False

    def forward(self, inputs: list[SpanInput], phase: Phase) -> Forward:
        """Logits [rows sampled, V] for the spans with `sample`, in input order."""
        batch = PagedBatch(self.cache, [i.span for i in inputs])
        tokens = torch.tensor([t for i in inputs for t in i.token_ids], dtype=torch.long)
        ends = torch.tensor([i.span.new for i in inputs], dtype=torch.long).cumsum(0) - 1
        rows = ends[[k for k, i in enumerate(inputs) if i.sample]]
        dev = self.device
        return self._checked(self.model.step(tokens.to(dev), batch.positions, batch, phase, logits_index=rows.to(dev)))

    def forward_hidden(self, inputs: list[SpanInput], phase: Phase) -> Forward:
        """The decoder's last hidden states [new tokens, H] (before the final norm) of every new
        token, in input order: what speculative decoding verifies and the MTP layer reads."""
        batch = PagedBatch(self.cache, [i.span for i in inputs])
        tokens = torch.tensor([t for i in inputs for t in i.token_ids], dtype=torch.long)
        return self._checked(self.model.hidden_step(tokens.to(self.device), batch.positions, batch, phase))

    def forward_mtp(self, spans: list[SeqSpan], hidden: torch.Tensor, next_tokens: torch.Tensor,
                    phase: Phase, keys: Sequence[Hashable | None] | None = None) -> Forward:
        """`MoETransformer.mtp_step` over `spans` (hidden [N, H], next_tokens [N] for their N new
        positions, in order): the first MTP layer's output [N, H], before its final norm."""
        batch = PagedBatch(self.cache, spans)
        step = self.model.mtp_step(next_tokens.to(self.device), batch.positions, hidden, batch, phase)
        return self._checked(step)

    def forward_fed(self, inputs: list[SpanInput], tokens: torch.Tensor) -> torch.Tensor:
        """Portable: reads the tokens (a host wait on a device) and runs the forward now."""
        ids = tokens.tolist()
        rows = [SpanInput(i.span, [t], i.sample, i.key) for i, t in zip(inputs, ids, strict=True)]
        return run_to_end(self.forward(rows, Phase.D))

    @property
    def captured(self) -> CapturedGraphs:
        """The portable runner captures nothing."""
        return CapturedGraphs()

    def release_graphs(self) -> CapturedGraphs:
        return CapturedGraphs()

    def restore_graphs(self, held: CapturedGraphs) -> str:
        return "no graphs: the portable runner runs every forward eagerly"

    def _checked(self, forward: Forward) -> Forward:
        logits = yield from forward
        check_domains(self.model.comm)  # the forward is over: its deferred sequence checks may read now
        return logits
