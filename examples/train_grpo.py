"""Colocated GRPO: rollout engine and trainer in one process, weights hot-swapped each step.

    python examples/train_grpo.py --config configs/grpo_tool_cpu.yaml --out /tmp/tool
    torchrun --nproc_per_node 4 examples/train_grpo.py --config configs/grpo_tool_cpu.yaml --atp 2 --adp 2 --ep 4 \\
        --out /tmp/tool4
    python examples/train_grpo.py --config configs/grpo_tiny_cpu.yaml --steps 30 --out /tmp/smoke   # quick smoke
    python examples/train_grpo.py --config configs/grpo_megatron_gpu.yaml --out /tmp/gpu   # one GPU, Megatron

What was simplified, and why:
- The policy is the tiny byte-level MoE from a random init; the tool task (`lookup`: call a tool,
  copy the code it returns into the answer) is one it can learn on a CPU in minutes and cannot
  game (ignoring the tool's reply scores at most 0.1). `digits` is the quick smoke task.
- The trainer is the native model, or (`trainer: megatron`, one GPU) a Megatron-core GPTModel
  trained by Megatron's optimizer with the engine built from it (rl.megatron_policy).
- Rollout and training alternate synchronously (fully on-policy); no async/off-policy overlap.
- Under torchrun, `--atp/--adp` (ATP x ADP = processes) shard the rollout engine (mux schedule,
  experts over EP = all ranks) while every rank trains a data-parallel replica of the unsharded
  model; `update_weights` reshards the trainer's full tensors every step. Without them every rank
  is a full engine and trainer replica.
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
from rl.placement import Placement

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--config", required=True)
parser.add_argument("--steps", type=int)
parser.add_argument("--out", help="output directory (metrics.jsonl, reward.png); default runs/<config name>-<time>")
parser.add_argument("--overwrite", action="store_true", help="replace an existing OUT/metrics.jsonl")
parser.add_argument("--schedule", choices=["off", "chunked", "mux"])
parser.add_argument("--atp", type=int, help="rollout attention tensor parallel size (config key atp)")
parser.add_argument("--adp", type=int, help="rollout attention data parallel replicas (config key adp)")
parser.add_argument("--ep", type=int, help="rollout expert parallel size, = atp x adp (config key ep)")
args = parser.parse_args()

torch.set_num_threads(1)
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    dist.init_process_group("gloo")
rank = dist.get_rank() if dist.is_initialized() else 0

try:
    cfg = GRPOConfig.from_yaml(args.config, steps=args.steps, atp=args.atp, adp=args.adp, ep=args.ep)
    Placement.check_world(cfg.atp, cfg.adp, dist.get_world_size() if dist.is_initialized() else 1)
except (ValueError, TypeError, FileNotFoundError) as exc:
    sys.exit(f"{args.config}: {exc}")
out = args.out or f"runs/{Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
if args.schedule:
    scheduler = {**cfg.engine.get("scheduler", {}), "schedule": args.schedule}
    cfg = dataclasses.replace(cfg, engine={**cfg.engine, "scheduler": scheduler})

bar = tqdm(total=cfg.steps, disable=rank != 0, desc=f"GRPO {cfg.env}")
def show(m):
    bar.set_postfix(reward=f"{m['reward_mean']:.3f}", kl=f"{m['kl'] or 0:.3f}", turns=f"{m['turns_mean']:.1f}")
    bar.update()

start = time.perf_counter()
try:
    history = run_grpo(cfg, out, on_step=show, overwrite=args.overwrite)
except FileExistsError as exc:
    sys.exit(str(exc))
bar.close()
if rank == 0:
    first = sum(m["reward_mean"] for m in history[:5]) / len(history[:5])
    last = sum(m["reward_mean"] for m in history[-5:]) / len(history[-5:])
    print(f"reward first-5 {first:.3f} -> last-5 {last:.3f} | kl last {history[-1]['kl'] or 0:.3f} nats/token | "
          f"{len(history)} steps in {time.perf_counter() - start:.1f}s | weight version "
          f"{history[-1]['weight_version']} | outputs in {out}")
if dist.is_initialized():
    dist.destroy_process_group()
