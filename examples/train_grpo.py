"""Colocated GRPO on CPU: rollout engine and trainer in one process, weights hot-swapped each step.

    python examples/train_grpo.py --config configs/grpo_tiny_cpu.yaml --steps 30 --out /tmp/run
    torchrun --nproc_per_node 2 examples/train_grpo.py --config configs/grpo_tiny_cpu.yaml --out /tmp/run2

What was simplified, and why:
- The policy is the tiny byte-level MoE from a random init, and the task rewards digits in the
  output: a signal a random model finds, so learning shows within minutes on a CPU.
- The trainer is the native model (a Megatron GPTModel trains only on GPU; see rl.megatron_trainer).
- Rollout and training alternate synchronously (fully on-policy); no async/off-policy overlap.
- Under torchrun each rank samples its own prompts and gradients are averaged (data parallel);
  the engine is not sharded across ranks.
"""
import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from rl.loop import GRPOConfig, run_grpo

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--config", required=True)
parser.add_argument("--steps", type=int)
parser.add_argument("--out")
parser.add_argument("--schedule", choices=["off", "chunked", "mux"])
args = parser.parse_args()

torch.set_num_threads(1)
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    dist.init_process_group("gloo")
rank = dist.get_rank() if dist.is_initialized() else 0

cfg = GRPOConfig.from_yaml(args.config, steps=args.steps)
if args.schedule:
    cfg = dataclasses.replace(cfg, engine={**cfg.engine, "schedule": args.schedule})

bar = tqdm(total=cfg.steps, disable=rank != 0, desc=f"GRPO {cfg.env}")
def show(m):
    bar.set_postfix(reward=f"{m['reward_mean']:.3f}", kl=f"{m.get('kl', 0):.4f}", tok_s=f"{m['tokens_per_s']:.0f}")
    bar.update()

start = time.perf_counter()
history = run_grpo(cfg, args.out, on_step=show)
bar.close()
if rank == 0:
    first = sum(m["reward_mean"] for m in history[:5]) / len(history[:5])
    last = sum(m["reward_mean"] for m in history[-5:]) / len(history[-5:])
    print(f"reward first-5 {first:.3f} -> last-5 {last:.3f} | {len(history)} steps in "
          f"{time.perf_counter() - start:.1f}s | weight version {history[-1]['weight_version']}"
          + (f" | outputs in {args.out}" if args.out else ""))
if dist.is_initialized():
    dist.destroy_process_group()
