"""Names shared by every layer: phases and parallel axes.

Phase identity is always passed explicitly (STYLE.md rule 8); these enums are the only
vocabulary for it, so a typo is an AttributeError rather than a silently wrong route.
"""
from __future__ import annotations

import enum


class Phase(enum.Enum):
    """Which phase owns a piece of work: prefill (P) or decode (D)."""

    P = "P"
    D = "D"


class Axis(enum.Enum):
    """A parallel axis; each maps to one of Megatron's process groups (DESIGN.md §5)."""

    ATP = "ATP"  # attention tensor parallel = Megatron tensor-model-parallel group
    ADP = "ADP"  # attention data parallel = Megatron data-parallel group
    EP = "EP"  # expert parallel = Megatron expert-model-parallel group
    FULL = "FULL"  # every rank of the model (equals EP when ETP = 1)
