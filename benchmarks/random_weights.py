"""Random model weights drawn on the device, the same ones wherever they are drawn: the benchmarks'
models (`random_model`) and the peer's copy of them inside vLLM (`benchmarks.vllm_peer.draw_into`)."""
from __future__ import annotations

from collections.abc import Iterator

import torch

from megatron_rollout.model.config import ModelConfig
from megatron_rollout.model.transformer import MoETransformer


def random_model(cfg: ModelConfig, device: torch.device, seed: int, std: float = 0.02) -> MoETransformer:
    """Random weights of standard deviation `std` (norms 1) drawn on the device (init_weights draws 8B
    values on CPU: too slow): `draw_weights`' tensors."""
    model = MoETransformer(cfg, device=device)
    with torch.no_grad():
        for (name, t), (own, p) in zip(draw_weights(cfg, device, seed, std), model.named_parameters(), strict=True):
            assert name == own, (name, own)
            p.copy_(t)
    return model.requires_grad_(False)


def draw_weights(cfg: ModelConfig, device: torch.device, seed: int, std: float = 0.02
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """The random model's full tensors by name, drawn one at a time in parameter order on `device`
    (the peer draws the same ones inside vLLM: `benchmarks.vllm_peer --drawn-weights`)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in MoETransformer(cfg, device="meta").named_parameters():
        t = torch.empty(p.shape, dtype=p.dtype, device=device)
        yield name, (t.fill_(1.0) if name.endswith("layernorm.weight") else t.normal_(0.0, std, generator=gen))
