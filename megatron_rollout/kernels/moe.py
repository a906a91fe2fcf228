"""Routed experts on one rank with no host synchronisation: grouped GEMMs, CUDA-graph safe.

The portable exchange (`comm.exchange.compute_local`) sorts token/expert pairs with
`bincount(...).tolist()`: a host round trip per MoE layer, which forbids CUDA-graph capture and
stalls the host behind the GPU (so P could not be enqueued ahead of D). Here every step stays on
the device:

1. each (token, slot) pair gets its row in expert-sorted order, and each row its token, from
   `kernels.expert_sort` (Triton: one launch at decode sizes, three past them; torch's one-hot
   prefix sum or stable argsort where Triton does not run), all sync-free;
2. `Experts.grouped_offsets` runs the expert MLPs as two `torch._grouped_mm` calls over the stacked
   expert weights, with the cumulative counts as group offsets (never a Python loop over experts);
3. results return to pair order by index and are combined with the routing weights (with
   `kernels.fused` installed: one kernel for the gather, the weights and the sum, and one for the
   SwiGLU between the two grouped GEMMs, `Experts.activation`).

The rows reach expert order in one gather (each sorted row reads its token), not a gather into
pair order followed by a scatter: at 4,096 tokens the scatter was 2.4 of a 29 ms prefill.

`DeviceLocalComm` is `LocalComm` with this exchange; `install_device_exchange(model)` swaps it in
for a single-rank model (the CUDA runner does this). A multi-rank model keeps its `DistComm`: its
exchanges are sync-free when the comm consumes counts on the device (`CommConfig.counts`), and
`install_device_exchange` only stacks the experts so that they run as grouped GEMMs there
(`comm.exchange.compute_local_sync_free`). FP8 experts (`model.fp8.stack_experts_fp8`) run the Triton
kernels of `kernels.moe_triton` at every batch size, sync-free too. Left out: FP8 experts on a
multi-rank exchange, and capacity factors / token dropping. The expert sort is
`kernels.expert_sort`; the distributed exchanges use `comm.exchange.sorted_destinations`.
"""

from __future__ import annotations

import logging

import torch

from megatron_rollout.comm.exchange import ExpertExchange, compute_local
from megatron_rollout.comm.facade import LocalComm
from megatron_rollout.kernels import expert_sort
from megatron_rollout.model.fp8 import stacked_experts_fp8
from megatron_rollout.model.layers import Experts, MoELayer

log = logging.getLogger(__name__)

def routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts,
                   small: str = "grouped_mm", small_pairs: int = 0) -> torch.Tensor:
    """sum_k weights[n, k] * expert_{ids[n, k]}(x[n]) for a rank holding every expert. x: [N, H];
    ids, weights: [N, k]. Returns [N, H] in x's dtype. Stacked FP8 experts run `kernels.moe_triton`;
    stacked bf16 experts run grouped GEMMs, and batches of at most `small_pairs` pairs the `small`
    kernels ("triton": `kernels.moe_triton`; "grouped_mm": the grouped GEMM) unless the experts are
    on Transformer Engine (`model.te_layers`: its grouped GEMM at every size); unstacked experts the
    portable exchange (`compute_local`: host syncs)."""
    n, k = ids.shape
    if n == 0:
        return x.new_zeros(x.shape)
    fp8 = stacked_experts_fp8(experts)
    if fp8 is not None:
        return _routed_experts_fp8(x, ids, weights, experts, fp8)
    stacked = experts.stacked()
    if stacked is None:
        return compute_local(x, ids, weights, experts)
    if small == "triton" and n * k <= small_pairs and not _on_te(experts):
        from megatron_rollout.kernels.moe_triton import routed_experts_triton

        return routed_experts_triton(x, ids, weights, *stacked, experts.first, combine=_combine(experts))
    flat = ids.reshape(-1) - experts.first
    dest, source, _, offsets = expert_sort.layout(flat, experts.num_local, 1, div=k)  # source: each row's token
    xs = x.index_select(0, source)  # [P, H], expert-sorted: one gather, not a gather and a scatter
    ys = experts.grouped_offsets(xs, offsets)  # [P, H]
    combine = _combine(experts)  # `kernels.fused`: gather back, weigh and sum in one kernel
    if combine is not None:
        return combine(ys, dest.view(n, k), weights)
    y = ys.index_select(0, dest).view(n, k, -1)  # back to pair order
    return (y * weights.unsqueeze(-1).to(y.dtype)).sum(1)


FP8_LARGE_ROWS = 64
"""Mean (token, expert) rows per expert from which the FP8 kernels use `moe_triton.LARGE_TILES`."""


def _routed_experts_fp8(x, ids, weights, experts: Experts, fp8) -> torch.Tensor:
    """`routed_experts` over stacked FP8 expert weights: the Triton kernels at every batch size."""
    from megatron_rollout.kernels import moe_triton

    fc1, fc2 = fp8
    large = ids.numel() >= FP8_LARGE_ROWS * experts.num_local
    return moe_triton.routed_experts_triton(x, ids, weights, fc1, fc2, experts.first,
                                            moe_triton.LARGE_TILES if large else moe_triton.FP8_DECODE_TILES,
                                            combine=_combine(experts))


def _combine(experts: Experts):
    """The model ops' combine where it is a fused kernel (`ModelOps.fuses_combine`), else None (the
    expert GEMMs then weigh their rows themselves)."""
    return experts.ops.combine if experts.ops.fuses_combine else None


def _on_te(experts: Experts) -> bool:
    """`model.te_layers.apply_te` put these experts on TE's GroupedLinear (its `grouped_offsets`)."""
    return "te" in experts.__dict__


def expert_path(experts: Experts) -> str:
    """Which weights the device exchange runs: 'fp8' (stacked FP8), 'te' (Transformer Engine's
    GroupedLinear over the bf16 stack), 'bf16' (stacked), or 'portable' (per expert, with host syncs:
    not graph-safe)."""
    if stacked_experts_fp8(experts) is not None:
        return "fp8"
    if _on_te(experts) and experts.stacked() is not None:
        return "te"
    return "bf16" if experts.stacked() is not None else "portable"


class DeviceExchange(ExpertExchange):
    """Single-rank exchange: `routed_experts` (stacked experts sync-free, else the portable path).

    `small` / `small_pairs` pick the kernels of small batches (see `routed_experts`); the CUDA
    runner sets them from a measurement (`choose_small_kernels`)."""

    def __init__(self, small: str = "grouped_mm", small_pairs: int = 4096) -> None:
        self.small, self.small_pairs = small, small_pairs

    def run(self, x, ids, weights, experts, layer):
        return routed_experts(x, ids, weights, experts, self.small, self.small_pairs)
        yield  # a generator with no boundary: nothing crosses ranks


class DeviceLocalComm(LocalComm):
    """`LocalComm` whose exchange never synchronises with the host."""

    def __init__(self) -> None:
        super().__init__()
        self.device_exchange = DeviceExchange()
        self._exchange = self.device_exchange


TRITON_MARGIN = 0.9
"""The Triton small-batch experts are chosen only when they take at most this fraction of the
grouped GEMM's time: near a tie the choice would flip from one measurement to the next."""

HOLD_CYCLES = 40_000_000
"""GPU cycles (~20 ms) a spin kernel holds the stream before each timed round of the choice, so that
the host has queued the round's launches when its start event runs. Without it the eager timing
measured the host's launch rate as well: the same kernels took 0.45-0.53 ms on one machine and
0.85 ms on another (fifth lease), where the grouped GEMM was then chosen and decode steps were
~1 ms slower than on the machine that chose Triton (docs/kernels.md; across machines)."""

_CHOSEN: dict[tuple, dict] = {}
"""Choices made in this process, by device and shapes: every engine built on the same model shape
runs the same expert kernels, so their tokens agree (the two paths round differently, and two
engines of one job compared at temperature 0 must not differ by a timing coin flip)."""


def choose_small_kernels(model: torch.nn.Module, rows: int = 64) -> dict:
    """Time the Triton and grouped-GEMM expert paths on a decode-sized batch of the first MoE
    layer (device time: `HOLD_CYCLES`) and keep the faster for small batches (Triton only when
    clearly faster: `TRITON_MARGIN`).
    The first choice for a device and shape holds for the rest of the process. Returns the timings
    (ms) and the choice."""
    comm = getattr(model, "comm", None)
    layer = next((m for m in model.modules() if isinstance(m, MoELayer)), None)
    if not isinstance(comm, DeviceLocalComm) or layer is None or layer.experts.stacked() is None:
        return {"choice": "none"}
    from megatron_rollout.kernels import moe_triton

    fc1, fc2 = layer.experts.stacked()
    cfg_h, ffn = fc1.shape[2], fc2.shape[2]
    if not moe_triton.supported(cfg_h, ffn):
        return {"choice": "grouped_mm", "reason": f"hidden {cfg_h} / ffn {ffn} not tileable"}
    key = (str(fc1.device), torch.cuda.get_device_name(fc1.device), tuple(fc1.shape), tuple(fc2.shape),
           layer.router.topk, rows, layer.experts.ops.name)
    if key in _CHOSEN:
        comm.device_exchange.small = _CHOSEN[key]["choice"]
        return {**_CHOSEN[key], "reused": True}
    x = torch.randn(rows, cfg_h, device=layer.experts.stacked()[0].device, dtype=layer.experts.stacked()[0].dtype)
    names = ("grouped_mm", "triton")
    with torch.no_grad():
        w, ids = layer.router(x)
        outs = {n: routed_experts(x, ids, w, layer.experts, n, 1 << 30) for n in names}  # compiles Triton
        samples: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(5):  # interleaved rounds: clock ramp-up and noise hit both alike
            for name in names:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(HOLD_CYCLES)  # the launches queue behind it: the events time the GPU alone
                start.record()
                for _ in range(5):
                    routed_experts(x, ids, w, layer.experts, name, 1 << 30)
                end.record()
                end.synchronize()
                samples[name].append(start.elapsed_time(end) / 5)
        timings = {n: sorted(v)[len(v) // 2] for n, v in samples.items()}  # median of the rounds
    ref = outs["grouped_mm"].float()
    err = float((outs["triton"].float() - ref).norm() / ref.norm().clamp_min(1e-12))
    choice = "triton" if err < 2e-2 and timings["triton"] <= TRITON_MARGIN * timings["grouped_mm"] else "grouped_mm"
    comm.device_exchange.small = choice
    log.info("small-batch experts: %s (grouped_mm %.3f ms, triton %.3f ms, rel err %.1e)", choice,
             timings["grouped_mm"], timings["triton"], err)
    _CHOSEN[key] = {"choice": choice, "ms": timings, "triton_rel_err": err, "rows": rows}
    return dict(_CHOSEN[key])


def install_device_exchange(model: torch.nn.Module) -> bool:
    """Stack every MoE layer's expert weights; give a single-rank model the device exchange.

    Returns True when every MoE layer can run sync-free (stacked bf16 weights, on TE or not, or stacked FP8),
    which is what CUDA-graph capture of a forward needs. A multi-rank model keeps its comm (its exchanges
    cross ranks); it is graph-safe when that comm consumes the exchanged counts on the device
    (`DistComm.sync_free`), else False: its exchanges read counts on the host."""
    comm = getattr(model, "comm", None)
    single = type(comm) is LocalComm or isinstance(comm, DeviceLocalComm)
    if not single and not getattr(comm, "sync_free", False):
        log.info("model comm is %s and reads exchanged counts on the host: decode cannot be captured "
                 "(CommConfig.counts='device' makes it sync-free)", type(comm).__name__)
    ok = True
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.experts.restack()
            path = expert_path(module.experts)  # FP8 experts: single-rank exchange only
            ok = ok and (path in ("bf16", "te") or (path == "fp8" and single))
    if single and not isinstance(comm, DeviceLocalComm):
        model.comm = DeviceLocalComm()
    layer = next((m for m in model.modules() if isinstance(m, MoELayer)), None)
    device = next(layer.experts.parameters()).device if layer is not None else None
    if device is not None and device.type == "cuda":  # the Triton expert sort, checked once per device
        expert_sort.self_check(device, layer.experts.num_local, layer.router.topk)
    return ok and (single or bool(getattr(comm, "sync_free", False)))
