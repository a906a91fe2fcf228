"""Process-level NVSHMEM, and per-domain symmetric buffers allocated from it (paper §5).

NVSHMEM is initialised once per process, whichever phase needs it first; both phases' domains then
allocate their own symmetric buffers from that one runtime, so they share the initialisation and
the rank topology but no buffer, counter or workspace. Initialisation uses nvshmem4py's unique-id
method: rank 0 creates the id and it is broadcast over the CPU gloo group (no MPI needed).

Left out: NVSHMEM kernels (device-initiated transfers need a compiled backend; DeepEP brings its
own), teams, and sharing with DeepEP V1, which links and initialises its own NVSHMEM: a process
running DeepEP's low-latency buffer should not also initialise this one unless both resolve to
the same library. nvshmem4py is imported lazily; using this module without it fails with a hint.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

INSTALL_HINT = ("NVSHMEM symmetric buffers need nvshmem4py and cuda-core: pip install nvshmem4py-cu13 (or -cu12, "
                "matching your CUDA) cuda-core, with the NVSHMEM runtime (nvidia-nvshmem-cu13/-cu12)")


def require_nvshmem() -> tuple[ModuleType, ModuleType]:
    """(nvshmem.core, cuda.core), or ImportError with an install hint."""
    try:
        import cuda.core as cuda_core
        import nvshmem.core as nvshmem_core
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} (import failed: {exc})") from exc
    return nvshmem_core, cuda_core


@dataclass(frozen=True)
class NvshmemRuntime:
    """The process's NVSHMEM runtime: which PE this process is, of how many, on which device."""

    rank: int
    nranks: int
    device: torch.device


_RUNTIME: NvshmemRuntime | None = None


def init_nvshmem(cpu_group: dist.ProcessGroup | None, device: torch.device) -> NvshmemRuntime:
    """Initialise NVSHMEM for this process (collective over `cpu_group`; once per process: later
    calls return the same runtime if they agree with it)."""
    global _RUNTIME
    nv, cuda_core = require_nvshmem()
    device = torch.device(device)
    if device.type != "cuda" or device.index is None:
        raise ValueError(f"NVSHMEM needs an indexed CUDA device, got {device}")
    rank = dist.get_rank(cpu_group) if cpu_group is not None else 0
    nranks = dist.get_world_size(cpu_group) if cpu_group is not None else 1
    if _RUNTIME is not None:
        if (_RUNTIME.rank, _RUNTIME.nranks, _RUNTIME.device) != (rank, nranks, device):
            raise RuntimeError(f"NVSHMEM is already initialised in this process as {_RUNTIME}; it cannot be "
                               f"re-initialised as PE {rank} of {nranks} on {device}")
        return _RUNTIME
    cuda_dev = cuda_core.Device(device.index)
    cuda_dev.set_current()
    uid = nv.get_unique_id(empty=rank != 0)
    if nranks > 1:
        # The id is a small byte array; a CPU tensor sharing its memory is broadcast in place.
        raw = torch.from_numpy(uid._data.view("int8"))
        dist.broadcast(raw, src=dist.get_global_rank(cpu_group, 0), group=cpu_group)
    nv.init(device=cuda_dev, uid=uid, rank=rank, nranks=nranks, initializer_method="uid")
    _RUNTIME = NvshmemRuntime(rank, nranks, device)
    logger.info("NVSHMEM initialised: PE %d of %d on %s", rank, nranks, device)
    return _RUNTIME


def finalize_nvshmem() -> None:
    """Tear the process's runtime down (free every domain's buffers first)."""
    global _RUNTIME
    if _RUNTIME is not None:
        nv, _ = require_nvshmem()
        nv.finalize()
        _RUNTIME = None


class SymmetricBuffers:
    """One domain's symmetric tensors. Allocation and `free` are collective: every PE allocates
    the same names, shapes and dtypes in the same order."""

    def __init__(self, name: str, runtime: NvshmemRuntime) -> None:
        if _RUNTIME is None or runtime is not _RUNTIME:
            raise RuntimeError(f"{name}: symmetric buffers need the process's live NVSHMEM runtime "
                               f"(init_nvshmem first)")
        self.name, self.runtime = name, runtime
        self._tensors: dict[str, torch.Tensor] = {}

    def tensor(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if key in self._tensors:
            raise ValueError(f"{self.name}: symmetric buffer {key!r} already allocated")
        nv, _ = require_nvshmem()
        t = nv.tensor(shape, dtype=dtype)
        self._tensors[key] = t
        return t

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._tensors[key]

    def free(self) -> None:
        nv, _ = require_nvshmem()
        for t in self._tensors.values():
            nv.free_tensor(t)
        self._tensors.clear()
