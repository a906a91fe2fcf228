"""Names shared by every layer: phases, parallel axes, and the rows a forward runs.

Phase identity is always passed explicitly (STYLE.md rule 8); these enums are the only
vocabulary for it, so a typo is an AttributeError rather than a silently wrong route.
`SeqSpan` and `SpanInput` are the typed records the CPU request table hands the device side
(runner, KV backends): plain Python values, so the table imports nothing that holds a tensor.
"""
from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass


class Phase(enum.Enum):
    """Which phase owns a piece of work: prefill (P) or decode (D)."""

    P = "P"
    D = "D"


class Axis(enum.Enum):
    """A parallel axis; each maps to one of Megatron's process groups (docs/design.md §5)."""

    ATP = "ATP"  # attention tensor parallel = Megatron tensor-model-parallel group
    ADP = "ADP"  # attention data parallel = Megatron data-parallel group
    EP = "EP"  # expert parallel = Megatron expert-model-parallel group
    FULL = "FULL"  # every rank of the model (equals EP when ETP = 1)


@dataclass(frozen=True)
class SeqSpan:
    """One sequence in a forward: its block table, cached positions, and new positions."""

    table: tuple[int, ...]
    past: int
    new: int


@dataclass(frozen=True)
class SpanInput:
    span: SeqSpan
    token_ids: list[int]
    """The `span.new` tokens to run."""
    sample: bool
    """Return logits for the span's last token."""
    key: Hashable | None = None
    """Who the row's block table belongs to, with the promise that rows of one key have tables
    that only grow by appending (the engine passes `Seq.table_key` for its decode and prefill rows:
    the sequence and how often its blocks were dropped). Lets the CUDA runner convert only a
    table's new entries, in a decode graph's static layout and in an eager or piecewise forward's
    (`kernels.layout.TableCache`); None promises nothing."""
