"""Count JIT compilations inside a timed region: Triton kernel compilations and torch.compile frames.

A benchmark figure counts only if nothing compiled while it was timed (docs/design.md §9): a cold
Triton cache once made the first schedule of a run look twice as slow as the others. This module
measures that instead of assuming it:

- Triton: `triton.knobs.runtime.jit_post_compile_hook` (triton >= 3.4) is called by
  `JITFunction._do_compile` after every in-process cache miss, i.e. every new specialisation,
  whether the binary came from the compiler or from Triton's on-disk cache (both cost time inside
  a step). The hook is installed on entry, chained to any hook that was there, and restored on
  exit. Where the knob is missing (older Triton), the counter falls back to the sizes of the
  kernel caches of this package's kernels (`JITFunction.device_caches`), before and after.
- torch: `torch._dynamo.utils.counters["frames"]["ok"]` (frames dynamo compiled) and
  `["stats"]["unique_graphs"]`, read only when dynamo was already imported (importing it here
  would cost seconds and compile nothing).

`CompileCounter` is a context manager; `counts` holds the deltas (a `CompileCounts`). Nested or
concurrent counters each see every compilation. Left out: CUDA graph captures (not compilations;
the runner captures outside timing) and cuBLAS heuristics (no JIT).
"""
from __future__ import annotations

import logging
import sys
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger(__name__)

_KERNEL_MODULES = ("megatron_rollout.kernels.triton_attention", "megatron_rollout.kernels.moe_triton",
                   "megatron_rollout.kernels.fused", "megatron_rollout.kernels.mla_attention")


@dataclass(frozen=True)
class CompileCounts:
    """Compilations counted over one region."""

    triton: int = 0
    """Triton kernel specialisations compiled or loaded (in-process cache misses)."""
    dynamo_frames: int = 0
    """Frames torch dynamo compiled (torch.compile)."""
    dynamo_graphs: int = 0
    """Graphs dynamo produced."""
    triton_source: str = "none"
    """How Triton was counted: "hook", "caches" (fallback) or "none" (Triton not imported)."""
    kernels: tuple[str, ...] = ()
    """Names of the Triton kernels compiled (hook only), for the log."""

    @property
    def total(self) -> int:
        return self.triton + self.dynamo_frames

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kernels"] = list(self.kernels)
        d["total"] = self.total
        return d


def _dynamo_counters() -> tuple[int, int]:
    if "torch._dynamo" not in sys.modules:
        return 0, 0
    try:
        from torch._dynamo.utils import counters
    except Exception:  # a torch without dynamo counters: nothing to count
        return 0, 0
    return int(counters["frames"]["ok"]), int(counters["stats"]["unique_graphs"])


def _runtime_knobs():
    """triton.knobs.runtime if Triton is imported and has the post-compile hook, else None."""
    if "triton" not in sys.modules:
        return None
    try:
        from triton import knobs
    except ImportError:
        return None
    runtime = getattr(knobs, "runtime", None)
    return runtime if runtime is not None and hasattr(runtime, "jit_post_compile_hook") else None


def _cache_sizes() -> int:
    """Total compiled variants of this package's Triton kernels (the fallback counter)."""
    total = 0
    for name in _KERNEL_MODULES:
        module = sys.modules.get(name)
        if module is None:
            continue
        for value in vars(module).values():
            caches = getattr(value, "device_caches", None)
            if isinstance(caches, dict):
                total += sum(len(entry[0]) for entry in caches.values())
    return total


class CompileCounter:
    """`with CompileCounter() as c: ...` then `c.counts` (a `CompileCounts`)."""

    def __init__(self) -> None:
        self.counts = CompileCounts()
        self._names: list[str] = []
        self._runtime = None
        self._previous = None
        self._hook = None
        self._start: tuple[int, int, int] = (0, 0, 0)

    def __enter__(self) -> "CompileCounter":
        self._names = []
        self._runtime = _runtime_knobs()
        if self._runtime is not None:
            self._previous = self._runtime.jit_post_compile_hook
            previous, names = self._previous, self._names

            def hook(*args, **kwargs):
                fn = kwargs.get("fn")
                names.append(str(getattr(fn, "name", None) or kwargs.get("repr", "?"))[:80])
                return previous(*args, **kwargs) if previous is not None else None

            self._hook = hook
            self._runtime.jit_post_compile_hook = hook
        frames, graphs = _dynamo_counters()
        self._start = (_cache_sizes(), frames, graphs)
        return self

    def __exit__(self, *exc) -> None:
        frames, graphs = _dynamo_counters()
        caches = _cache_sizes()
        if self._runtime is not None:
            if self._runtime.jit_post_compile_hook is self._hook:
                self._runtime.jit_post_compile_hook = self._previous
            triton, source = len(self._names), "hook"
        elif "triton" in sys.modules:
            triton, source = caches - self._start[0], "caches"
        else:
            triton, source = 0, "none"
        self.counts = CompileCounts(triton, frames - self._start[1], graphs - self._start[2], source,
                                    tuple(self._names))
        if self.counts.total:
            log.warning("%d compilation(s) inside a counted region: %s", self.counts.total,
                        ", ".join(self._names[:10]) or f"{self.counts}")
