"""The native inference/training model: Megatron `GPTModel`'s parameters, plain PyTorch forward.

Two forward paths share the parameters:
- `forward(input_ids)`: a right-padded batch `[B, T]` with autograd, for training and for the
  log-probabilities of given tokens;
- `step(tokens, positions, attn, phase)`: the incremental forward over the new tokens of several
  sequences, reading and writing the KV behind an `AttentionBackend`; a generator that yields at
  every safe boundary, which is what segmented prefill resumes between.
"""
from __future__ import annotations

import torch
from torch import nn

from megatron_rollout.comm.facade import Comm, LocalComm
from megatron_rollout.forward import Forward, run_to_end
from megatron_rollout.model.attention import AttentionBackend, CausalBatch
from megatron_rollout.model.config import ModelConfig
from megatron_rollout.model.layers import Linear, RMSNorm, TransformerLayer, linear
from megatron_rollout.model.ops import REFERENCE, ModelOps, UsesOps
from megatron_rollout.model.parts import layer_parts
from megatron_rollout.model.rope import rope_for
from megatron_rollout.types import Phase


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=cfg.torch_dtype, device=device)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm, device=None) -> None:
        super().__init__()
        parts = layer_parts(cfg)
        self.layers = nn.ModuleList(TransformerLayer(cfg, i, comm.shard, device, parts) for i in range(cfg.num_layers))
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.layernorm_epsilon, cfg.torch_dtype, device)


class MoETransformer(nn.Module):
    """Decoder-only transformer; this rank's shard of it when `comm` spans several ranks."""

    def __init__(self, cfg: ModelConfig, comm: Comm | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.comm = comm or LocalComm()
        self.embedding = Embedding(cfg, device)
        self.decoder = Decoder(cfg, self.comm, device)
        if not cfg.tie_word_embeddings:
            self.output_layer = Linear(cfg.hidden_size, cfg.vocab_size, cfg.torch_dtype, device)
        if cfg.mtp_num_layers:
            from megatron_rollout.model.mtp import MTPBlock

            self.mtp = MTPBlock(cfg, self.comm.shard, device)

    @property
    def device(self) -> torch.device:
        return self.embedding.word_embeddings.weight.device

    def init_weights(self, seed: int, std: float = 0.02) -> "MoETransformer":
        """Deterministic random init; every rank draws the full tensors and keeps its slice, so
        a sharded model equals the unsharded one built with the same seed."""
        from megatron_rollout.model.sharding import full_shapes, shard_tensor

        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, shape in full_shapes(self.cfg).items():
                if name.endswith("layernorm.weight"):
                    full = torch.ones(shape)
                else:
                    full = torch.randn(shape, generator=gen) * std
                param = self.get_parameter_or_none(name, self.comm)
                if param is not None:
                    param.copy_(shard_tensor(name, full, self.cfg, self.comm.shard))
        return self

    def get_parameter_or_none(self, full_name: str, comm: Comm) -> torch.Tensor | None:
        from megatron_rollout.model.sharding import local_name

        name = local_name(full_name, self.cfg, comm.shard)
        return None if name is None else self.get_parameter(name)

    def logits(self, h: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        """Output layer over `norm(h)` (the decoder's final norm unless an MTP layer gives its own)."""
        h = (norm or self.decoder.final_layernorm)(h)
        if self.cfg.tie_word_embeddings:
            return linear(h, self.embedding.word_embeddings.weight)
        return self.output_layer(h)

    def check_tokens(self, tokens: torch.Tensor) -> None:
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.cfg.vocab_size):
            bad = tokens[(tokens < 0) | (tokens >= self.cfg.vocab_size)][0].item()
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.cfg.vocab_size})")

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend, phase: Phase,
             logits_index: torch.Tensor | None = None) -> Forward:
        """Incremental forward. tokens, positions: [N]. Returns logits [N or len(logits_index), V]."""
        h = yield from self.hidden_step(tokens, positions, attn, phase)
        if logits_index is not None:
            h = h[logits_index]
        return self.logits(h)

    def hidden_step(self, tokens: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                    phase: Phase) -> Forward:
        """`step` up to the decoder's last hidden states [N, H], before the final norm (what MTP reads)."""
        h = self.embedding.word_embeddings(tokens)  # [N, H]
        rope = rope_for(self.cfg, positions, h.dtype)
        delta = None  # each layer's MLP output is added together with the next layer's first norm
        for layer in self.decoder.layers:
            h, delta = yield from layer.residual(h, delta, rope, attn, self.comm, phase)
        return h if delta is None else h + delta

    def mtp_step(self, next_tokens: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                 attn: AttentionBackend, phase: Phase) -> Forward:
        """The first MTP layer (its own KV layer) at `positions` [N]: `hidden` [N, H] the decoder's
        hidden state there (or the layer's own previous output, drafting in a chain), `next_tokens`
        [N] the token after each position. Returns the layer's output [N, H], before its final norm."""
        embedded = self.embedding.word_embeddings(next_tokens)
        rope = rope_for(self.cfg, positions, hidden.dtype)
        return (yield from self.mtp.layers[0](embedded, hidden, rope, attn, self.comm, phase))

    def use_ops(self, ops: ModelOps | None) -> int:
        """Point every module that calls the small ops (`model.ops.UsesOps`) at `ops`; None restores
        the reference. Returns how many modules now use it. The hook through which a kernel library
        (`kernels.fused`) is chosen: the forward code stays one."""
        users = [m for m in self.modules() if isinstance(m, UsesOps)]
        for module in users:
            if ops is None:
                module.__dict__.pop("ops", None)
            else:
                module.ops = ops
        return len(users)

    @property
    def ops(self) -> ModelOps:
        """The small ops this model's layers call (`use_ops`)."""
        first = next((m for m in self.modules() if isinstance(m, UsesOps)), None)
        return REFERENCE if first is None else first.ops

    def forward(self, input_ids: torch.Tensor, phase: Phase = Phase.P) -> torch.Tensor:
        """Full-sequence forward of a right-padded batch. input_ids: [B, T] -> logits [B, T, V]."""
        self.check_tokens(input_ids)
        b, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device).repeat(b)
        logits = run_to_end(self.step(input_ids.reshape(-1), positions, CausalBatch(b, t), phase))
        return logits.view(b, t, -1)

    def token_logprobs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """log p(input_ids[:, t+1] | input_ids[:, :t+1]) in fp32: [B, T-1]."""
        logp = self.forward(input_ids).float().log_softmax(-1)
        return logp[:, :-1].gather(-1, input_ids[:, 1:, None]).squeeze(-1)
