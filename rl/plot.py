"""A GRPO run's figures from its metrics: `python -m rl.plot OUT` (OUT holds `metrics.jsonl`).

Prints the summary the docs quote (reward first-5 -> last-5 mean, median seconds per part of a
step, peak GPU memory) as markdown, and draws OUT/steps.png: the reward per step, the step's wall
time split into rollout, sleep, training, wake and weight sync, and (on GPU) the peak memory of
the rollout and of the training step beside what the sleeping engine still holds. Needs
matplotlib for the figure (the `plot` extra); the summary prints without it.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

PARTS = (("rollout_s", "rollout"), ("sleep_s", "sleep"), ("train_s", "train"), ("wake_s", "wake"),
         ("update_weights_s", "weight sync"))
MEMORY = (("rollout_peak_gib", "rollout peak"), ("train_peak_gib", "training peak"),
          ("asleep_gib", "engine asleep"), ("sleep_freed_gib", "freed by sleep"))


def load(out: str | Path) -> list[dict[str, Any]]:
    path = Path(out) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: pass the --out directory of a GRPO run")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _values(history: list[dict[str, Any]], key: str) -> list[float]:
    return [m[key] for m in history if m.get(key) is not None]


def summary(history: list[dict[str, Any]]) -> str:
    """Markdown: the reward's first-5 and last-5 means, then a table of medians (and maxima of memory)."""
    rewards = [m["reward_mean"] for m in history]
    first, last = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-5:])
    lines = [f"{len(history)} steps; reward first-5 {first:.3f} -> last-5 {last:.3f}", "",
             "| per step | median | max |", "| --- | --- | --- |"]
    for key, name in PARTS + (("rollout_makespan_s", "rollout makespan"),):
        v = _values(history, key)
        if v:
            lines.append(f"| {name} (s) | {statistics.median(v):.3f} | {max(v):.3f} |")
    for key, name in MEMORY + (("peak_gpu_mem_gib", "peak GPU memory"),):
        v = _values(history, key)
        if v:
            lines.append(f"| {name} (GiB) | {statistics.median(v):.3f} | {max(v):.3f} |")
    weights = {m.get("weights") for m in history} - {None}
    if weights:
        lines += ["", f"engine weights: {', '.join(sorted(weights))}"]
    return "\n".join(lines)


def plot(history: list[dict[str, Any]], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    memory = [(k, n) for k, n in MEMORY if _values(history, k)]
    fig, axes = plt.subplots(1, 3 if memory else 2, figsize=(15 if memory else 10, 3.5))
    steps = [m["step"] for m in history]
    mean = [m["reward_mean"] for m in history]
    std = [m["reward_std"] for m in history]
    axes[0].plot(steps, mean)
    axes[0].fill_between(steps, [a - b for a, b in zip(mean, std)], [a + b for a, b in zip(mean, std)], alpha=0.2)
    axes[0].set(xlabel="GRPO step", ylabel="reward", title="reward (mean ± std)")
    bottom = [0.0] * len(history)
    for key, name in PARTS:
        v = [m.get(key) or 0.0 for m in history]
        axes[1].bar(steps, v, bottom=bottom, width=1.0, label=name)
        bottom = [a + b for a, b in zip(bottom, v)]
    axes[1].set(xlabel="GRPO step", ylabel="seconds", title="one step's wall time")
    axes[1].legend(loc="upper right", fontsize="small")
    for key, name in memory:
        axes[2].plot(steps, [m.get(key) for m in history], label=name)
    if memory:
        axes[2].set(xlabel="GRPO step", ylabel="GiB", title="GPU memory allocated")
        axes[2].legend(loc="center right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="a GRPO run's output directory (with metrics.jsonl)")
    args = parser.parse_args(argv)
    history = load(args.out)
    print(summary(history))
    try:
        plot(history, Path(args.out) / "steps.png")
    except ImportError:
        print("steps.png not drawn: matplotlib is not installed (pip install 'megatron_rollout[plot]')")
        return
    print(f"figure: {Path(args.out) / 'steps.png'}")


if __name__ == "__main__":
    main()
