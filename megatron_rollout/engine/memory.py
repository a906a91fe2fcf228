"""Memory handed back to the trainer between rollouts: `sleep(tags)` and `wake_up(tags)` by tag.

The engine is a guest in the trainer's device memory (docs/design.md §10). While the trainer
steps, the engine gives back what it holds, one tag at a time, and takes it again before the
next rollout:

- `kv`: the paged KV tensors. The block pool is emptied with them: sessions keep their tokens and
  recompute their KV on their next turn. Two paths (the report's `path` says which ran):
  `vmm` where the cache is address-stable (`KVConfig.stable_memory`, CUDA with the driver's virtual
  memory management: `vmm.StableBuffer`): its physical memory goes back to the driver and comes
  back, zero-filled, at the same addresses, so the graphs over it stay captured; `reallocate`
  elsewhere (CPU, a driver without VMM, `stable_memory="off"`): the tensors are dropped, and new
  ones of the same shape allocated on wake.
- `graphs`: the runner's captured CUDA graphs (decode and piecewise prefill buckets) and their
  memory pools. On wake, one rank captures again the buckets it held; many ranks capture
  collectively at their first decode step, as after construction (`Runner.restore_graphs`).
- `weights`: the engine's weight copy goes to pinned host memory and comes back bit for bit
  (`weights.offload`). Two paths: `vmm` where the memory is address-stable (the same condition as
  the KV's): the first sleep moves the weights into one `StableBuffer` (new addresses, once), and
  every sleep releases its memory to the driver, every wake maps it again at the same addresses;
  `offload` elsewhere, or where the move is refused (a holder of the weights outside the model:
  the note says which): the storages are emptied and re-allocated at new addresses. An engine over
  the trainer's own tensors (`from_megatron` sharing storage, `WeightStore.bind`) holds no copy:
  nothing is moved, and the report says so.

Graphs read the addresses of the KV and of the weights, and re-allocated memory has new ones: so
sleeping `kv` on the `reallocate` path, or `weights` on the `offload` path or at their first `vmm`
sleep (the move), sleeps `graphs` too, and `graphs` wake with the call that leaves both awake.
Graphs may not wake while the KV sleeps on either path (their capture runs forwards over it).
Every call returns a report (`TagReport` per tag, as a dict): whether the tag changed and by which
path, the bytes of the tensors freed or re-taken, and on CUDA the change of `memory_allocated` and
`memory_reserved` around that tag's work (freed blocks returned to the driver first), and the
device's free bytes before and after the call.

This module holds the state (which tags sleep, the host copies) and moves the memory; the engine
decides when it may (no request in flight) and refuses to generate while any tag sleeps.
Left out: the comm's dispatch buffers and the graphs' pools on the `vmm` path (they stay unless
`graphs` is asked for); FP8 and Transformer Engine copies derived from the weights (they stay);
giving back pinned host memory (torch's host allocator keeps it after the wake, for the next sleep).
"""
from __future__ import annotations

import dataclasses
import enum
import gc
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from megatron_rollout.engine.bookkeeping import RequestTable
from megatron_rollout.kv.paged import PagedKVCache
from megatron_rollout.runner.base import CapturedGraphs, Runner
from megatron_rollout.weights.offload import StableWeights, WeightOffload
from megatron_rollout.weights.store import WeightStore


class Tag(str, enum.Enum):
    """What `sleep` frees and `wake_up` takes again."""

    KV = "kv"
    GRAPHS = "graphs"
    WEIGHTS = "weights"


class EngineAsleep(RuntimeError):
    """The engine was asked to work while some of its memory is handed back."""


def parse_tags(tags: str | Iterable[str] | None) -> frozenset[Tag]:
    """None: every tag; a single name or an iterable of names ("kv", "graphs", "weights")."""
    if tags is None:
        return frozenset(Tag)
    names = [tags] if isinstance(tags, str) else list(tags)
    if not names:
        raise ValueError(f"no memory tags given: pass some of {[t.value for t in Tag]}, or None for all of them")
    out = set()
    for name in names:
        try:
            out.add(Tag(name))
        except ValueError:
            raise ValueError(f"unknown memory tag {name!r}: the tags are {[t.value for t in Tag]} "
                             f"(None: all of them)") from None
    return frozenset(out)


@dataclass(frozen=True)
class DeviceMemory:
    """A CUDA device's memory as torch sees it, read after freed blocks went back to the driver."""

    allocated: int
    """`torch.cuda.memory_allocated`: bytes in live tensors (graph pools included)."""
    reserved: int
    """`torch.cuda.memory_reserved`: bytes the caching allocator holds."""
    free: int
    """`torch.cuda.mem_get_info()[0]`: bytes free on the device, whoever holds the rest."""

    @staticmethod
    def read(device: torch.device) -> "DeviceMemory | None":
        """None off CUDA (host memory is not measured)."""
        if device.type != "cuda":
            return None
        torch.cuda.synchronize(device)
        gc.collect()  # a graph or a cache kept alive only by a reference cycle is freed now, not later
        torch.cuda.empty_cache()
        return DeviceMemory(torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device),
                            torch.cuda.mem_get_info(device)[0])


@dataclass(frozen=True)
class TagReport:
    """What one tag of one `sleep` or `wake_up` call did."""

    changed: bool
    """False where the tag was in the asked state already, or had nothing to move (`note` says which)."""
    tensor_bytes: int
    """Bytes of the tensors freed (sleep) or allocated (wake), counted from their sizes; graphs: 0
    (their pools are the allocator's, measured below)."""
    allocated_bytes: int | None
    """CUDA: how much `memory_allocated` fell (sleep) or rose (wake) around this tag; None elsewhere."""
    reserved_bytes: int | None
    """CUDA: the same for `memory_reserved`, after `empty_cache` (memory released on the `vmm` path is
    not torch's: it shows in `DeviceMemory.free` only)."""
    note: str
    path: str | None = None
    """How the memory moved: "vmm" (physical memory released and re-mapped at the same addresses),
    "reallocate" (freed, allocated anew), "offload" (copied to the host and back); None: nothing moved."""


@dataclass(frozen=True)
class _Moved:
    """A tag's own account of its work; `EngineMemory` adds the measurements."""

    changed: bool
    tensor_bytes: int = 0
    note: str = ""
    path: str | None = None


def _measured(moved: _Moved, before: DeviceMemory | None, after: DeviceMemory | None, freed: bool) -> TagReport:
    """`moved` with the device's change around it: bytes freed (`freed`) or taken."""
    if before is None or after is None:
        return TagReport(moved.changed, moved.tensor_bytes, None, None, moved.note, moved.path)
    sign = 1 if freed else -1
    return TagReport(moved.changed, moved.tensor_bytes, sign * (before.allocated - after.allocated),
                     sign * (before.reserved - after.reserved), moved.note, moved.path)


def _kv_bytes(cache: PagedKVCache | None) -> int:
    if cache is None:
        return 0
    return cache.k.nbytes + (cache.v.nbytes if cache.v is not cache.k else 0)  # MLA: one tensor is both


class EngineMemory:
    """Which tags sleep, and the moves that put them to sleep and wake them (module docstring).
    The engine calls it under its lock, with no request in flight."""

    def __init__(self, runner: Runner, table: RequestTable, weights: WeightStore,
                 new_cache: Callable[[], PagedKVCache], before_sleep: Callable[[], None], stable: bool = False) -> None:
        self.runner, self.table, self.weights = runner, table, weights
        self.new_cache = new_cache
        """A fresh KV cache of the engine's shape, on its device."""
        self.before_sleep = before_sleep
        """Stops device work that reads the memory being freed (the decode issued ahead)."""
        self.device = weights.model.device
        self.asleep: set[Tag] = set()
        self._offload = WeightOffload(weights.model)
        self._stable_weights = StableWeights(weights.model) if stable else None
        """The `vmm` path of the weights; None where memory is not address-stable or the move was refused."""
        self._graphs = CapturedGraphs()
        self.kv_stable = runner.cache is not None and runner.cache.memory is not None
        """The KV cache is address-stable: it sleeps and wakes under the graphs (the `vmm` path)."""

    def sleep(self, tags: str | Iterable[str] | None = None) -> dict:
        asked = parse_tags(tags)
        todo = set(asked)
        weights_stay = self.weights.shared or (self._stable_weights is not None and self._stable_weights.moved)
        if (Tag.KV in asked and not self.kv_stable) or (Tag.WEIGHTS in asked and not weights_stay):
            todo.add(Tag.GRAPHS)  # they read the addresses being freed
        self.before_sleep()
        return self._run("sleep", [t for t in (Tag.GRAPHS, Tag.KV, Tag.WEIGHTS) if t in todo], asked)

    def wake_up(self, tags: str | Iterable[str] | None = None) -> dict:
        asked = parse_tags(tags)
        todo = set(asked)
        stay = (self.asleep - asked) & {Tag.KV, Tag.WEIGHTS}
        if Tag.GRAPHS in asked and stay:
            raise ValueError(f"graphs are captured over the KV cache and the weights, and "
                             f"{sorted(t.value for t in stay)} stay asleep: wake them in the same call "
                             f"(wake_up(tags=None) wakes everything)")
        woke = self.asleep & asked & {Tag.KV, Tag.WEIGHTS}
        if Tag.GRAPHS in self.asleep and woke and not stay:
            todo.add(Tag.GRAPHS)  # put to sleep with them: back with them
        return self._run("wake_up", [t for t in (Tag.WEIGHTS, Tag.KV, Tag.GRAPHS) if t in todo], asked)

    # -- one call: the tags in order, each measured --------------------------------------------
    def _run(self, action: str, order: list[Tag], asked: frozenset[Tag]) -> dict:
        sleeping = action == "sleep"
        moves = self._SLEEP if sleeping else self._WAKE
        start = time.perf_counter()
        first = last = DeviceMemory.read(self.device)
        tags: dict[str, dict] = {}
        for tag in order:
            if (tag in self.asleep) == sleeping:
                moved = _Moved(False, note="already asleep" if sleeping else "already awake")
            else:
                moved = moves[tag](self)
            if moved.changed:
                (self.asleep.add if sleeping else self.asleep.discard)(tag)
                if tag not in asked:  # implied by the tags asked for: say which
                    moved = dataclasses.replace(moved, note=f"{moved.note}; with {'/'.join(sorted(asked))}")
            before, last = last, DeviceMemory.read(self.device)
            tags[tag.value] = dataclasses.asdict(_measured(moved, before, last, sleeping))
        return {"action": action, "tags": tags, "asleep": sorted(t.value for t in self.asleep),
                "tensor_bytes": sum(r["tensor_bytes"] for r in tags.values()),
                "device": str(self.device), "seconds": time.perf_counter() - start,
                "before": None if first is None else dataclasses.asdict(first),
                "after": None if last is None else dataclasses.asdict(last)}

    # -- the moves ---------------------------------------------------------------------------
    def _sleep_kv(self) -> _Moved:
        cache = self.runner.cache
        nbytes = _kv_bytes(cache)
        self.table.evict_all()
        self.table.new_pool()  # cached prefixes point into the K/V being freed
        if self.kv_stable:
            cache.release()
            return _Moved(True, nbytes, "KV cache's memory released to the driver at kept addresses (graphs stay); "
                                        "sessions recompute their KV on their next turn", "vmm")
        self.runner.cache = None
        return _Moved(True, nbytes, "KV cache freed; sessions recompute their KV on their next turn", "reallocate")

    def _wake_kv(self) -> _Moved:
        if self.kv_stable:
            cache = self.runner.cache
            cache.restore()  # on failure (out of memory) the KV stays asleep, released: wake_up may be retried
            return _Moved(True, _kv_bytes(cache), f"KV cache mapped again at its addresses ({cache.num_blocks} "
                                                  f"blocks, zero-filled)", "vmm")
        cache = self.runner.cache = self.new_cache()
        return _Moved(True, _kv_bytes(cache), f"KV cache allocated ({cache.num_blocks} blocks)", "reallocate")

    def _sleep_graphs(self) -> _Moved:
        self._graphs = self.runner.release_graphs()
        return _Moved(True, 0, f"released {self._graphs.describe()}")

    def _wake_graphs(self) -> _Moved:
        held, self._graphs = self._graphs, CapturedGraphs()
        return _Moved(True, 0, self.runner.restore_graphs(held))

    def _sleep_weights(self) -> _Moved:
        if self.weights.shared:
            return _Moved(False, note="the engine's parameters are the trainer's own tensors (shared storage): "
                                      "there is no copy to offload")
        pinned, why = " (pinned)" if self.device.type == "cuda" else "", ""
        if self._stable_weights is not None:
            first = not self._stable_weights.moved
            try:
                nbytes = self._stable_weights.offload()
            except ValueError as exc:  # refused before anything moved: this engine keeps the offload path
                self._stable_weights, why = None, f" ({exc}; graphs follow the weights)"
            else:
                how = "moved into address-stable memory (new addresses, once: graphs captured again on wake)" \
                    if first else "addresses kept: graphs stay"
                return _Moved(True, nbytes, f"weights copied to host memory{pinned}, device memory released; {how}",
                              "vmm")
        return _Moved(True, self._offload.offload(), f"weights offloaded to host memory{pinned}{why}", "offload")

    def _wake_weights(self) -> _Moved:
        if self._stable_weights is not None:  # on failure (out of memory) they stay offloaded: wake_up may be retried
            return _Moved(True, self._stable_weights.restore(), "weights mapped at their addresses and copied back "
                                                                "from host memory", "vmm")
        return _Moved(True, self._offload.restore(), "weights copied back from host memory", "offload")

    _SLEEP: dict[Tag, Callable[["EngineMemory"], _Moved]] = {
        Tag.KV: _sleep_kv, Tag.GRAPHS: _sleep_graphs, Tag.WEIGHTS: _sleep_weights}
    _WAKE: dict[Tag, Callable[["EngineMemory"], _Moved]] = {
        Tag.KV: _wake_kv, Tag.GRAPHS: _wake_graphs, Tag.WEIGHTS: _wake_weights}
