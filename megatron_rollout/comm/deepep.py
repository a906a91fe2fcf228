"""DeepEP dispatch domains: a normal-mode `deep_ep.Buffer` for P, a low-latency one for D.

Why: on NVLink/RDMA GPUs DeepEP's dispatch/combine kernels beat NCCL all-to-all, and its two
modes fit the two phases: normal mode (exact counts, host reads them) for P's large batches,
low-latency mode (static shapes, graph-capturable, two receive buffers) for D's decode steps.

Phase isolation: each domain owns its *own* Buffer object (own NVLink/RDMA buffers, counters,
workspaces and comm stream), so P's normal dispatch and D's low-latency dispatch never take turns
on one buffer, and the mode-switch clean-up `clean_low_latency_buffer` (needed when one Buffer
serves both modes) is never called. What DeepEP V1 still shares between the two objects:
- NVSHMEM is a process-level runtime. The low-latency Buffer initialises it (rank 0's unique id,
  gathered over the domain's group). An intranode normal Buffer does not use NVSHMEM, so P + D in
  one node need one init; an internode normal Buffer would initialise NVSHMEM a second time, which
  DeepEP V1 does not support within one process (the paper's patched runtime shares one init).
- `Buffer.num_sms` is a class attribute: both phases' normal kernels get one SM budget.
- RDMA queue pairs: the low-latency Buffer takes `num_qps_per_rank` = local experts per peer; an
  internode normal Buffer would draw from the same NIC without disjoint QP ranges.

The split boundary: V1's `dispatch` runs its own notify (count exchange, host wait) inside the
call, so it exposes no boundary between counts and data. The domain keeps the base class's small
count + sequence exchange (on its NCCL group) as the notify before the boundary; DeepEP then
repeats its internal count exchange at dispatch (a few KB). A DeepEP build with a split notify
would drop that repetition in `_dispatch`.

Not runnable here: DeepEP needs 2-8 NVLink GPUs and bfloat16 activations; `deep_ep` is imported
lazily, and asking for this backend without it fails with an install hint (`require_deep_ep`).
Written against DeepEP V1's documented API (Buffer, get_dispatch_layout, dispatch/combine,
low_latency_dispatch/combine, get_low_latency_rdma_size_hint, Config size hints).
"""
from __future__ import annotations

import logging
from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from megatron_rollout.comm.domain import DispatchDomain, Handle, Layout, PendingDispatch, Received, RecvMeta

if TYPE_CHECKING:
    from megatron_rollout.forward import Experts

logger = logging.getLogger(__name__)

INSTALL_HINT = ("CommConfig(backend='deepep') needs DeepEP with its V1 API (deep_ep.Buffer): build it from "
                "https://github.com/deepseek-ai/DeepEP (needs NVSHMEM) or install a prebuilt wheel matching your "
                "torch and CUDA; it runs on 2-8 NVLink GPUs. Without it, use CommConfig(backend='alltoall').")


def require_deep_ep() -> ModuleType:
    """The `deep_ep` module, or ImportError with an install hint."""
    try:
        import deep_ep
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} (import deep_ep failed: {exc})") from exc
    if not hasattr(deep_ep, "Buffer"):
        raise ImportError(f"{INSTALL_HINT} (the installed deep_ep has no Buffer: not the V1 API)")
    return deep_ep


class _DeepEPDomain(DispatchDomain):
    def __init__(self, name: str, group: dist.ProcessGroup, device: torch.device, timeout_s: float,
                 max_tokens: int) -> None:
        self._deep_ep = require_deep_ep()
        if torch.device(device).type != "cuda":
            raise ValueError(f"{name}: DeepEP runs on CUDA devices only (got {device}); use backend='alltoall'")
        super().__init__(name, group, device, timeout_s)
        self.max_tokens = max_tokens
        self._buffer: Any = None  # deep_ep.Buffer, made at the first dispatch (sizes depend on hidden)

    def _check_inputs(self, x: torch.Tensor) -> None:
        if x.dtype != torch.bfloat16:
            raise ValueError(f"{self.name}: DeepEP moves bfloat16 activations, got {x.dtype}; run the model in "
                             f"bfloat16 or use backend='alltoall'")

    def _local_ids(self, num_experts: int) -> int:
        return self.ep_rank * (num_experts // self.ep_size)


class DeepEPNormalDomain(_DeepEPDomain):
    """P's domain: DeepEP normal (high-throughput) dispatch and combine."""

    max_outstanding = 1

    def _buffer_for(self, hidden_bytes: int) -> Any:
        if self._buffer is None:
            buffer_cls, n = self._deep_ep.Buffer, self.ep_size
            configs = (buffer_cls.get_dispatch_config(n), buffer_cls.get_combine_config(n))
            nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, n) for c in configs)
            rdma = max(c.get_rdma_buffer_size_hint(hidden_bytes, n) for c in configs)
            self._buffer = buffer_cls(self.group, nvl, rdma)  # collective over the EP group
            logger.info("%s: DeepEP normal buffer, %d NVL bytes, %d RDMA bytes", self.name, nvl, rdma)
        return self._buffer

    def _dispatch(self, pending: PendingDispatch, header: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> tuple[torch.Tensor, RecvMeta, Any]:
        buffer = self._buffer_for(x.shape[1] * x.element_size())
        ids = topk_ids.long()
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, pending.layout.num_experts)
        recv_x, recv_ids, recv_weights, per_local_expert, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=ids, topk_weights=topk_weights.float())
        # DeepEP returns *local* expert ids (-1: another rank's expert); the model's Experts take global ones.
        first = self._local_ids(pending.layout.num_experts)
        global_ids = torch.where(recv_ids >= 0, recv_ids + first, torch.full_like(recv_ids, -1))
        meta = RecvMeta(global_ids, recv_weights.to(x.dtype), header[:, 1], torch.tensor(per_local_expert))
        return recv_x, meta, handle

    def _combine(self, handle: Handle, y: torch.Tensor) -> torch.Tensor:
        out, _, _ = self._buffer.combine(y, handle.state)  # sums unweighted: weights applied in compute
        return out


class _LowLatencyState(NamedTuple):
    deep_ep_handle: tuple
    topk_ids: torch.Tensor  # [N, k] int64, for the weighted combine
    topk_weights: torch.Tensor  # [N, k] float32


class DeepEPLowLatencyDomain(_DeepEPDomain):
    """D's domain: DeepEP low-latency dispatch (expert-major receive, static shapes, two buffers)."""

    max_outstanding = 2  # DeepEP keeps two low-latency receive buffers

    def _check_layout(self, layout: Layout) -> None:
        if layout.num_tokens > self.max_tokens:
            raise ValueError(f"{self.name}: {layout.num_tokens} tokens exceed the low-latency capacity of "
                             f"{self.max_tokens} per rank; raise CommConfig.d_max_tokens")

    def _buffer_for(self, hidden: int, num_experts: int) -> Any:
        if self._buffer is None:
            buffer_cls = self._deep_ep.Buffer
            rdma = buffer_cls.get_low_latency_rdma_size_hint(self.max_tokens, hidden, self.ep_size, num_experts)
            self._buffer = buffer_cls(self.group, 0, rdma, low_latency_mode=True,
                                      num_qps_per_rank=num_experts // self.ep_size)
            logger.info("%s: DeepEP low-latency buffer, %d RDMA bytes", self.name, rdma)
        return self._buffer

    def _dispatch(self, pending: PendingDispatch, header: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> tuple[torch.Tensor, RecvMeta, Any]:
        num_experts = pending.layout.num_experts
        buffer = self._buffer_for(x.shape[1], num_experts)
        ids = topk_ids.long()
        recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, ids, self.max_tokens, num_experts,
                                                                       use_fp8=False)
        meta = RecvMeta(None, None, header[:, 1], recv_count)  # recv_x: [local experts, ep * max_tokens, H]
        return recv_x, meta, _LowLatencyState(handle, ids, topk_weights.float())

    def compute(self, received: Received, experts: "Experts") -> torch.Tensor:
        """Every local expert on all its slots (static shapes; slots past its count are ignored by
        combine), unweighted: the low-latency combine applies the weights."""
        x = received.x
        return torch.stack([experts.local_experts[k](x[k]) for k in range(experts.num_local)])

    def _combine(self, handle: Handle, y: torch.Tensor) -> torch.Tensor:
        state: _LowLatencyState = handle.state
        out, _, _ = self._buffer.low_latency_combine(y, state.topk_ids, state.topk_weights, state.deep_ep_handle)
        return out
