"""The engine's weight copy moved out of device memory while it sleeps, and back (`engine.memory`).

Two ways, chosen per engine by `engine.memory`:

- `WeightOffload`: every storage under the model's parameters and buffers is copied to host
  memory and resized to zero bytes; on restore it is allocated again (at a new address) and copied
  back, bit for bit. Resizing the storages, rather than re-pointing the parameters, keeps every
  view a view (the CUDA runner's stacked experts). Graphs captured over the weights must be
  captured again.
- `StableWeights`: the first offload moves every such storage into one `vmm.StableBuffer` (each
  tensor over it re-pointed there: parameters, buffers, the stacked experts), and releases the
  buffer's physical memory; later offloads copy the buffer to the host and release it, and a
  restore maps memory at the same addresses and copies back. The addresses change once, at the
  first offload; from the second on, graphs over the weights stay valid.

Moving a storage is safe only if every tensor over it is re-pointed: `stable_holders` finds the
tensors reachable from the model's modules (attributes, and tuples, lists and dicts of them, and
the bases of views) and compares their number with the storage's reference count; any holder it
cannot see (a `state_dict()` kept by a caller, a trainer's flat buffer) means no move, and the
engine keeps `WeightOffload`, saying why. Host memory is chunked (`HostBytes`) and pinned on CUDA.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from megatron_rollout.vmm import StableBuffer


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (a view, no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def weight_storages(model: nn.Module) -> list[torch.UntypedStorage]:
    """Each non-empty storage under the model's parameters and buffers once (tied weights and
    stacked experts share one)."""
    seen, out = set(), []
    for t in itertools.chain(model.parameters(), model.buffers()):
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            out.append(storage)
    return out


def _copy_out(host: "HostBytes", offset: int, device: torch.Tensor) -> None:
    """`device` (uint8) into the host bytes from `offset`, without waiting."""
    for pos, piece in host.pieces(offset, device.numel()):
        piece.copy_(device[pos:pos + piece.numel()], non_blocking=True)


def _copy_in(host: "HostBytes", offset: int, device: torch.Tensor) -> None:
    """The host bytes from `offset` into `device` (uint8), without waiting."""
    for pos, piece in host.pieces(offset, device.numel()):
        device[pos:pos + piece.numel()].copy_(piece, non_blocking=True)


class HostBytes:
    """`nbytes` of host memory as chunks of `CHUNK` bytes, pinned on CUDA hosts. The pinned allocator
    rounds every allocation up to a power of two: one buffer per storage, or one for all of them,
    could take up to twice the bytes; chunks waste less than one chunk."""

    CHUNK = 1 << 30

    def __init__(self, nbytes: int, pinned: bool) -> None:
        self.nbytes = nbytes
        self.chunks = [torch.empty(min(self.CHUNK, nbytes - at), dtype=torch.uint8, pin_memory=pinned)
                       for at in range(0, nbytes, self.CHUNK)]

    def pieces(self, offset: int, length: int) -> Iterator[tuple[int, torch.Tensor]]:
        """The host bytes [offset, offset + length) in pieces: (position in the range, bytes)."""
        pos = 0
        while pos < length:
            chunk, at = divmod(offset + pos, self.CHUNK)
            n = min(length - pos, self.CHUNK - at)
            yield pos, self.chunks[chunk][at:at + n]
            pos += n


class WeightOffload:
    """The storages under a model's parameters and buffers, moved to host memory and back."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._held: list[tuple[torch.UntypedStorage, int]] = []  # emptied, and their sizes, in `_host`'s order
        self._host: HostBytes | None = None

    def storages(self) -> list[torch.UntypedStorage]:
        return weight_storages(self.model)

    def offload(self) -> int:
        """Copy every storage to the host, then empty it on the device; the bytes moved."""
        storages = self.storages()
        sizes = [s.nbytes() for s in storages]
        host = HostBytes(sum(sizes), pinned=any(s.device.type == "cuda" for s in storages))
        for storage, offset in zip(storages, itertools.accumulate([0] + sizes)):
            _copy_out(host, offset, _as_bytes(storage))
        _synchronize(storages)  # every copy has landed before its source is freed
        for storage in storages:
            storage.resize_(0)
        self._held, self._host = list(zip(storages, sizes)), host
        return host.nbytes

    def restore(self) -> int:
        """Allocate every storage again and copy its bytes back; the bytes moved."""
        host, offset = self._host, 0
        if host is None:
            return 0
        for storage, size in self._held:
            storage.resize_(size)
            _copy_in(host, offset, _as_bytes(storage))
            offset += size
        _synchronize(s for s, _ in self._held)  # the host bytes may be dropped once these copies have landed
        self._held, self._host = [], None
        return host.nbytes


def _synchronize(storages: Iterable[torch.UntypedStorage]) -> None:
    for device in {s.device for s in storages if s.device.type == "cuda"}:
        torch.cuda.synchronize(device)


def _tensors_in(value, found: dict[int, torch.Tensor], depth: int = 0) -> None:
    """Every tensor in `value` (a tensor, or tuples, lists and dicts of them) and the bases of views."""
    if isinstance(value, torch.Tensor):
        while value is not None and id(value) not in found:
            found[id(value)] = value
            value = value._base
    elif isinstance(value, (tuple, list)) and depth < 4:
        for v in value:
            _tensors_in(v, found, depth + 1)
    elif isinstance(value, dict) and depth < 4:
        for v in value.values():
            _tensors_in(v, found, depth + 1)


def stable_holders(model: nn.Module) -> dict[torch.UntypedStorage, list[torch.Tensor]] | str:
    """For each weight storage, every tensor over it; or why a move would be unsafe (a sentence):
    a holder outside the model's modules, or a tensor that cannot be re-pointed (a subclass)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return f"this torch ({torch.__version__}) cannot count a storage's references"
    devices = {s.device for s in weight_storages(model)}
    if len(devices) != 1:
        return f"the weights lie on {len(devices)} devices ({sorted(map(str, devices))}), not one"
    found: dict[int, torch.Tensor] = {}
    for module in model.modules():
        _tensors_in(list(vars(module).values()), found)
    out: dict[torch.UntypedStorage, list[torch.Tensor]] = {}
    for storage in weight_storages(model):
        holders = [t for t in found.values() if t.untyped_storage()._cdata == storage._cdata]
        odd = [type(t).__name__ for t in holders if type(t) not in (torch.Tensor, nn.Parameter)]
        if odd:
            return f"tensors of types {sorted(set(odd))} cannot be re-pointed"
        unknown = count(storage._cdata) - len(holders) - 1  # 1: `storage`, the one Python object over it
        if unknown:
            return (f"a storage of {storage.nbytes()} bytes is held by {unknown} tensor(s) outside the model's "
                    f"modules (a kept state_dict(), a trainer's buffer): they would not follow a move")
        out[storage] = holders
    return out


class StableWeights:
    """The weight storages moved once into one `StableBuffer` at the first `offload` (module docstring);
    from then on offloaded and restored at the same addresses. `make_buffer(nbytes, device)` builds
    the buffer (a `StableBuffer`; the tests pass a host stand-in)."""

    ALIGN = 512
    """Byte alignment of each storage in the buffer (any dtype's element size divides it)."""

    def __init__(self, model: nn.Module, make_buffer: Callable[[int, torch.device], StableBuffer] = StableBuffer
                 ) -> None:
        self.model, self.make_buffer = model, make_buffer
        self.buffer: StableBuffer | None = None
        self.nbytes = 0  # the bytes of the buffer in use (storages and their alignment gaps)
        self._host: HostBytes | None = None

    @property
    def moved(self) -> bool:
        """The storages live in the buffer: offload and restore keep their addresses."""
        return self.buffer is not None

    def offload(self) -> int:
        """Copy the weights to the host and give their device memory back to the driver; the bytes
        copied. The first call moves them into the buffer (new addresses); it refuses (ValueError,
        the weights as they were) where `stable_holders` does or the buffer cannot be built."""
        if self._host is not None:
            return 0
        if self.buffer is None:
            return self._move_out()
        host = HostBytes(self.nbytes, pinned=self.buffer.tensor.device.type == "cuda")
        _copy_out(host, 0, self.buffer.tensor[:self.nbytes])
        self.buffer.release()  # waits for the device, so the copies have landed
        self._host = host
        return self.nbytes

    def restore(self) -> int:
        """Map the buffer's memory at its addresses and copy the weights back; the bytes copied.
        A failing map (out of memory) raises and leaves the weights offloaded: retry later."""
        host = self._host
        if host is None:
            return 0
        self.buffer.restore()
        _copy_in(host, 0, self.buffer.tensor[:self.nbytes])
        _synchronize([self.buffer.tensor.untyped_storage()])  # the host bytes are dropped next
        self._host = None
        return self.nbytes

    def _move_out(self) -> int:
        """The first offload: storages to the host, freed; every holder re-pointed into a new buffer,
        which is then released. The device never holds the old and the new copy at once."""
        groups = stable_holders(self.model)
        if isinstance(groups, str):
            raise ValueError(f"the weights cannot move to address-stable memory: {groups}")
        storages = list(groups)
        offsets = list(itertools.accumulate([0] + [-(-s.nbytes() // self.ALIGN) * self.ALIGN for s in storages]))
        nbytes, device = offsets.pop(), storages[0].device
        host = HostBytes(nbytes, pinned=device.type == "cuda")
        for storage, offset in zip(storages, offsets):
            _copy_out(host, offset, _as_bytes(storage))
        _synchronize(storages)
        sizes = [s.nbytes() for s in storages]
        for storage in storages:
            storage.resize_(0)
        try:
            buffer = self.make_buffer(nbytes, device)
        except Exception as exc:  # e.g. the driver out of memory: the weights go back where they were
            for storage, offset, size in zip(storages, offsets, sizes):
                storage.resize_(size)
                _copy_in(host, offset, _as_bytes(storage))
            _synchronize(storages)
            raise ValueError(f"no address-stable memory for {nbytes} bytes of weights: "
                             f"{type(exc).__name__}: {exc}") from exc
        whole = buffer.tensor.untyped_storage()
        start = buffer.tensor.storage_offset()  # bytes: the buffer's tensor is uint8
        for holders, offset in zip(groups.values(), offsets):
            for t in holders:  # each keeps its dtype, shape, strides and offset in its storage
                item = t.element_size()
                view = torch.empty(0, dtype=t.dtype, device=device).set_(
                    whole, (start + offset) // item + t.storage_offset(), t.shape, t.stride())
                t.data = view
        self.buffer, self.nbytes, self._host = buffer, nbytes, host
        buffer.release()
        return nbytes
