"""SM partitions: streams whose kernels run on a fixed share of the GPU's SMs (CUDA green contexts).

Why the CUDA runner wants one: under `mux` a prefill segment and a decode iteration are in flight
together on two streams, but a prefill GEMM's blocks take every SM, and the decode kernels start
only where those blocks retire, so decode mostly waits for prefill anyway (two plain streams gained
1-2% in docs/benchmarks.md's stand-in measurement). With `RunnerConfig.decode_sms` the runner's
prefill stream is a green context that leaves that many SMs out, while decode keeps its ordinary
high-priority stream over the whole device: whenever P is in flight D finds those SMs free, and
when no P is in flight D uses every SM, with the decode graphs it already has.

How: the device's SM resource is split once by the driver (`cuDevSmResourceSplitByCount`) into a
group of at least the held-back count (the driver rounds it up to its granularity, 8 SMs on
Hopper) and the remainder, and the remainder becomes a green context with a stream
(`cuGreenCtxCreate`, `cuGreenCtxStreamCreate`) that torch uses as an `ExternalStream`. Graphs
captured on that stream replay on the same SMs. Called through ctypes on libcuda, so nothing
beyond torch and an NVIDIA driver with green contexts (CUDA 12.4 or later) is needed.

`torch.cuda.green_contexts.GreenContext.create` is not used: each call picks its SMs from the whole
device on its own, so two such contexts overlap (measured in `benchmarks.sm_partition`).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import torch

_CU_DEV_RESOURCE_TYPE_SM = 1
_CU_GREEN_CTX_DEFAULT_STREAM = 0x1
_CU_STREAM_NON_BLOCKING = 0x1


class DevResource(ctypes.Structure):
    """`CUdevResource` (cuda.h, CUDA 12.4-13.x: 144 bytes): the type, 92 bytes of padding, then a
    union whose SM member starts with `smCount`; the rest is the driver's."""

    _fields_ = [("type", ctypes.c_int), ("_internal", ctypes.c_ubyte * 92), ("sm_count", ctypes.c_uint),
                ("_rest", ctypes.c_ubyte * 44)]


class Driver:
    """The libcuda entry points a split needs; every call checked, its error named."""

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise RuntimeError(f"SM partitions need libcuda.so.1 (an NVIDIA driver): {exc}") from exc

    def __call__(self, name: str, *args: Any) -> None:
        try:
            fn = getattr(self.lib, name)
        except AttributeError:
            raise RuntimeError(f"SM partitions need green contexts (CUDA 12.4 or later); this driver has no "
                               f"{name}") from None
        code = fn(*args)
        if code != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(code, ctypes.byref(text))
            raise RuntimeError(f"{name} failed: CUresult {code} ({(text.value or b'?').decode()})")

    def device(self, index: int) -> ctypes.c_int:
        torch.cuda.init()  # the primary context first, as cuGreenCtxCreate advises
        self("cuInit", 0)
        dev = ctypes.c_int()
        self("cuDeviceGet", ctypes.byref(dev), index)
        return dev

    def split(self, dev: ctypes.c_int, held_back: int) -> tuple[DevResource, DevResource]:
        """(a group of at least `held_back` SMs, the remainder): disjoint by construction."""
        whole, group, rest = DevResource(), DevResource(), DevResource()
        self("cuDeviceGetDevResource", dev, ctypes.byref(whole), _CU_DEV_RESOURCE_TYPE_SM)
        groups = ctypes.c_uint(1)
        self("cuDevSmResourceSplitByCount", ctypes.byref(group), ctypes.byref(groups), ctypes.byref(whole),
             ctypes.byref(rest), 0, held_back)
        return group, rest


@dataclass
class GreenStream:
    """A stream whose kernels run on `sms` SMs only; `close()` destroys the stream and its green
    context after the device has drained them (graphs captured on it must be gone by then)."""

    stream: torch.cuda.ExternalStream
    sms: int
    _driver: Driver = field(repr=False)
    _handles: tuple[int, int] = field(repr=False)
    """(green context, stream) as the driver gave them."""
    closed: bool = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        ctx, stream = self._handles
        self._driver("cuStreamSynchronize", ctypes.c_void_p(stream))
        self._driver("cuStreamDestroy_v2", ctypes.c_void_p(stream))
        self._driver("cuGreenCtxDestroy", ctypes.c_void_p(ctx))


def green_stream(driver: Driver, dev: ctypes.c_int, resource: DevResource, device: torch.device) -> GreenStream:
    """A green context holding exactly `resource`'s SMs, and a non-blocking stream of it."""
    desc, ctx, stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    driver("cuDevResourceGenerateDesc", ctypes.byref(desc), ctypes.byref(resource), 1)
    driver("cuGreenCtxCreate", ctypes.byref(ctx), desc, dev, _CU_GREEN_CTX_DEFAULT_STREAM)
    try:
        driver("cuGreenCtxStreamCreate", ctypes.byref(stream), ctx, _CU_STREAM_NON_BLOCKING, 0)
    except RuntimeError:
        driver("cuGreenCtxDestroy", ctx)
        raise
    return GreenStream(torch.cuda.ExternalStream(stream.value, device=device), resource.sm_count, driver,
                       (ctx.value, stream.value))


def partition_streams(held_back: int, device: torch.device, decode_too: bool
                      ) -> tuple[GreenStream, GreenStream | None]:
    """(a stream over the device minus at least `held_back` SMs (the driver's rounding), and with
    `decode_too` one over the held-back group, disjoint from it). Without `decode_too` the
    held-back SMs get no context of their own: ordinary streams still run on them and on the rest."""
    check_held_back(held_back, torch.cuda.get_device_properties(device).multi_processor_count)
    driver = Driver()
    dev = driver.device(_index(device))
    group, rest = driver.split(dev, held_back)
    prefill = green_stream(driver, dev, rest, device)
    if not decode_too:
        return prefill, None
    try:
        return prefill, green_stream(driver, dev, group, device)
    except RuntimeError:
        prefill.close()
        raise


_SHARED: dict[tuple[int, int, bool], tuple[GreenStream, GreenStream | None]] = {}


def shared_partition(held_back: int, device: torch.device, decode_too: bool
                     ) -> tuple[GreenStream, GreenStream | None]:
    """`partition_streams`, made once per device, count and shape and kept for the process: runners
    built one after another (a benchmark's schedules, tests) share it, and no green context is
    destroyed while graphs captured on its streams may still exist."""
    key = (_index(device), held_back, decode_too)
    if key not in _SHARED or any(g is not None and g.closed for g in _SHARED[key]):
        _SHARED[key] = partition_streams(held_back, device, decode_too)
    return _SHARED[key]


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def check_held_back(held_back: int, num_sms: int) -> None:
    """A held-back count the device can honour: positive and leaving at least a quarter of the SMs."""
    if type(held_back) is not int or held_back <= 0:
        raise ValueError(f"SMs held back must be a positive int, got {held_back!r}")
    if held_back > num_sms * 3 // 4:
        raise ValueError(f"holding back {held_back} of the device's {num_sms} SMs leaves the partition under a "
                         f"quarter of them; hold back at most {num_sms * 3 // 4}")
