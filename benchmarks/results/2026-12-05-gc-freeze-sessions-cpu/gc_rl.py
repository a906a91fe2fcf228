"""Cyclic garbage kept frozen through each rollout of the tool GRPO job: a full collection right
after each hand-back counts what the freeze held (gc_freeze on, the job's default).
Run from the checkout's root."""
import gc
import runpy
import sys
import time

from megatron_rollout.engine import gc_freeze

freed = []
process = gc_freeze.PROCESS
release_once = process.release


def release():
    release_once()
    if process.holders == 0:
        t = time.perf_counter()
        freed.append((gc.collect(), time.perf_counter() - t))


process.release = release
sys.argv = ["train_grpo.py", "--config", "configs/grpo_tool_cpu.yaml", "--steps", "4", "--out", "/tmp/gcrl",
            "--overwrite"]
try:
    runpy.run_path("examples/train_grpo.py", run_name="__main__")
finally:
    print("hand-backs:", len(freed), "objects freed by a full collection right after each:", [n for n, _ in freed])
