"""A Megatron trainer's routed experts, moved into the one stacked tensor per projection that the
rollout's expert kernels read, so that trainer and rollout share them.

The CUDA runner's expert paths (`torch._grouped_mm` in `Experts.grouped_offsets`, the Triton kernels
of `kernels.moe_triton`) read a layer's routed experts as two contiguous stacks, fc1 [E, 2F, H] and
fc2 [E, H, F] (`Experts.stacked`). Megatron-core (0.16 and 0.19) keeps them as E separate tensors per
projection: `local_experts.K.linear_fc{1,2}.weight` under the local spec (SequentialMLP), and
`linear_fc{1,2}.weightK` under the Transformer Engine spec (TEGroupedMLP's GroupedLinear), each its
own allocation. Of the two ways to read those in place, kernels that take a table of E pointers per
projection (a new grouped GEMM, replacing cuBLAS's) or one stack that both sides view, this module
does the second: `share_expert_stacks` copies each projection's E tensors into one stack once and
points every trainer `Parameter`'s `.data` at its slice. The Parameters stay the objects the
optimizer, Megatron's DDP wrapper and its fp32 main weights refer to (Megatron's optimizer writes
`param.data` in place at every step, read at each step, not kept), so an in-place optimizer step
writes the stack the rollout's decode graphs read; the E old tensors are freed (one projection's
worth of memory is held twice, briefly). Where a projection's experts already are such a stack (a
second engine over the same GPTModel) it is reused as it is.

Where a tensor shares its storage with other tensors and is not part of such a stack (Megatron's
distributed optimizer keeps every parameter inside one flat buffer, which its parameter all-gather
writes), moving it would detach the trainer from that buffer: `stack_obstacle` names the tensor, and
`weights.megatron_bridge` refuses to share (`share_storage=True`) or copies (`None`).
Left out: the local spec's GroupedMLP (`moe_grouped_gemm`: weight1 [H, E*2F], weight2 [E*F, H],
refused by name in `megatron_names`) and TE's single grouped weight (`moe_single_grouped_weight`).
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import torch

_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts)\.local_experts\.(\d+)\.linear_fc([12])\.weight$")


def projections(tensors: Mapping[str, torch.Tensor]) -> dict[tuple[str, int], list[torch.Tensor]]:
    """(experts module name, 1 or 2) -> that projection's tensors, local expert 0 first, from
    rollout-named tensors (`megatron_names.megatron_state_to_rollout`)."""
    found: dict[tuple[str, int], dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _EXPERT.match(name)
        if m:
            found.setdefault((m.group(1), int(m.group(3))), {})[int(m.group(2))] = t
    return {key: [by_k[k] for k in sorted(by_k)] for key, by_k in found.items()}


def existing_stack(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """The contiguous [E, *shape] tensor whose slices `ts` already are (in order), or None."""
    first = ts[0]
    n, ptr = first.numel(), first.untyped_storage().data_ptr()
    for k, t in enumerate(ts):
        if (not t.is_contiguous() or t.shape != first.shape or t.untyped_storage().data_ptr() != ptr
                or t.storage_offset() != first.storage_offset() + k * n):
            return None
    return first.detach().as_strided((len(ts), *first.shape), (n, *first.stride()), first.storage_offset())


def _owns_storage(t: torch.Tensor) -> bool:
    whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return whole and t.storage_offset() == 0 and t.is_contiguous()


def stack_obstacle(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """Why the experts among `tensors` can be neither stacked in place nor found stacked, or None."""
    for (module, fc), ts in projections(tensors).items():
        if existing_stack(ts) is not None:
            continue
        shared = next((k for k, t in enumerate(ts) if not _owns_storage(t)), None)
        if shared is not None:
            return (f"{module}.local_experts.{shared}.linear_fc{fc}.weight lies inside a storage it shares with "
                    "other tensors (Megatron's distributed optimizer's parameter buffer?) and its experts are not "
                    "one contiguous stack, which the rollout's grouped expert kernels read")
    return None


@torch.no_grad()
def share_expert_stacks(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Experts module name -> (fc1 [E, 2F, H], fc2 [E, H, F]) stacks that the trainer's expert
    `Parameter`s among `tensors` (rollout names, the trainer's own tensors) are views of from now on
    (module docstring). Check `stack_obstacle` first: this raises ValueError where it is not None."""
    why = stack_obstacle(tensors)
    if why is not None:
        raise ValueError(f"cannot stack the trainer's experts in place: {why}")
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for (module, fc), ts in projections(tensors).items():
        stack = existing_stack(ts)
        if stack is None:
            stack = torch.stack([t.detach() for t in ts])
            for k, t in enumerate(ts):
                t.data = stack[k]
        stacks.setdefault(module, {})[fc] = stack
    return {module: (fcs[1], fcs[2]) for module, fcs in stacks.items()}
