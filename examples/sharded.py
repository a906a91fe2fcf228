"""The sharded form: one process per device under torchrun, the rollout laid out ATP x ADP (EP = both).

    torchrun --nproc_per_node 2 examples/sharded.py                 # ATP 2 (heads split over 2 ranks)
    torchrun --nproc_per_node 2 examples/sharded.py --atp 1 --adp 2 # two attention replicas
    torchrun --nproc_per_node 4 examples/sharded.py --atp 2 --adp 2

Every rank runs this same script. `Runtime.start` joins the process group torchrun set up (gloo on
CPU, NCCL on GPU) and builds the rollout's communicators; the model is loaded as this rank's shard;
`Runtime.generate` spreads the prompts over the ADP replicas and returns every result at rank 0.
Weight updates take full (unsharded) tensors on every rank; each rank keeps its own slice.
"""
from __future__ import annotations

import argparse
import os

import torch

from megatron_rollout.distributed import Runtime
from megatron_rollout.engine import EngineConfig, SamplingParams, Schedule
from megatron_rollout.engine.scheduler import SchedulerConfig
from megatron_rollout.model.checkpoint import load_model


def main() -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--atp", type=int, default=world, help="attention tensor parallel (heads split)")
    ap.add_argument("--adp", type=int, default=1, help="attention data parallel (replicas); ATP x ADP = ranks")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds before a missing rank is an error")
    args = ap.parse_args()

    runtime = Runtime.start(args.atp, args.adp, device="cpu", timeout_s=args.timeout)
    model = load_model("tiny-moe", comm=runtime.comm, device=runtime.device)  # this rank's shard
    # mux: long prefills run in segments, the turnstile keeps every rank's collectives in one order.
    engine = runtime.engine(model, EngineConfig(scheduler=SchedulerConfig(schedule=Schedule.MUX)))
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    before = runtime.generate(engine, prompts, greedy)  # None on every rank but 0

    # A trainer replica on every rank holds the full tensors; each rank copies in its own slice.
    torch.manual_seed(0)  # the same new weights on every rank
    with torch.no_grad():
        new = {name: t + 0.05 * torch.randn_like(t) for name, t in load_model("tiny-moe").state_dict().items()}
    engine.update_weights(new, version=1)
    after = runtime.generate(engine, prompts, greedy)

    if runtime.is_main:
        print(f"{args.atp * args.adp} ranks, ATP {args.atp} x ADP {args.adp}")
        for p, b, a in zip(prompts, before, after):
            print(f"{p}: v{b.weight_version} {b.token_ids} -> v{a.weight_version} {a.token_ids}")


if __name__ == "__main__":
    main()
