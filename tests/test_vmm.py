"""Address-stable device memory (`megatron_rollout/vmm.py`).

CPU: granularity rounding, the order of a `VirtualRange`'s driver calls and what a failing call
undoes (a fake driver), `CudaDriver`'s error mapping and context handling (a fake `libcuda` whose
functions write their outputs through the ctypes pointers they are given), and the choice of
memory (`stable_wanted`, `KVConfig.stable_memory`, a stable `PagedKVCache` refused off CUDA).
GPU: a `StableBuffer` keeps its address across release and restore, gives its memory to the
driver in between, and is zero-filled and writable after the restore.
"""
from __future__ import annotations

import ctypes

import pytest
import torch

from megatron_rollout.engine import KVConfig
from megatron_rollout.kv.paged import PagedKVCache
from megatron_rollout.model.config import preset
from megatron_rollout.vmm import (
    CudaDriver,
    CudaDriverError,
    StableBuffer,
    VirtualRange,
    round_up,
    stable_wanted,
    vmm_unavailable,
)

MIB2 = 2 << 20


def test_sizes_round_up_to_whole_granules():
    assert round_up(1, MIB2) == MIB2
    assert round_up(MIB2, MIB2) == MIB2
    assert round_up(MIB2 + 1, MIB2) == 2 * MIB2
    assert round_up(0, 4096) == 4096  # a range is never empty
    with pytest.raises(ValueError, match="granularity must be positive, got 0"):
        round_up(10, 0)


class FakeDriver:
    """Records the calls; `fail` names a call that raises once."""

    def __init__(self, granularity: int = MIB2, fail: str | None = None) -> None:
        self.calls: list[tuple] = []
        self.gran, self.fail, self.handles = granularity, fail, 0
        self.live: set[int] = set()  # physical handles not released

    def _record(self, *call) -> None:
        self.calls.append(call)
        if call[0] == self.fail:
            self.fail = None
            raise CudaDriverError(call[0], 2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory")

    def granularity(self, device):
        return self.gran

    def reserve(self, size, alignment, device):
        self._record("reserve", size, alignment, device)
        return 0x7F0000000000

    def free(self, address, size, device):
        self._record("free", address, size, device)

    def create(self, size, device):
        self._record("create", size, device)
        self.handles += 1
        self.live.add(self.handles)
        return self.handles

    def release(self, handle, device):
        self._record("release", handle, device)
        self.live.discard(handle)

    def map(self, address, size, handle, device):
        self._record("map", address, size, handle, device)

    def set_access(self, address, size, device):
        self._record("set_access", address, size, device)

    def unmap(self, address, size, device):
        self._record("unmap", address, size, device)


def test_a_range_keeps_its_address_while_its_memory_comes_and_goes():
    driver = FakeDriver()
    memory = VirtualRange(3 * MIB2 + 5, device=1, driver=driver)
    size, addr = 4 * MIB2, 0x7F0000000000
    assert (memory.size, memory.address, memory.mapped) == (size, addr, False)
    assert memory.map() == size and memory.map() == 0  # the second: mapped already
    assert memory.unmap() == size and memory.unmap() == 0
    assert memory.map() == size and memory.address == addr
    memory.close()
    memory.close()
    assert driver.calls == [
        ("reserve", size, MIB2, 1),
        ("create", size, 1), ("map", addr, size, 1, 1), ("set_access", addr, size, 1),
        ("unmap", addr, size, 1), ("release", 1, 1),
        ("create", size, 1), ("map", addr, size, 2, 1), ("set_access", addr, size, 1),
        ("unmap", addr, size, 1), ("release", 2, 1), ("free", addr, size, 1)]  # close: unmapped first, once
    assert not driver.live
    with pytest.raises(RuntimeError, match="was closed: it cannot be mapped again"):
        memory.map()
    with pytest.raises(ValueError, match="positive size, got 0 bytes"):
        VirtualRange(0, 0, driver)


@pytest.mark.parametrize("fail, undone", [
    ("create", []),
    ("map", [("release", 1, 0)]),
    ("set_access", [("unmap", 0x7F0000000000, MIB2, 0), ("release", 1, 0)]),
])
def test_a_failed_map_undoes_its_steps_and_can_be_retried(fail, undone):
    driver = FakeDriver(fail=fail)
    memory = VirtualRange(100, 0, driver)
    driver.calls.clear()
    with pytest.raises(CudaDriverError, match=f"{fail} failed: CUDA_ERROR_OUT_OF_MEMORY") as err:
        memory.map()
    assert err.value.out_of_memory and not memory.mapped and not driver.live
    failed_at = [c[0] for c in driver.calls].index(fail)
    assert driver.calls[failed_at + 1:] == undone
    assert memory.map() == MIB2 and memory.mapped  # nothing was left half done


class FakeLib:
    """`libcuda` as ctypes calls it: each function returns a CUresult; outputs are written through
    the `byref` pointers passed in (`ptr._obj`). `results` maps a function to the code it returns."""

    def __init__(self, results: dict[str, int] | None = None, current: int = 0) -> None:
        self.results, self.current, self.calls = results or {}, current, []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append(name)
            out = args[0]._obj if args and hasattr(args[0], "_obj") else None
            if name == "cuGetErrorName":
                args[1]._obj.value = {2: b"CUDA_ERROR_OUT_OF_MEMORY"}.get(args[0], b"CUDA_ERROR_X")
            elif name == "cuGetErrorString":
                args[1]._obj.value = b"out of memory"
            elif name == "cuDevicePrimaryCtxRetain":
                out.value = 0xC0
            elif name == "cuCtxGetCurrent":
                out.value = self.current or None
            elif name == "cuCtxSetCurrent":
                self.current = args[0].value or 0
            elif name == "cuMemGetAllocationGranularity":
                out.value = MIB2
            elif name == "cuMemCreate":
                out.value = 77
            return self.results.get(name, 0)
        return call


def test_driver_errors_name_the_call_and_the_code():
    lib = FakeLib({"cuMemCreate": 2})
    driver = CudaDriver(lib)
    with pytest.raises(CudaDriverError, match=r"cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY \(2\): out of memory "
                                              r"\(the device is out of memory: free some"):
        driver.create(MIB2, 0)
    lib.results = {"cuMemMap": 1}
    with pytest.raises(CudaDriverError, match=r"cuMemMap failed: CUDA_ERROR_X \(1\)") as err:
        driver.map(0x1000, MIB2, 77, 0)
    assert not err.value.out_of_memory and err.value.call == "cuMemMap"
    with pytest.raises(CudaDriverError, match="cuInit failed"):
        CudaDriver(FakeLib({"cuInit": 100}))


def test_driver_calls_run_in_the_devices_context_and_put_the_threads_back():
    lib = FakeLib(current=0xAA)  # another context is current on this thread
    driver = CudaDriver(lib)
    assert driver.granularity(0) == MIB2 and lib.current == 0xAA
    assert lib.calls[-4:] == ["cuCtxGetCurrent", "cuCtxSetCurrent", "cuMemGetAllocationGranularity",
                              "cuCtxSetCurrent"]
    lib.current = 0xC0  # the device's own context: nothing to swap
    lib.calls.clear()
    assert driver.create(MIB2, 0) == 77
    assert lib.calls == ["cuCtxGetCurrent", "cuMemCreate"]  # retained once, on the first call
    lib.current, lib.results = 0xAA, {"cuMemUnmap": 1}
    with pytest.raises(CudaDriverError):
        driver.unmap(0x1000, MIB2, 0)
    assert lib.current == 0xAA  # put back after a failure too


def test_the_memory_is_chosen_by_mode_and_device():
    assert vmm_unavailable("cpu") == "address-stable memory needs a CUDA device, got cpu"
    assert not stable_wanted("auto", "cpu") and not stable_wanted("off", "cpu")
    with pytest.raises(RuntimeError, match=r"asked for \(stable_memory='on'\) but address-stable memory needs a "
                                           r"CUDA device, got cpu"):
        stable_wanted("on", "cpu")
    with pytest.raises(ValueError, match=r"must be one of \('auto', 'on', 'off'\), got 'yes'"):
        stable_wanted("yes", "cpu")
    with pytest.raises(ValueError, match=r"KVConfig.stable_memory must be one of .*got 'yes'"):
        KVConfig(stable_memory="yes")
    with pytest.raises(RuntimeError, match="cannot allocate address-stable memory: .* got cpu"):
        StableBuffer(100, "cpu")


def test_a_plain_kv_cache_cannot_be_released():
    cfg = preset("tiny-moe")
    cache = PagedKVCache(cfg, 4, 16, cfg.num_query_groups)
    assert cache.memory is None and not cache.released
    with pytest.raises(RuntimeError, match="not address-stable"):
        cache.release()
    with pytest.raises(RuntimeError, match="cannot allocate address-stable memory"):
        PagedKVCache(cfg, 4, 16, cfg.num_query_groups, device="cpu", stable=True)


def test_the_fake_lib_writes_through_pointers():
    """The fakes above write where ctypes' `byref` points: what the real calls do."""
    lib, out = FakeLib(), ctypes.c_size_t()
    lib.cuMemGetAllocationGranularity(ctypes.byref(out), None, 0)
    assert out.value == MIB2


# -- GPU -----------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_a_stable_buffer_keeps_its_address_and_gives_its_memory_back():
    assert vmm_unavailable("cuda") is None, vmm_unavailable("cuda")
    nbytes = 1 << 30
    buffer = StableBuffer(nbytes + 3, "cuda")
    tensor = buffer.view(torch.float32, (nbytes // 4,))
    address = tensor.data_ptr()
    assert buffer.size >= nbytes + 3 and address == buffer.tensor.data_ptr()
    assert int(torch.count_nonzero(buffer.tensor)) == 0  # zero-filled, as torch.zeros
    tensor.fill_(3.0)
    torch.cuda.synchronize()
    free = torch.cuda.mem_get_info()[0]
    assert buffer.release() == buffer.size and buffer.release() == 0
    released = torch.cuda.mem_get_info()[0]
    assert released - free >= nbytes  # the driver has it back
    assert buffer.restore() == buffer.size and buffer.restore() == 0
    assert tensor.data_ptr() == address and buffer.tensor.data_ptr() == address
    assert released - torch.cuda.mem_get_info()[0] >= nbytes  # taken again
    assert int(torch.count_nonzero(tensor)) == 0  # new memory, zero-filled
    tensor[7] = 5.0
    assert float(tensor.sum()) == 5.0
    # a graph captured over the buffer replays into the restored memory
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tensor.add_(1.0)
    buffer.release()
    buffer.restore()
    graph.replay()
    assert float(tensor[:4].sum()) == 4.0
    buffer.close()
    with pytest.raises(RuntimeError, match="was closed"):
        buffer.restore()
