"""Attention kernels over the paged KV store: the interface, the registry, the portable backend.

A forward over paged KV needs three operations per layer, all on one layer's cache slice
`[slots, kv_heads, head_dim]`:

- `store_kv`: write the new tokens' K and V at their slots (a slot < 0 is skipped, which lets a
  padded CUDA-graph batch carry dummy rows);
- `decode`: rows with one new token attend to their whole history (split-K friendly);
- `prefill`: spans with several new tokens attend causally to their cached prefix and to the new
  tokens before them (cached prefix + new tokens = causal with an offset).

Index tensors come in `DecodeMeta` / `PrefillMeta` (built by `kernels.layout`); every index is
int32 on the cache's device. Backends register by name; `resolve_attention("auto", device)` picks
the first that can run there (`flash` on a Hopper GPU in a process that has imported vLLM, for
large prefills only; `triton` on CUDA when Triton imports; else `portable`). Asking for
a backend by name that cannot run raises with the reason and an install hint.

The portable backend is the reference: plain PyTorch, one sequence at a time, on any device. It
reads the host copies of the indices (`host` fields), so it never synchronises on device data.
"""
from __future__ import annotations

import abc
import importlib
import logging
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from megatron_rollout.model.attention import causal_attention

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeMeta:
    """Rows with exactly one new token; row b is span `seq[b]` of the forward."""

    seq: torch.Tensor
    """[B] int32: span index of each decode row (a row of `tables`, `lens`, `q_start`)."""
    tables: torch.Tensor
    """[S, W] int32: block table of every span (entries past a span's length are ignored)."""
    lens: torch.Tensor
    """[S] int32: cached + new positions of every span (0 marks a padded row: output zeros)."""
    q_start: torch.Tensor
    """[S] int32: row of the span's first new token in q / out."""
    splits: int
    """KV splits per row (split-K); fixed per CUDA-graph bucket."""
    block_size: int
    """Positions per KV block."""
    host_seq: np.ndarray | None = None
    host_tables: np.ndarray | None = None
    host_lens: np.ndarray | None = None
    host_q_start: np.ndarray | None = None
    """Host copies for the portable backend (None inside CUDA graphs)."""
    workspace: dict = field(default_factory=dict)
    """Preallocated partial results (static inside a CUDA graph); filled lazily otherwise."""
    runs: torch.Tensor | None = None
    """[B] int32, optional: rows b..b + runs[b] - 1 share one history, at consecutive lengths (a
    verify forward's row and its drafts, `runner.speculative.flatten`), so a kernel may read each
    K/V block once for all of them; 0 marks a row inside a run, 1 a row alone. A hint: a backend
    that computes every row by itself ignores it."""
    max_run: int = 1
    """Longest run `runs` may hold (fixed per CUDA-graph bucket)."""

    @property
    def rows(self) -> int:
        return int(self.seq.numel())


@dataclass(frozen=True)
class PrefillMeta:
    """Spans with several new tokens, cut into query tiles of `tile_tokens` tokens."""

    tables: torch.Tensor
    """[S, W] int32: block tables (shared with `DecodeMeta`)."""
    q_start: torch.Tensor
    """[S] int32: row of each span's first new token."""
    past: torch.Tensor
    """[S] int32: cached positions of each span."""
    new: torch.Tensor
    """[S] int32: new positions of each span."""
    tile_seq: torch.Tensor
    """[T] int32: span of each query tile."""
    tile_start: torch.Tensor
    """[T] int32: first new-token index (within its span) of each query tile."""
    tile_tokens: int
    """Query tokens per tile."""
    spans: tuple[int, ...]
    """Indices of the spans this prefill covers (those with more than one new token)."""
    max_new: int
    """Most new tokens of any covered span."""
    max_total: int
    """Most cached + new positions of any covered span."""
    block_size: int
    """Positions per KV block."""
    host_tables: np.ndarray | None = None
    host_q_start: np.ndarray | None = None
    host_past: np.ndarray | None = None
    host_new: np.ndarray | None = None
    cu_q: torch.Tensor | None = None
    """[S + 1] int32: first row of every span of the forward, then the row count (varlen libraries)."""
    lens: torch.Tensor | None = None
    """[S] int32: cached + new positions of every span of the forward."""
    max_len: int = 0
    """Most cached + new positions of any span of the forward (decode rows included)."""
    tokens: int = 0
    """New positions of the covered spans, summed (what a backend may choose its kernel by)."""

    @property
    def tiles(self) -> int:
        return int(self.tile_seq.numel())


class AttentionKernels(abc.ABC):
    """One backend. Instances are stateless apart from tuning constants; thread-compatible."""

    name: ClassVar[str]
    decode_programs_per_sm: int = 8
    """KV splits of a decode row: about this many programs per SM (`layout.choose_splits`)."""
    decode_reads_runs: ClassVar[bool] = False
    """Decode computes a run's rows (`DecodeMeta.runs`) from one read of their history, so a
    layout sizes its KV splits by the runs, not the rows (`layout.StaticDecodeLayout`)."""
    verify_programs_per_sm: int | None = None
    """`decode_programs_per_sm` for the runs of a backend that reads them, whose programs each do a
    run's work; None: `decode_programs_per_sm`."""
    prefill_heavy_first: bool = True
    """Query tiles in decreasing causal work (cached + earlier new keys), not span order: the GPU
    hands programs out in grid order, so the last wave holds the cheapest tiles instead of the
    dearest (longest-first scheduling; `layout.build_layout`). The order changes no result."""

    @classmethod
    @abc.abstractmethod
    def missing(cls, device: torch.device) -> str | None:
        """None when the backend can run on `device`; otherwise why not and how to fix it."""

    @classmethod
    def auto_missing(cls, device: torch.device) -> str | None:
        """As `missing`, for `resolve_attention("auto", ...)`: a backend may decline to be picked
        unasked where it could run when asked for by name."""
        return cls.missing(device)

    @classmethod
    def for_auto(cls) -> "AttentionKernels":
        """The instance `resolve_attention("auto", ...)` returns (asked for by name: `cls()`)."""
        return cls()

    def tile_tokens(self, group: int) -> int:
        """Query tokens per prefill tile for `group` query heads per kv head."""
        return 16

    @abc.abstractmethod
    def store_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slots: torch.Tensor) -> None:
        """k_cache, v_cache: [slots, hkv, d]; k, v: [N, hkv, d]; slots: [N] int32 (< 0: skip)."""

    @abc.abstractmethod
    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: DecodeMeta,
               out: torch.Tensor) -> None:
        """q, out: [N, hq, d]; writes out[q_start[seq[b]]] for every decode row b."""

    @abc.abstractmethod
    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PrefillMeta,
                out: torch.Tensor) -> None:
        """q, out: [N, hq, d]; writes the rows of every span in `meta.spans`."""

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, decode: DecodeMeta | None,
               prefill: PrefillMeta | None, out: torch.Tensor) -> None:
        """Every row of a forward (after `store_kv`): its decode rows, then its prefill spans. A
        backend whose kernel takes both at once (a varlen library) overrides this."""
        if decode is not None:
            self.decode(q, k_cache, v_cache, decode, out)
        if prefill is not None:
            self.prefill(q, k_cache, v_cache, prefill, out)


_BACKENDS: dict[str, type[AttentionKernels]] = {}
_AUTO_ORDER = ("flash", "triton", "portable")
"""`auto` takes the first that runs: FA3 where the process has imported vLLM and its FA3 build
loads (on Hopper; its prefill only from `flash.AUTO_MIN_PREFILL_TOKENS`, Triton below and for
decode), else Triton, else torch."""
_LAZY = {"triton": "megatron_rollout.kernels.triton_attention",
         "varlen": "megatron_rollout.kernels.varlen",
         "flash": "megatron_rollout.kernels.flash"}


def register(cls: type[AttentionKernels]) -> type[AttentionKernels]:
    _BACKENDS[cls.name] = cls
    return cls


def available_backends() -> list[str]:
    return sorted(set(_BACKENDS) | set(_LAZY))


def _load(name: str) -> type[AttentionKernels] | str:
    """The backend class, or why it could not be imported."""
    if name in _BACKENDS:
        return _BACKENDS[name]
    module = _LAZY.get(name)
    if module is None:
        raise ValueError(f"unknown attention backend {name!r}; choose 'auto' or one of {available_backends()}")
    try:
        __import__(module)
    except ImportError as exc:
        return f"{exc} (pip install triton; it ships with CUDA builds of torch)"
    return _BACKENDS[name]


def resolve_attention(name: str, device: torch.device | str) -> AttentionKernels:
    """An instance of backend `name` ('auto' = the first of `_AUTO_ORDER` that runs on `device`,
    as its `for_auto` instance)."""
    device = torch.device(device)
    if name != "auto":
        cls = _load(name)
        why = cls if isinstance(cls, str) else cls.missing(device)
        if why:
            raise RuntimeError(f"attention backend {name!r} was asked for but cannot run on {device}: {why}")
        return cls()
    for candidate in _AUTO_ORDER:
        cls = _load(candidate)
        if isinstance(cls, str):
            log.info("attention backend %s unavailable: %s", candidate, cls)
            continue
        why = cls.auto_missing(device)
        if why is None:
            return cls.for_auto()
        log.info("attention backend %s cannot run on %s: %s", candidate, device, why)
    raise AssertionError("the portable attention backend always runs")


_MLA_MODULE = "megatron_rollout.kernels.mla_attention"


def resolve_mla_attention(name: str, latent: int, device: torch.device | str) -> AttentionKernels:
    """Kernels for a multi-latent-attention model (`model.mla`, a cached row of `latent` latent
    columns then the RoPE key): 'auto' or 'triton' give the Triton MLA kernels
    (`kernels.mla_attention`; 'auto' falls back to portable where they cannot run), 'portable' the
    reference. Other backends read per-group K/V and are refused with the reason."""
    device = torch.device(device)
    if name == "portable":
        return PortableAttention()
    if name not in ("auto", "triton"):
        raise ValueError(f"attention backend {name!r} has no multi-latent attention kernels; choose 'auto', "
                         f"'triton' or 'portable' for this model")
    try:  # by name, as `_LAZY`: the module imports this one
        mla = importlib.import_module(_MLA_MODULE).TritonMLA
    except ImportError as exc:
        why = f"{exc} (pip install triton; it ships with CUDA builds of torch)"
    else:
        why = mla.missing(device)
    if why is None:
        return mla(latent)
    if name == "triton":
        raise RuntimeError(f"attention backend 'triton' was asked for but cannot run on {device}: {why}")
    log.info("MLA attention kernels cannot run on %s (%s): portable attention", device, why)
    return PortableAttention()


def history_slots(table: np.ndarray, length: int, block_size: int) -> np.ndarray:
    """Slot of every position 0..length-1 of a sequence with this block table."""
    pos = np.arange(length)
    return table[pos // block_size].astype(np.int64) * block_size + pos % block_size


@register
class PortableAttention(AttentionKernels):
    """Reference: gather each sequence's K/V and run torch attention, one sequence at a time."""

    name = "portable"

    @classmethod
    def missing(cls, device: torch.device) -> str | None:
        return None

    def store_kv(self, k_cache, v_cache, k, v, slots):
        keep = slots >= 0
        idx = slots[keep].long()
        k_cache[idx] = k[keep]
        v_cache[idx] = v[keep]

    def decode(self, q, k_cache, v_cache, meta, out):
        if meta.host_seq is None:
            raise ValueError("the portable backend needs the host copies of the decode indices")
        bs = meta.block_size
        for s in meta.host_seq.tolist():
            length = int(meta.host_lens[s])
            row = int(meta.host_q_start[s])
            if length == 0:
                out[row] = 0
                continue
            hist = torch.from_numpy(history_slots(meta.host_tables[s], length, bs)).to(k_cache.device)
            out[row:row + 1] = causal_attention(q[row:row + 1], k_cache[hist], v_cache[hist], length - 1)

    def prefill(self, q, k_cache, v_cache, meta, out):
        if meta.host_new is None:
            raise ValueError("the portable backend needs the host copies of the prefill indices")
        bs = meta.block_size
        for s in meta.spans:
            past, new, row = int(meta.host_past[s]), int(meta.host_new[s]), int(meta.host_q_start[s])
            hist = torch.from_numpy(history_slots(meta.host_tables[s], past + new, bs)).to(k_cache.device)
            out[row:row + new] = causal_attention(q[row:row + new], k_cache[hist], v_cache[hist], past)
