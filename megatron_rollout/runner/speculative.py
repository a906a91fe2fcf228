"""The forwards of speculative decoding (`engine.drafting` decides, this runs), on either runner.

`verify_forward` is one target forward that returns, for every row, the logits and the decoder's
hidden states of its last `VerifyRow.logits` positions (all of a decode row's drafts, to verify
them), and that runs, in P, the first MTP layer over the prefill positions whose next token is
known, so that `mux`'s P segments hold it.

`flatten` is how the CUDA runner puts a verify forward into its decode graphs: a decode row with
k drafts is k + 1 one-query rows, (table, n + j, 1) for j = 0..k, all sharing the row's block
table. Each layer stores the K/V of every new position before any row attends
(`kernels.layout.KernelPagedBatch`), and row j attends to positions 0..n + j only (its length),
so the causal mask between a row's drafts comes from the lengths, and the split-K decode kernels
(GQA and MLA alike) serve the verify forward unchanged, in graphs bucketed by one-query rows.
Read naively, a row's history would be read k + 1 times. The graphs' layout marks each row's
positions as one run (`DecodeMeta.runs`), and the Triton GQA kernel reads each K/V block once for
the whole run. The MLA kernel still reads it k + 1 times (computed, not measured: for
`benchmarks.mtp`'s deepseek-v3-4l at 32 rows, k = 2 and 4,096 positions, the latent cache read
grows from 0.6 to 1.8 GB per verify forward, beside about 18 GB of weights).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_rollout.forward import Forward
from megatron_rollout.runner.base import Runner
from megatron_rollout.types import Phase, SeqSpan, SpanInput


class VerifyRow(NamedTuple):
    """What a speculative forward returns for one input row, and what the MTP layer runs inside it."""

    logits: int
    """The row's last `logits` positions return logits and hidden states: 1 for a sampled row, k + 1
    for a decode row with k drafts, 0 for a partial prefill chunk."""
    follow: tuple[int, ...] = ()
    """The token after each of the row's first positions, where known before the forward (a prefill
    chunk's): the MTP layer runs over those positions inside the forward."""


class SpecOutput(NamedTuple):
    """A speculative forward's result: for every input row, its last `VerifyRow.logits` positions."""

    logits: torch.Tensor
    """[rows, V]."""
    hidden: torch.Tensor
    """[rows, H]: the decoder's hidden states at the same positions (before the final norm)."""


def verify_forward(runner: Runner, rows: list[SpanInput], verify_rows: list[VerifyRow], phase: Phase,
                   mtp: bool = True) -> Forward:
    """`SpecOutput` of the rows (see the module docstring); yields at the target's and (`mtp`) the MTP
    layer's boundaries. `mtp=False`: the target alone, for drafts that need no model (n-gram)."""
    model = runner.model
    h = yield from runner.forward_hidden(rows, phase)  # [tokens, H]
    pick: list[int] = []
    spans, keys, at, follow, start = [], [], [], [], 0
    for row, v in zip(rows, verify_rows, strict=True):
        end = start + row.span.new
        pick.extend(range(end - v.logits, end))
        if v.follow:
            spans.append(SeqSpan(row.span.table, row.span.past, len(v.follow)))
            keys.append(row.key)
            at.extend(range(start, start + len(v.follow)))
            follow.extend(v.follow)
        start = end
    index = lambda values: torch.tensor(values, dtype=torch.long, device=model.device)  # noqa: E731
    if mtp and phase is Phase.P:  # every rank's P forward runs it, maybe over nothing: its collectives pair up
        yield from runner.forward_mtp(spans, h[index(at)], index(follow), phase, keys)
    # every position picked (a decode iteration's rows, drafts and all): no index to copy to the device,
    # whose copy from pageable memory would wait for the forward before the logits are even enqueued
    hidden = h if len(pick) == start else h[index(pick)]
    return SpecOutput(model.logits(hidden), hidden)


def flatten(rows: list[SpanInput]) -> list[SpanInput]:
    """Every new position of `rows` as a one-query row (module docstring), in order; each keeps its
    row's key: they share its append-only table, converted once for all of them
    (`StaticDecodeLayout.fill`)."""
    return [SpanInput(SeqSpan(r.span.table, r.span.past + j, 1), [r.token_ids[j]], True, r.key)
            for r in rows for j in range(r.span.new)]
