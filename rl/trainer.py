"""The trainer side of colocated RL: log-probabilities, the loss, an optimizer step, and the
named weights the rollout engine hot-swaps in.

`PolicyTrainer` holds everything that does not depend on the model class; a subclass says how to
get logits from a right-padded batch and how to name its weights. `NativeTrainer` trains the
native `MoETransformer` (CPU or GPU); `MegatronTrainer` (in `rl.megatron_trainer`) trains a
Megatron-core `GPTModel`. A step computes, without gradients, the trainer's log-probabilities under
the weights the rollout used ("old") and the reference model's; then for each PPO epoch and
minibatch, a forward, the loss, backward, a gradient all-reduce over the data-parallel group
(each rank trains on its own rollouts), clipping, and the optimizer step.

`zero_grad` and `apply_grads` are the optimizer's protocol: a torch optimizer here, Megatron's
(gradient buffers of its DDP wrapper, clipping inside its step) in `MegatronTrainer`.

Left out: gradient accumulation across micro-batches, mixed precision in the native trainer, and
sharded optimizers (Megatron's distributed optimizer).
"""
from __future__ import annotations

import abc
import copy
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from rl.fields import check_types
from rl.objective import LossConfig, entropy_from_logits, policy_loss
from rl.trajectory import TrajectoryBatch

log = logging.getLogger(__name__)


TRAINER_KINDS = ("native", "megatron")


@dataclass(frozen=True)
class TrainerConfig:
    kind: str = "native"
    """native (`NativeTrainer`: the native model, CPU or GPU) | megatron (`MegatronTrainer`: a
    Megatron-core GPTModel, its training step on CUDA; built from `GRPOConfig.megatron`)."""
    num_minibatches: int = 1
    """Optimizer steps per epoch over the rollout batch; > 1 makes the ratio (and clipping) live."""
    ppo_epochs: int = 1
    """Passes over the rollout batch."""
    grad_clip: float | None = 1.0
    """Max global gradient norm; None disables clipping."""

    def __post_init__(self) -> None:
        check_types(self)
        if self.kind not in TRAINER_KINDS:
            raise ValueError(f"trainer.kind must be one of {TRAINER_KINDS}, got {self.kind!r}")
        if self.num_minibatches < 1 or self.ppo_epochs < 1:
            raise ValueError(f"num_minibatches and ppo_epochs must be >= 1, got {self.num_minibatches}, "
                             f"{self.ppo_epochs}")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(f"grad_clip must be positive or None, got {self.grad_clip}")


def token_logprobs_and_entropy(logits: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, T, V], input_ids [B, T] -> log p(input_ids[:, t+1]) and the entropy of the
    distribution at t, both fp32 [B, T-1] (the same arithmetic as `MoETransformer.token_logprobs`)."""
    logp = logits.float().log_softmax(-1)[:, :-1]
    return logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1), entropy_from_logits(logits[:, :-1])


def all_reduce_grads(params: list[nn.Parameter], group: dist.ProcessGroup | None = None) -> None:
    """Average gradients over the group in one flat collective; a parameter with no gradient on
    this rank (an expert no token was routed to) contributes zeros, so buffers match on all ranks."""
    world = dist.get_world_size(group)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= world
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).clone()
        offset += n


class PolicyTrainer(abc.ABC):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_cfg: LossConfig,
                 cfg: TrainerConfig = TrainerConfig(), ref_model: nn.Module | None = None,
                 process_group: dist.ProcessGroup | None = None) -> None:
        self.model, self.optimizer, self.loss_cfg, self.cfg = model, optimizer, loss_cfg, cfg
        if ref_model is None and loss_cfg.kl_coef > 0:
            ref_model = copy.deepcopy(model)
        self.ref_model = ref_model.eval().requires_grad_(False) if ref_model is not None else None
        self.process_group = process_group
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1
        self.params = [p for p in model.parameters() if p.requires_grad]

    @abc.abstractmethod
    def logits(self, model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] right-padded ids -> [B, T, V] logits of a causal forward."""

    @abc.abstractmethod
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(full Megatron name, tensor) for every weight, as `engine.update_weights` takes them."""

    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, model: nn.Module | None = None) -> torch.Tensor:
        """fp32 [B, T-1] log-probabilities of the given tokens under `model` (default: the policy)."""
        return token_logprobs_and_entropy(self.logits(model or self.model, input_ids), input_ids)[0]

    def train_step(self, batch: TrajectoryBatch | None, advantages: torch.Tensor | None) -> dict[str, float]:
        """PPO epochs x minibatches of optimizer steps on one rollout batch. `batch` None (nothing
        to train on locally) still joins every gradient all-reduce with zeros. Returns the mean
        of each loss metric over minibatches, plus grad_norm."""
        if batch is not None and (advantages is None or advantages.shape != (batch.size,)):
            raise ValueError(f"advantages must have shape ({batch.size},), got "
                             f"{None if advantages is None else tuple(advantages.shape)}")
        old = ref = None
        if batch is not None:
            old = self.logprobs(batch.input_ids)
            if self.ref_model is not None:
                ref = self.logprobs(batch.input_ids, self.ref_model)
        self.model.train()
        totals: dict[str, float] = {}
        count = 0
        for epoch in range(self.cfg.ppo_epochs):
            rows = torch.randperm(batch.size) if batch is not None and epoch > 0 else \
                torch.arange(batch.size if batch is not None else 0)
            for part in rows.tensor_split(self.cfg.num_minibatches):
                metrics = self._minibatch(batch, advantages, old, ref, part)
                if metrics:
                    for k, v in metrics.items():
                        totals[k] = totals.get(k, 0.0) + v
                    count += 1
        return {k: v / count for k, v in totals.items()} if count else {}

    def _minibatch(self, batch: TrajectoryBatch | None, advantages: torch.Tensor | None, old: torch.Tensor | None,
                   ref: torch.Tensor | None, rows: torch.Tensor) -> dict[str, float]:
        self.zero_grad()
        metrics: dict[str, float] = {}
        if batch is not None and rows.numel():
            mb = batch.select(rows)
            t = mb.loss_mask.shape[1]
            logp, ent = token_logprobs_and_entropy(self.logits(self.model, mb.input_ids), mb.input_ids)
            out = policy_loss(self.loss_cfg, logp, advantages[rows], mb.loss_mask,
                              old_logprobs=old[rows, :t], rollout_logprobs=mb.rollout_logprobs,
                              ref_logprobs=ref[rows, :t] if ref is not None else None,
                              entropy=ent if self.loss_cfg.entropy_coef else ent.detach())
            out.loss.backward()
            metrics = out.metrics
        norm = self.apply_grads()
        if metrics and norm is not None:
            metrics["grad_norm"] = norm
        return metrics

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def apply_grads(self) -> float | None:
        """Average gradients over the data-parallel group, clip, step; the gradient norm before
        clipping (None when not clipped)."""
        if self.distributed:
            all_reduce_grads(self.params, self.process_group)
        norm = None
        if self.cfg.grad_clip is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip))
        self.optimizer.step()
        return norm


class NativeTrainer(PolicyTrainer):
    """Trains the native `MoETransformer`, whose parameter names are already Megatron's full names
    (single-rank model: no expert renumbering, no tensor-parallel slices)."""

    def logits(self, model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        comm = getattr(self.model, "comm", None)
        if comm is not None and (comm.shard.atp_size > 1 or comm.shard.ep_size > 1):
            raise NotImplementedError("named_weights of a sharded native model needs a gather to full tensors")
        for name, p in self.model.named_parameters():
            yield name, p.detach()
