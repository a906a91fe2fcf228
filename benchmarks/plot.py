"""Draw the benchmark's figure from its JSON: `python -m benchmarks.plot rollout.json out.png`.

Left panel: median makespan, p99 request and p99 trajectory completion per schedule (each at its
best budget, error bars from the repeats' min to max) and the vLLM peer, with the trace's lower
bound as a line. Right panels: three seconds of the host timeline (P segments above, D
iterations below) from the middle of the first timed `off` and `mux` replays. Needs matplotlib (a
plotting extra, not a dependency of the package).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

METRICS = (("makespan_s", "makespan"), ("p99_request_s", "p99 request"), ("p99_trajectory_s", "p99 trajectory"))


def _series(result: dict) -> dict[str, tuple[list[float], list[float], list[float]]]:
    """name -> (medians, mins, maxs) over METRICS, for every schedule (and vLLM) with a median."""
    out = {}
    for name, s in result.get("schedules", {}).items():
        m = s.get("median") or {}
        if m.get("makespan_s") is None:
            continue
        out[f"{name}@{s.get('budget')}"] = tuple([(d.get(k) or 0.0) for k, _ in METRICS]
                                                 for d in (m, s.get("min") or m, s.get("max") or m))
    v = result.get("vllm") or {}
    if (v.get("median") or {}).get("makespan_s") is not None:
        passes = v.get("repeats") or [v["median"]]
        med = [v["median"].get(k) or 0.0 for k, _ in METRICS]
        lo = [min(p.get(k) or 0.0 for p in passes) for k, _ in METRICS]
        hi = [max(p.get(k) or 0.0 for p in passes) for k, _ in METRICS]
        out[f"vllm@{v.get('best_budget')}"] = (med, lo, hi)
    return out


def plot(result: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = _series(result)
    timelines = []
    for name in ("off", "mux"):
        reps = (result.get("schedules", {}).get(name) or {}).get("repeats") or []
        events = next((r["timeline"] for r in reps if r.get("timeline")), None)
        if events:
            timelines.append((name, events))
    fig = plt.figure(figsize=(13, 4.2))
    grid = fig.add_gridspec(len(timelines) or 1, 2, width_ratios=[1, 1.6])
    ax = fig.add_subplot(grid[:, 0])
    width = 0.8 / max(1, len(series))
    for i, (name, (med, lo, hi)) in enumerate(series.items()):
        xs = [j + i * width for j in range(len(METRICS))]
        err = [[m - a for m, a in zip(med, lo)], [b - m for m, b in zip(med, hi)]]
        bars = ax.bar(xs, med, width, yerr=err, capsize=2, label=name)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(METRICS))], [m for _, m in METRICS])
    ax.set_ylabel("seconds (median, min-max)")
    bound = (result.get("lower_bound") or {}).get("bound_s")
    if bound:
        ax.axhline(bound, color="k", ls="--", lw=1, label=f"lower bound {bound:.1f} s")
    ax.legend(fontsize=7)
    trace = result.get("trace", {})
    ax.set_title(f"{result.get('model', '')}, profile {result.get('profile', '?')}, "
                 f"{trace.get('conversations', '?')} conversations, {trace.get('requests', '?')} requests", fontsize=9)
    for row, (name, events) in enumerate(timelines):
        tax = fig.add_subplot(grid[row, 1])
        for phase, y, color in (("P", 1, "tab:orange"), ("D", 0, "tab:blue")):
            spans = [(s, e - s) for p, s, e in events if p == phase]
            tax.broken_barh(spans, (y - 0.4, 0.8), color=color)
        tax.set_yticks([0, 1], ["D", "P"])
        tax.set_xlim(0, 3.0)
        tax.set_title(f"{name}: host timeline, 3 s mid-run", fontsize=9)
        if row == len(timelines) - 1:
            tax.set_xlabel("seconds")
    fig.suptitle(f"{result.get('device', '')}, {result.get('date', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m benchmarks.plot ROLLOUT_JSON OUT_PNG", file=sys.stderr)
        return 2
    plot(json.loads(Path(args[0]).read_text()), args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
