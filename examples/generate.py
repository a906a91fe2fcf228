"""Batched generation: several prompts in one call, greedy and sampled, with log-probabilities.

    python examples/generate.py                      # the embedded tiny-moe (random weights), CPU
    python examples/generate.py --model /path/to/hf  # a Qwen3(-MoE), Llama, Mixtral or DeepSeek-V3 checkpoint

Prompts are token ids: the engine has no tokenizer (a trainer brings its own). Every prompt of a
`generate` call runs in the same batches; the results come back in prompt order.
"""
from __future__ import annotations

import argparse
import math

from megatron_rollout.engine import EngineConfig, RolloutEngine, SamplingParams
from megatron_rollout.model.checkpoint import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-moe", help="preset name or Hugging Face checkpoint directory")
    ap.add_argument("--prompts", type=int, default=4, help="number of prompts in the batch")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    args = ap.parse_args()

    engine = RolloutEngine(load_model(args.model), EngineConfig())
    prompts = [[1 + i, 2 + i, 3 + i, 4 + i] for i in range(args.prompts)]

    # Greedy (temperature 0): the same tokens every run.
    greedy = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens))
    # Sampled, one SamplingParams per prompt: a per-request seed makes each reproducible on its own.
    sampled = engine.generate(prompts, [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=i,
                                                       max_new_tokens=args.max_new_tokens)
                                        for i in range(len(prompts))])

    for prompt, g, s in zip(prompts, greedy, sampled):
        # logprobs[i] is the fp32 log-probability of token_ids[i] under the distribution it was
        # drawn from: the number a PPO/GRPO ratio needs as the behaviour policy's.
        print(f"prompt {prompt}")
        print(f"  greedy  {g.token_ids}  ({g.finish_reason.value}, weight version {g.weight_version})")
        print(f"  sampled {s.token_ids}  sum logprob {sum(s.logprobs):.3f}  "
              f"mean p {math.exp(sum(s.logprobs) / len(s.logprobs)):.3f}")
    print(f"{engine.stats.steps} engine steps, {engine.stats.decode_tokens} decoded tokens")


if __name__ == "__main__":
    main()
