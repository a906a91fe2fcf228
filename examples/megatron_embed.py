"""The rollout engine inside a Megatron-core trainer: generate, sleep, train, wake, update, generate.

    python examples/megatron_embed.py

One process, a one-rank gloo world. The trainer is a Megatron-core `GPTModel` built from the
rollout model's `ModelConfig`, so both have the same parameter names and shapes and weights move
name for name, with no renaming. The rollout is built from the trainer's weights, generates,
sleeps while the trainer steps (its KV cache, graphs and weight copy handed back), wakes, takes
the new weights (a new version) and generates again.

On CPU, Megatron's GPTModel builds but its forward needs CUDA, so the training step here is an
optimizer step on a loss of the parameters alone (an L2 pull towards zero), not on a forward
over tokens: what matters for the rollout is that every parameter changed. In a real trainer the
loss is the policy-gradient loss of the trajectories just generated.
"""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

from megatron_rollout.engine import EngineConfig, RolloutEngine, SamplingParams
from megatron_rollout.model.config import PRESETS
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.weights.megatron_layout import transformer_config


def trainer_weights(gpt: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The GPTModel's weights under their Megatron names (`_extra_state` entries hold no weights)."""
    return {k: v for k, v in gpt.state_dict().items() if not k.endswith("._extra_state")}


def main() -> None:
    with socket.socket() as s:  # a one-process world on a free port (torchrun sets these for you)
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1, expert_tensor_parallel_size=1)

    cfg = PRESETS["tiny-moe"]
    tcfg = transformer_config(cfg)  # Megatron's TransformerConfig for the same architecture
    gpt = GPTModel(tcfg, get_gpt_decoder_block_spec(tcfg, use_transformer_engine=False, normalization="RMSNorm"),
                   vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
                   position_embedding_type="rope", rotary_base=int(cfg.rotary_base))

    rollout_model = MoETransformer(cfg)
    rollout_model.load_state_dict(trainer_weights(gpt), strict=True)  # same names, same shapes
    engine = RolloutEngine(rollout_model, EngineConfig())
    prompts, greedy = [[1, 2, 3], [4, 5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=6)
    before = engine.generate(prompts, greedy)

    engine.sleep()  # KV cache, graphs and the weight copy go to the trainer while it trains
    optimizer = torch.optim.SGD(gpt.parameters(), lr=0.1)
    loss = sum((p.float() ** 2).sum() for p in gpt.parameters())  # CPU stand-in for the RL loss (see above)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()

    engine.wake_up()
    engine.update_weights(trainer_weights(gpt), version=1)  # validated whole, then copied in place
    after = engine.generate(prompts, greedy)
    for b, a in zip(before, after):
        print(f"version {b.weight_version}: {b.token_ids}  ->  version {a.weight_version}: {a.token_ids}")

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
