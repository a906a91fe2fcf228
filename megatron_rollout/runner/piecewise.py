"""Prefill and mixed forwards as CUDA graphs between attention calls (one rank).

An eager forward launches ~430 kernels; at a few hundred tokens the host takes 16-26 ms to launch
them and the GPU waits (`bench.profile`, 2026-12-01). Every P segment, every `off` prefill and
every `chunked` mixed step paid that. Only attention depends on the spans' lengths; everything
else depends on the token count alone. So per token-count bucket a forward is captured in pieces:
piece 0 from the embedding to layer 0's attention inputs, piece l from layer l-1's attention
output to layer l's inputs, the last piece to the logits. At replay each piece is one graph
launch and attention runs eagerly between pieces on the real spans (its kernels read the paged
layout, built per forward as before), reading the piece's q/k/v and writing the next piece's
input in place.

- **Padding.** A batch of n tokens runs in the smallest bucket >= n; rows n.. of the static
  inputs keep earlier valid values (token ids, positions), attention writes only rows < n and
  stores only their K/V, and rows never mix outside attention (norms, linears, experts are
  row-wise), so padding changes no real row. Sampled rows: the first r of a static index of
  `rows` entries.
- **Boundaries.** The points the model yields inside a piece are yielded after that piece is
  launched, in the same order, so a `mux` epoch still stops at every boundary of the plan. On one
  rank a boundary has no collective behind it; many ranks keep the eager path (P's collectives
  must be enqueued at their boundaries, docs/design.md §6).
- **Memory.** The pieces of every bucket share one private pool, separate from the decode graphs'
  (a decode replay in a `mux` round between two P pieces must not reuse P's live activations);
  forwards of different buckets never interleave, which is what sharing one pool needs. Each
  bucket keeps its static tensors: q, k and v of every layer and the logits of its sampled rows;
  the attention outputs, written between pieces, are one buffer per layer for all buckets
  (`SharedOutputs`). By their sizes that is about 4.2 GB for `qwen3-30b-a3b-12l` with the
  fourteen default buckets up to 4,096 tokens: q, k, v 2.8 GB (10 KB per token and layer, summed
  over the buckets), outputs 0.4 GB (8 KB per token and layer of the largest bucket), bf16 logits
  of up to 256 sampled rows per bucket 1.0 GB (a computed figure, not a measured one; the ten
  buckets up to 2,048 tokens with unshared outputs came to 2.8 GB; the 48-layer preset needs about
  four times as much). `engine.sleep` frees
  them with the decode graphs (its `graphs` tag).

With `hidden`, a graph returns the decoder's last hidden states of every token instead of the
sampled rows' logits: the prefill and mixed forwards of speculative decoding (`runner.speculative`).

Left out: many ranks, more sampled rows than the bucket holds (eager then).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from megatron_rollout.forward import BoundaryPoint, Forward, run_to_end
from megatron_rollout.kernels.layout import ForwardLayout, KernelPagedBatch
from megatron_rollout.model.attention import AttentionBackend
from megatron_rollout.types import Phase


@dataclass
class Piece:
    graph: torch.cuda.CUDAGraph
    points: list[BoundaryPoint] = field(default_factory=list)
    """The boundaries the model yielded while this piece was captured."""


@dataclass(frozen=True)
class AttentionSlot:
    """One layer's attention between two pieces: the inputs the piece before wrote, the output
    the piece after reads (static tensors of `tokens` rows)."""

    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor


class _NoAttention(AttentionBackend):
    """Warm-up before capture: the pieces' kernels run (Triton compiles, cuBLAS chooses), no attention."""

    def attend(self, layer, q, k, v):
        return torch.zeros_like(q)


class SharedOutputs:
    """Each layer's attention output, one buffer shared by every bucket: a bucket's slot is the
    first `tokens` rows of it. Forwards of different buckets never interleave, so they never need
    two layers' worth at once. A buffer is allocated for `rows` tokens (the largest bucket), so the
    order buckets are captured in (lazily, as traffic first needs them) does not matter; a bucket
    larger still gets a new one (the graphs captured on the old one keep it alive through their views)."""

    def __init__(self, rows: int = 0) -> None:
        self.rows = rows
        self.buffers: dict[int, torch.Tensor] = {}

    def out(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(layer)
        if buf is None or buf.shape[0] < q.shape[0] or buf.shape[1:] != q.shape[1:] or buf.dtype != q.dtype:
            buf = self.buffers[layer] = q.new_zeros(max(self.rows, q.shape[0]), *q.shape[1:])
        return buf[:q.shape[0]]


def release_rng_after_failed_capture(device: torch.device) -> None:
    """A CUDA-graph capture that fails midway leaves the device's default generator marked as
    capturing: torch clears the mark only when a capture ends cleanly. From then on every random op
    outside a graph in the process raises "Offset increment outside graph capture encountered
    unexpectedly", the trainer's own included. This swaps in a copy of the generator's state (the
    same seed and offset, without the mark). Graphs captured earlier keep the state they
    registered."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    generator = torch.cuda.default_generators[index]
    generator.graphsafe_set_state(generator.clone_state())


class _Recorder(AttentionBackend):
    """Capture: every attention call ends the current piece's graph and begins the next."""

    def __init__(self, pool, outputs: SharedOutputs) -> None:
        self.pool, self.outputs = pool, outputs
        self.pieces: list[Piece] = []
        self.slots: list[AttentionSlot] = []
        self.current: Piece | None = None

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.current = Piece(graph)

    def end(self) -> None:
        piece, self.current = self.current, None
        piece.graph.capture_end()
        self.pieces.append(piece)

    def abort(self, device: torch.device) -> None:
        """End a capture that failed midway (the stream must leave capture mode, the generator its
        capture mark)."""
        if self.current is not None:
            try:
                self.current.graph.capture_end()
            except Exception:  # the capture was already invalidated: nothing left to end
                pass
            self.current = None
        release_rng_after_failed_capture(device)

    def attend(self, layer, q, k, v):
        self.end()
        slot = AttentionSlot(layer, q, k, v, self.outputs.out(layer, q))
        self.slots.append(slot)
        self.begin()
        return slot.out


class PiecewiseGraph:
    """A forward of up to `tokens` new tokens, `rows` of them sampled, as pieces between attention
    calls; with `hidden`, of every token's last hidden state instead (module docstring)."""

    def __init__(self, tokens: int, rows: int, device: torch.device, hidden: bool = False) -> None:
        self.tokens, self.rows, self.hidden = tokens, rows, hidden
        self.token_ids = torch.zeros(tokens, dtype=torch.int32, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int32, device=device)
        self.logits_rows = torch.zeros(rows, dtype=torch.int64, device=device)
        self.pieces: list[Piece] = []
        self.slots: list[AttentionSlot] = []
        self.out: torch.Tensor | None = None

    def _forward(self, model, attn: AttentionBackend) -> Forward:
        if self.hidden:
            return model.hidden_step(self.token_ids, self.positions, attn, Phase.P)
        return model.step(self.token_ids, self.positions, attn, Phase.P, logits_index=self.logits_rows)

    def capture(self, model, stream: torch.cuda.Stream, pool, outputs: SharedOutputs | None = None) -> None:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(2):
                run_to_end(self._forward(model, _NoAttention()))
        stream.synchronize()
        rec = _Recorder(pool, outputs or SharedOutputs())
        with torch.cuda.stream(stream), torch.no_grad():
            try:
                rec.begin()
                gen = self._forward(model, rec)
                while True:
                    try:
                        rec.current.points.append(next(gen))
                    except StopIteration as stop:
                        self.out = stop.value
                        break
                rec.end()
            except BaseException:
                rec.abort(stream.device)
                raise
        self.pieces, self.slots = rec.pieces, rec.slots  # one piece more than attention calls

    def run(self, layout: ForwardLayout, attn: KernelPagedBatch) -> Forward:
        """Replay over the real layout (n new tokens, r of them sampled) on the current stream.
        Yields the model's boundaries; returns logits [r, V], or with `hidden` the hidden states
        [n, H] (a copy: the next replay reuses them)."""
        n, r = layout.tokens.shape[0], layout.logits_rows.shape[0]
        self.token_ids[:n].copy_(layout.tokens)
        self.positions[:n].copy_(layout.positions)
        self.logits_rows[:r].copy_(layout.logits_rows)
        for piece, slot in itertools.zip_longest(self.pieces, self.slots):
            piece.graph.replay()
            yield from piece.points
            if slot is not None:
                attn.attend(slot.layer, slot.q[:n], slot.k[:n], slot.v[:n], out=slot.out[:n])  # in place
        return self.out[:n if self.hidden else r].clone()
