"""The loop's Megatron side: a GPTModel trained by Megatron's optimizer, and the rollout engine built
from it in the same process (docs/design.md §10), selected by `trainer: megatron`.

`build_megatron_policy` makes, in this order: a one-process torch.distributed world and Megatron's
parallel_state (TP = EP = 1) unless they exist; the `GPTModel` of the preset's architecture on the
Transformer Engine layer spec where TE imports and a GPU is there (the local spec otherwise), given
the native model's seeded random init so that both trainers start from the same weights; Megatron's
`DistributedDataParallel` wrapper and `get_megatron_optimizer` (Adam, fp32 main weights for a bf16
model), or a torch AdamW over the parameters; the `MegatronTrainer`; and the engine,
`RolloutEngine.from_megatron(gpt)`. The engine reads the trainer's parameter storage (`weights: share`,
or `auto` where `megatron_bridge.sharing_obstacle` finds nothing: a bf16 model's fp32 norms are read
as they are, its routed experts moved into the stacks the CUDA runner's kernels and the trainer both
use), so an optimizer step is what the next rollout serves, decode graphs included; otherwise
(`weights: copy`, or `auto` where sharing cannot be, e.g. experts inside a distributed optimizer's
buffer) it holds a copy that the loop's `update_weights` refreshes every step. Either way the loop
calls `update_weights` with the trainer's tensors each step: a copy, or (shared) nothing but the
weight version moving (each tensor is the engine's own parameter: `WeightStore` neither checks nor
copies it), so the per-step `update_weights_s` of a shared run is the name checks alone.

Left out: several processes (data, tensor or expert parallel trainers: `rl.megatron_trainer` holds
the gather, the loop does not wire it), pipeline parallelism, learning-rate schedules, and
checkpoints.
"""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_rollout.engine import EngineConfig, RolloutEngine
from megatron_rollout.model import te_layers
from megatron_rollout.model.config import ModelConfig
from megatron_rollout.model.transformer import MoETransformer
from rl.fields import check_types
from rl.megatron_trainer import MegatronTrainer, build_gpt_model, load_weights
from rl.objective import LossConfig
from rl.trainer import TrainerConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MegatronOptions:
    """How the Megatron trainer and its engine are built (`GRPOConfig.megatron`, read only with
    `trainer: megatron`)."""

    spec: str = "auto"
    """Layer spec: auto (te where Transformer Engine imports and a GPU is there, else local) | te | local."""
    optimizer: str = "megatron"
    """megatron (`get_megatron_optimizer` over the model in Megatron's DDP wrapper; CUDA only) |
    torch (AdamW over the parameters; float32 only: it keeps no fp32 copy of bf16 weights)."""
    weights: str = "auto"
    """share (the engine reads the trainer's tensors; an error, with the reason, where it cannot) |
    copy (the engine's own copy, refreshed every step) | auto (share where it can, else copy)."""
    dtype: str = "bfloat16"
    """Parameter dtype of the trainer and the engine (the preset's dtype is replaced): bfloat16 |
    float32. The CUDA runner's decode graphs need bfloat16 experts."""

    def __post_init__(self) -> None:
        check_types(self)
        for name, allowed in (("spec", ("auto", "te", "local")), ("optimizer", ("megatron", "torch")),
                              ("weights", ("auto", "share", "copy")), ("dtype", ("bfloat16", "float32"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"megatron.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.optimizer == "torch" and self.dtype != "float32":
            raise ValueError(f"megatron.optimizer 'torch' steps the {self.dtype} parameters themselves (no fp32 "
                             "main weights): use optimizer 'megatron', or dtype 'float32'")


@dataclass
class MegatronPolicy:
    """What `build_megatron_policy` made."""

    trainer: MegatronTrainer
    engine: RolloutEngine
    spec: str
    """The layer spec built: te | local."""
    shared: bool
    """The engine's parameters are the trainer's tensors (no second copy)."""
    world: contextlib.ExitStack
    """Tears down the process group and parallel_state if they were made here (`close`)."""

    def close(self) -> None:
        self.world.close()


def megatron_world(device: torch.device, seed: int) -> contextlib.ExitStack:
    """torch.distributed on this one process (NCCL on CUDA, gloo on CPU) and parallel_state at
    TP = EP = 1, unless they exist; the stack undoes what was made here. Raises ValueError under a
    world of several processes."""
    from megatron.core import parallel_state as ps

    stack = contextlib.ExitStack()
    if not dist.is_initialized():
        store_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="grpo_megatron"))
        store = dist.FileStore(os.path.join(store_dir, "store"), 1)
        if device.type == "cuda":
            dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
        else:
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        stack.callback(dist.destroy_process_group)
    if dist.get_world_size() != 1:
        stack.close()
        raise ValueError(f"trainer 'megatron' runs in one process; this world has {dist.get_world_size()}: "
                         "launch one process (python examples/train_grpo.py, or torchrun --nproc-per-node 1)")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1, expert_tensor_parallel_size=1)
        stack.callback(ps.destroy_model_parallel)
    if device.type == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    return stack


def resolve_spec(spec: str, device: torch.device) -> str:
    """The layer spec to build: `auto` picks te where TE imports on a GPU; te elsewhere is an error
    with the install hint."""
    why = "Transformer Engine's layers need a CUDA device" if device.type != "cuda" else te_layers.te_missing()
    if spec == "auto":
        return "local" if why else "te"
    if spec == "te" and why:
        raise ValueError(f"megatron.spec 'te' cannot be built here: {why}; or set megatron.spec: local")
    return spec


def megatron_optimizer(gpt: torch.nn.Module, lr: float, betas: tuple[float, float], grad_clip: float | None):
    """Megatron's DDP wrapper and `get_megatron_optimizer` (Adam, no weight decay, clipping at
    `grad_clip`) over it: (wrapped model, optimizer)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    tc = gpt.config
    ddp = DistributedDataParallel(config=tc, module=gpt, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False))
    opt_cfg = OptimizerConfig(optimizer="adam", lr=lr, adam_beta1=betas[0], adam_beta2=betas[1], weight_decay=0.0,
                              bf16=tc.params_dtype == torch.bfloat16, params_dtype=tc.params_dtype,
                              clip_grad=grad_clip or 0.0)
    return ddp, get_megatron_optimizer(opt_cfg, [ddp])


def build_megatron_policy(model_cfg: ModelConfig, opts: MegatronOptions, engine_config: EngineConfig, *, seed: int,
                          lr: float, betas: tuple[float, float], loss: LossConfig, trainer: TrainerConfig,
                          device: str | torch.device | None = None) -> MegatronPolicy:
    """The trainer and the engine of `trainer: megatron` (module docstring). `device`: default the
    current CUDA device where there is one, else the CPU (where the model builds and the engine
    runs, but the training step cannot: Megatron's forward needs CUDA)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if opts.optimizer == "megatron" and device.type != "cuda":
        raise ValueError("megatron.optimizer 'megatron' needs CUDA (Megatron's DDP wrapper allocates its gradient "
                         "buffers on the GPU): run on a GPU, or set megatron.optimizer: torch and dtype: float32")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world = megatron_world(device, seed)
    try:
        spec = resolve_spec(opts.spec, device)
        cfg = model_cfg.replace(dtype=opts.dtype)
        gpt = build_gpt_model(cfg, spec).to(device)
        # The native trainer's seeded init, so that both trainers start from the same weights.
        load_weights(gpt, MoETransformer(cfg.replace(dtype="float32")).init_weights(seed).named_parameters(), cfg)
        if opts.optimizer == "megatron":
            model, optimizer = megatron_optimizer(gpt, lr, betas, trainer.grad_clip)
        else:
            model = gpt
            optimizer = torch.optim.AdamW(gpt.parameters(), lr=lr, betas=betas, weight_decay=0.0)
        policy = MegatronTrainer(model, optimizer, loss, cfg, spec=spec, cfg=trainer)
        engine, shared = _engine(gpt, engine_config, opts.weights)
    except BaseException:
        world.close()
        raise
    log.info("Megatron trainer: %s spec, %s optimizer, %s; engine %s the trainer's weights", spec, opts.optimizer,
             cfg.dtype, "shares" if shared else "copies")
    return MegatronPolicy(policy, engine, spec, shared, world)


def _engine(gpt: Any, config: EngineConfig, weights: str) -> tuple[RolloutEngine, bool]:
    share = {"share": True, "copy": False, "auto": None}[weights]  # None: share where it can (logs why not)
    engine = RolloutEngine.from_megatron(gpt, config, share_storage=share)
    return engine, engine.weights.shared
