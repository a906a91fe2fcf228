"""Device memory whose addresses outlive its physical pages: CUDA virtual memory management (VMM).

Why: a captured CUDA graph replays the addresses it read at capture. Memory freed and allocated
again through torch comes back at other addresses, so every graph over it must be captured again
(seconds at full size). Here a range of virtual addresses is reserved once and backed by physical
memory (`cuMemCreate`, `cuMemMap`, `cuMemSetAccess`). `StableBuffer.release` unmaps the range and
hands the physical memory back to the driver (a trainer sharing the GPU can allocate it), keeping
the reservation; `restore` maps new physical memory at the same addresses. Tensors over the range,
and the graphs that read them, stay valid across the two, provided nothing touches the range while
it is released (the engine refuses to work while asleep: `engine.memory`).

The driver is reached through `ctypes` (`libcuda.so.1`): nothing is compiled. `Driver` names the
calls a `VirtualRange` makes, so its bookkeeping (granularity, the order of the calls, what is
undone when one fails) runs on CPU against a fake driver in the tests; `CudaDriver` makes them
for real and turns a failing `CUresult` into `CudaDriverError`, which names the call.

Left out: sharing a range with other processes (exportable handles), several devices mapping one
range, growing a range, host memory.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import weakref
from typing import Protocol

import torch

log = logging.getLogger(__name__)

_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
_CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
_CUDA_ERROR_OUT_OF_MEMORY = 2


class _Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed: `call` is its name, `code` the `CUresult`, `name` its symbol."""

    def __init__(self, call: str, code: int, name: str, message: str) -> None:
        self.call, self.code, self.name = call, code, name
        hint = " (the device is out of memory: free some, e.g. torch.cuda.empty_cache(), and retry)" \
            if code == _CUDA_ERROR_OUT_OF_MEMORY else ""
        super().__init__(f"{call} failed: {name} ({code}): {message}{hint}")

    @property
    def out_of_memory(self) -> bool:
        return self.code == _CUDA_ERROR_OUT_OF_MEMORY


def round_up(nbytes: int, granularity: int) -> int:
    """`nbytes` rounded up to a multiple of `granularity` (at least one granule: a range is never empty)."""
    if granularity <= 0:
        raise ValueError(f"allocation granularity must be positive, got {granularity}")
    return max(1, -(-nbytes // granularity)) * granularity


class Driver(Protocol):
    """The driver calls a `VirtualRange` makes; addresses and handles are ints."""

    def granularity(self, device: int) -> int:
        """cuMemGetAllocationGranularity (minimum) of pinned memory on `device`."""
        ...

    def reserve(self, size: int, alignment: int, device: int) -> int:
        """cuMemAddressReserve: a range of `size` bytes; its address."""
        ...

    def free(self, address: int, size: int, device: int) -> None:
        """cuMemAddressFree."""
        ...

    def create(self, size: int, device: int) -> int:
        """cuMemCreate: `size` bytes of physical memory on `device`; its handle."""
        ...

    def release(self, handle: int, device: int) -> None:
        """cuMemRelease."""
        ...

    def map(self, address: int, size: int, handle: int, device: int) -> None:
        """cuMemMap of the whole handle at `address`."""
        ...

    def set_access(self, address: int, size: int, device: int) -> None:
        """cuMemSetAccess: read and write from `device`."""
        ...

    def unmap(self, address: int, size: int, device: int) -> None:
        """cuMemUnmap."""
        ...


class CudaDriver:
    """`Driver` over `libcuda.so.1` through ctypes. Every call runs with `device`'s primary context
    current (the one torch uses), and the thread's previous context is put back after it."""

    def __init__(self, lib) -> None:
        self.lib = lib
        self._contexts: dict[int, ctypes.c_void_p] = {}
        self._check(lib.cuInit(0), "cuInit")

    @staticmethod
    @functools.cache
    def load() -> "CudaDriver":
        """The process's driver (loaded once). Raises OSError where there is no libcuda."""
        return CudaDriver(ctypes.CDLL("libcuda.so.1"))

    def _check(self, result: int, call: str) -> None:
        if result == 0:
            return
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        self.lib.cuGetErrorName(result, ctypes.byref(name))
        self.lib.cuGetErrorString(result, ctypes.byref(text))
        raise CudaDriverError(call, int(result), (name.value or b"CUDA_ERROR_UNKNOWN").decode(),
                              (text.value or b"no description").decode())

    def _call(self, device: int, call: str, *args) -> None:
        """`lib.<call>(*args)` with `device`'s primary context current."""
        ctx = self._contexts.get(device)
        if ctx is None:
            dev, ctx = ctypes.c_int(), ctypes.c_void_p()
            self._check(self.lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
            self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            self._contexts[device] = ctx
        previous = ctypes.c_void_p()
        self._check(self.lib.cuCtxGetCurrent(ctypes.byref(previous)), "cuCtxGetCurrent")
        swap = previous.value != ctx.value
        if swap:
            self._check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        try:
            self._check(getattr(self.lib, call)(*args), call)
        finally:
            if swap:
                self._check(self.lib.cuCtxSetCurrent(previous), "cuCtxSetCurrent")

    def supports_vmm(self, device: int) -> bool:
        dev, flag = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        self._check(self.lib.cuDeviceGetAttribute(ctypes.byref(flag),
                                                  _CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev),
                    "cuDeviceGetAttribute")
        return bool(flag.value)

    @staticmethod
    def _prop(device: int) -> _AllocationProp:
        prop = _AllocationProp()
        prop.type = _CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location = _Location(_CU_MEM_LOCATION_TYPE_DEVICE, device)
        return prop

    def granularity(self, device: int) -> int:
        out = ctypes.c_size_t()
        self._call(device, "cuMemGetAllocationGranularity", ctypes.byref(out), ctypes.byref(self._prop(device)),
                         _CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        return out.value

    def reserve(self, size: int, alignment: int, device: int) -> int:
        out = ctypes.c_uint64()
        self._call(device, "cuMemAddressReserve", ctypes.byref(out), ctypes.c_size_t(size),
                         ctypes.c_size_t(alignment), ctypes.c_uint64(0), ctypes.c_uint64(0))
        return out.value

    def free(self, address: int, size: int, device: int) -> None:
        self._call(device, "cuMemAddressFree", ctypes.c_uint64(address), ctypes.c_size_t(size))

    def create(self, size: int, device: int) -> int:
        out = ctypes.c_uint64()
        self._call(device, "cuMemCreate", ctypes.byref(out), ctypes.c_size_t(size),
                         ctypes.byref(self._prop(device)), ctypes.c_uint64(0))
        return out.value

    def release(self, handle: int, device: int) -> None:
        self._call(device, "cuMemRelease", ctypes.c_uint64(handle))

    def map(self, address: int, size: int, handle: int, device: int) -> None:
        self._call(device, "cuMemMap", ctypes.c_uint64(address), ctypes.c_size_t(size), ctypes.c_size_t(0),
                         ctypes.c_uint64(handle), ctypes.c_uint64(0))

    def set_access(self, address: int, size: int, device: int) -> None:
        access = _AccessDesc(_Location(_CU_MEM_LOCATION_TYPE_DEVICE, device), _CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        self._call(device, "cuMemSetAccess", ctypes.c_uint64(address), ctypes.c_size_t(size),
                         ctypes.byref(access), ctypes.c_size_t(1))

    def unmap(self, address: int, size: int, device: int) -> None:
        self._call(device, "cuMemUnmap", ctypes.c_uint64(address), ctypes.c_size_t(size))


def vmm_unavailable(device: torch.device | str) -> str | None:
    """None where `StableBuffer` works on `device`; else why not (a sentence)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"address-stable memory needs a CUDA device, got {device}"
    if torch.version.hip is not None:
        return "address-stable memory uses the CUDA driver's VMM calls; this torch is built for ROCm"
    return _probe(_index(device))


@functools.cache
def _probe(index: int) -> str | None:
    """Once per device: the driver's support, then one granule through the whole cycle (torch must
    see the mapped range as memory of this device)."""
    try:
        driver = CudaDriver.load()
        if not driver.supports_vmm(index):
            return f"device cuda:{index} reports no virtual memory management support"
        buffer = StableBuffer(1, torch.device("cuda", index), driver)
        buffer.tensor.fill_(7)
        buffer.release()
        buffer.restore()
        ok = int(buffer.tensor.sum()) == 0  # restore zero-fills
        buffer.close()
    except Exception as exc:  # no libcuda, an old one, a failing call, a view torch refuses: all mean "not here"
        return f"the CUDA driver's virtual memory management does not work here: {type(exc).__name__}: {exc}"
    return None if ok else "a probe's memory was not zero after a restore"


STABLE_MODES = ("auto", "on", "off")
"""When a caller asks for address-stable memory: where available, always (an error where not), never."""


def stable_wanted(mode: str, device: torch.device | str) -> bool:
    """Whether to build address-stable memory on `device` under `mode` (one of `STABLE_MODES`)."""
    if mode not in STABLE_MODES:
        raise ValueError(f"address-stable memory mode must be one of {STABLE_MODES}, got {mode!r}")
    if mode == "off":
        return False
    why = vmm_unavailable(device)
    if why is not None and mode == "on":
        raise RuntimeError(f"address-stable memory was asked for (stable_memory='on') but {why}: use 'auto' "
                           f"(plain memory where it is unavailable) or 'off'")
    return why is None


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class VirtualRange:
    """A reserved range of device addresses, and the physical memory mapped there while `mapped`.
    The driver's bookkeeping only: no tensor (see `StableBuffer`).

    `size` is `nbytes` rounded up to the allocation granularity. A failing `map` leaves the range
    unmapped and releases what it had created; `unmap` of an unmapped range and `map` of a mapped
    one do nothing. The reservation is freed by `close` (after an unmap)."""

    def __init__(self, nbytes: int, device: int, driver: Driver) -> None:
        if nbytes <= 0:
            raise ValueError(f"a VirtualRange needs a positive size, got {nbytes} bytes")
        self.device, self.driver = device, driver
        self.granularity = driver.granularity(device)
        self.size = round_up(nbytes, self.granularity)
        self.address = driver.reserve(self.size, self.granularity, device)
        self.handle: int | None = None
        self.closed = False

    @property
    def mapped(self) -> bool:
        return self.handle is not None

    def map(self) -> int:
        """Back the range with new physical memory (contents undefined); the bytes mapped (0 if it was)."""
        if self.closed:
            raise RuntimeError(f"this address range ({self.size} bytes at {self.address:#x}) was closed: it "
                               f"cannot be mapped again")
        if self.mapped:
            return 0
        handle = self.driver.create(self.size, self.device)
        try:
            self.driver.map(self.address, self.size, handle, self.device)
        except BaseException:
            self.driver.release(handle, self.device)
            raise
        try:
            self.driver.set_access(self.address, self.size, self.device)
        except BaseException:
            self.driver.unmap(self.address, self.size, self.device)
            self.driver.release(handle, self.device)
            raise
        self.handle = handle
        return self.size

    def unmap(self) -> int:
        """Give the physical memory back to the driver, keeping the addresses; the bytes released."""
        if not self.mapped:
            return 0
        self.driver.unmap(self.address, self.size, self.device)
        handle, self.handle = self.handle, None
        self.driver.release(handle, self.device)
        return self.size

    def close(self) -> None:
        """Unmap and free the reservation; idempotent."""
        if self.closed:
            return
        self.unmap()
        self.closed = True
        self.driver.free(self.address, self.size, self.device)


class _Window:
    """What `torch.as_tensor` reads (`__cuda_array_interface__`): the range's bytes. The tensor keeps
    this object alive, so the range is closed only after the last tensor over it is gone."""

    def __init__(self, address: int, size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (address, False),
                                         "strides": None, "version": 3}


def _close_quietly(memory: VirtualRange) -> None:
    try:
        memory.close()
    except Exception as exc:  # garbage collection must not raise; the driver frees it all at exit
        log.warning("could not free an address-stable range of %d bytes: %s", memory.size, exc)


class StableBuffer:
    """`nbytes` of device memory at a fixed address: `tensor` (uint8, `[size]`) stays valid across
    `release()` (physical memory back to the driver) and `restore()` (new physical memory at the same
    addresses, zero-filled). Between the two the tensor must not be touched: the device faults on it.

    The memory is zero-filled when created, as `torch.zeros` would be. `close()` releases the physical
    memory for good; the addresses are freed once no tensor over them is left (garbage collection)."""

    def __init__(self, nbytes: int, device: torch.device | str, driver: Driver | None = None) -> None:
        device = torch.device(device)
        why = None if driver is not None else vmm_unavailable(device)
        if why is not None:
            raise RuntimeError(f"cannot allocate address-stable memory: {why}")
        self.device = torch.device(device.type, _index(device))  # "cuda" -> "cuda:N", as tensors report it
        self.range = VirtualRange(nbytes, self.device.index, driver or CudaDriver.load())
        self.nbytes = nbytes
        self.closed = False
        window = _Window(self.range.address, self.range.size)
        self._finalizer = weakref.finalize(window, _close_quietly, self.range)
        self._finalizer.atexit = False  # at exit the driver frees it, maybe already torn down
        try:
            self.range.map()
            self.tensor = torch.as_tensor(window, device=self.device)  # [size] uint8, the range's bytes
            if self.tensor.device != self.device or self.tensor.data_ptr() != self.range.address:
                raise RuntimeError(f"torch placed the range at {self.tensor.device} {self.tensor.data_ptr():#x}, "
                                   f"expected {self.device} {self.range.address:#x} (a copy, not a view)")
        except BaseException:
            self._finalizer()
            raise
        self.tensor.zero_()

    @property
    def size(self) -> int:
        """Bytes reserved and mapped: `nbytes` rounded up to the driver's granularity."""
        return self.range.size

    @property
    def mapped(self) -> bool:
        return self.range.mapped

    def view(self, dtype: torch.dtype, shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
        """A tensor of `dtype` and `shape` over the bytes from `offset` (a multiple of the item size)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for d in shape:
            numel *= d
        if offset % itemsize or offset + numel * itemsize > self.nbytes:
            raise ValueError(f"a {dtype} view of shape {shape} at byte {offset} does not fit a buffer of "
                             f"{self.nbytes} bytes (or the offset is not a multiple of {itemsize})")
        return self.tensor[offset:offset + numel * itemsize].view(dtype).view(shape)

    def release(self) -> int:
        """Physical memory back to the driver after the device's work is done; the bytes released
        (0 if released already)."""
        if not self.mapped:
            return 0
        torch.cuda.synchronize(self.device)  # no kernel still reads or writes the range
        return self.range.unmap()

    def restore(self) -> int:
        """New physical memory at the same addresses, zero-filled; the bytes mapped (0 if mapped).
        On failure (e.g. `CudaDriverError` out of memory) the buffer stays released: retry later."""
        if self.closed:
            raise RuntimeError("this StableBuffer was closed: its memory cannot be restored")
        if self.mapped:
            return 0
        try:
            nbytes = self.range.map()
        except CudaDriverError as exc:
            if not exc.out_of_memory:
                raise
            torch.cuda.empty_cache()  # torch's allocator may cache what the driver lacks; once more
            nbytes = self.range.map()
        self.tensor.zero_()  # new pages hold whatever they held: make them what the old ones began as
        return nbytes

    def close(self) -> None:
        """Release the physical memory for good (restore is refused from now on)."""
        self.release()
        self.closed = True  # the addresses are freed by the finalizer, once no tensor reads them
