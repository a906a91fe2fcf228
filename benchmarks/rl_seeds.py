"""Does the GRPO main job learn, and on how many seeds? Runs one config on several seeds at once.

    python benchmarks/rl_seeds.py --config configs/grpo_tool_cpu.yaml --seeds 0-4 --jobs 2 --out runs/seeds
    python benchmarks/rl_seeds.py --config configs/grpo_tool_cpu.yaml --seeds 0-4 --nproc 4 \\
        --train-args="--atp 2 --adp 2 --ep 4" --out runs/seeds4

Each run is `examples/train_grpo.py` in its own process (or `torchrun --nproc_per_node N` of it),
one thread per process, with the config's seed replaced and `--set key=value` overrides applied.
A run learns when its last-5 mean reward is at least its first-5 mean + `--margin` (0.2 by
default: the main job's promise). `--draw multinomial` swaps the engine's draw for the per-row
`torch.multinomial` draw it replaced (tests/rl/draw_audit.py), to compare learning across the two.
Writes OUT/summary.json (per seed: first-5, last-5, delta, learned) and prints one line a seed.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PATCHED = """import runpy, sys
sys.path.insert(0, {root!r})
from megatron_rollout.engine import sampler
from tests.rl import draw_audit
sampler._draw = draw_audit.draw_functions[{draw!r}]
sys.argv = [{script!r}] + sys.argv[1:]
runpy.run_path({script!r}, run_name="__main__")
"""


def seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def override(cfg: dict, item: str) -> None:
    key, _, value = item.partition("=")
    node = cfg
    *path, leaf = key.split(".")
    for k in path:
        node = node.setdefault(k, {})
    node[leaf] = yaml.safe_load(value)


def run_one(args: argparse.Namespace, seed: int) -> dict:
    out = Path(args.out) / f"seed{seed}"
    out.mkdir(parents=True, exist_ok=True)
    cfg = yaml.safe_load(Path(args.config).read_text())
    cfg["seed"] = seed
    for item in args.set:
        override(cfg, item)
    if args.steps:
        cfg["steps"] = args.steps
    (out / "config.yaml").write_text(yaml.safe_dump(cfg))
    script = str(ROOT / "examples" / "train_grpo.py")
    if args.draw != "ours":
        wrapper = out / "train_patched.py"
        wrapper.write_text(PATCHED.format(root=str(ROOT), draw=args.draw, script=script))
        script = str(wrapper)
    launch = [sys.executable] if args.nproc == 1 else [  # --standalone: each run on a free port of its own
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc)]
    cmd = [*launch, script, "--config", str(out / "config.yaml"), "--out", str(out / "run"), "--overwrite",
           *shlex.split(args.train_args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(out / "log.txt", "w") as log:
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    metrics = out / "run" / "metrics.jsonl"
    rewards = [json.loads(line)["reward_mean"] for line in metrics.read_text().splitlines()] if metrics.exists() else []
    if code != 0 or not rewards:
        return {"seed": seed, "error": f"exit {code}, {len(rewards)} steps; see {out / 'log.txt'}"}
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    return {"seed": seed, "steps": len(rewards), "first5": round(first, 4), "last5": round(last, 4),
            "delta": round(last - first, 4), "learned": last - first >= args.margin, "rewards": rewards}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", required=True, help="GRPO YAML config")
    p.add_argument("--seeds", type=seeds, default=seeds("0-4"), help="e.g. 0-4 or 0,3,7")
    p.add_argument("--set", action="append", default=[], help="config override key=value (dots for nesting)")
    p.add_argument("--steps", type=int, help="override the config's steps")
    p.add_argument("--draw", default="ours", choices=["ours", "multinomial"], help="the engine's draw")
    p.add_argument("--nproc", type=int, default=1, help="processes per run (torchrun)")
    p.add_argument("--train-args", default="", help="extra arguments of examples/train_grpo.py")
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 1)), help="runs at once")
    p.add_argument("--margin", type=float, default=0.2, help="last-5 minus first-5 reward that counts as learning")
    p.add_argument("--out", required=True, help="output directory")
    args = p.parse_args()
    with ThreadPoolExecutor(max(1, args.jobs // args.nproc)) as pool:
        results = list(pool.map(lambda s: run_one(args, s), args.seeds))
    for r in results:
        print(json.dumps({k: v for k, v in r.items() if k != "rewards"}))
    learned = sum(bool(r.get("learned")) for r in results)
    summary = {"config": args.config, "set": args.set, "draw": args.draw, "nproc": args.nproc,
               "train_args": args.train_args, "margin": args.margin, "learned": learned, "runs": len(results),
               "results": results}
    Path(args.out, "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"learned on {learned} of {len(results)} seeds (last-5 >= first-5 + {args.margin})")


if __name__ == "__main__":
    main()
