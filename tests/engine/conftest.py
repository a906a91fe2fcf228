"""Shared fixtures of the engine tests: tiny random Hugging Face checkpoints loaded into the native
model, and an engine factory whose engines all pass `check_integrity()` at teardown."""
from __future__ import annotations

import pytest
import torch

from megatron_rollout.engine import EngineConfig, RolloutEngine
from megatron_rollout.model import checkpoint as ckpt

V = 96


def hf_config(family: str):
    import transformers

    common = dict(vocab_size=V, hidden_size=32, num_attention_heads=4, rms_norm_eps=1e-6, max_position_embeddings=128,
                  attn_implementation="eager", eos_token_id=None, bos_token_id=None, pad_token_id=0)
    if family == "qwen3_moe":  # every layer MoE: one mux boundary per layer on one process
        return transformers.Qwen3MoeConfig(**common, num_hidden_layers=2, num_key_value_heads=2, head_dim=8,
                                           intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                                           num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True)
    if family == "llama":
        return transformers.LlamaConfig(**common, num_hidden_layers=2, num_key_value_heads=1, intermediate_size=48)
    raise ValueError(family)


def randomise(model: torch.nn.Module, seed: int) -> None:
    """HF's 0.02-std init gives near-uniform logits, where greedy ties make token comparisons
    meaningless; larger weights give clear winners and decisive routing."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if "embed" in name else 0.2))


def build_hf(family: str, seed: int, path):
    """(HF model, native model loaded from its saved checkpoint)."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(family)).eval()
    randomise(hf, seed)
    hf.save_pretrained(path)
    return hf, ckpt.load_pretrained(path)


@pytest.fixture(scope="session")
def qwen(tmp_path_factory):
    return build_hf("qwen3_moe", 1, tmp_path_factory.mktemp("qwen3_moe"))


@pytest.fixture(scope="session")
def llama(tmp_path_factory):
    return build_hf("llama", 2, tmp_path_factory.mktemp("llama"))


@pytest.fixture
def make_engine():
    """make_engine(model, config) or make_engine(model, **EngineConfig fields) -> RolloutEngine; every
    engine made is checked at teardown (KV bookkeeping consistent, every block owned by a live sequence)."""
    made: list[RolloutEngine] = []

    def make(model, config: EngineConfig | None = None, **fields) -> RolloutEngine:
        engine = RolloutEngine(model, config or EngineConfig(**fields))
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.check_integrity()
