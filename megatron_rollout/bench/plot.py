"""Draw the benchmark's figure from its JSON: `python -m megatron_rollout.bench.plot rollout.json out.png`.

Left panel: makespan, p99 request and p99 trajectory completion per schedule (and the
transformers peer when it finished), with the trace's lower bound as a line. Right panels: three
seconds of the host timeline (P segments above, D iterations below) under `off` and under `mux`,
taken from the middle of each replay. Needs matplotlib (a plotting extra, not a dependency of the
package).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def plot(result: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scheds = {k: v for k, v in result.get("schedules", {}).items() if v.get("finished")}
    names = list(scheds)
    metrics = [("makespan_s", "makespan"), ("p99_request_s", "p99 request"), ("p99_trajectory_s", "p99 trajectory")]
    values = {n: [scheds[n]["report"].get(m) or 0.0 for m, _ in metrics] for n in names}
    hf = result.get("hf_peer") or {}
    if hf.get("finished"):
        names.append("hf-cb")
        values["hf-cb"] = [hf.get("makespan_s") or 0.0, hf.get("p99_request_s") or 0.0, hf.get("p99_trajectory_s") or 0.0]
    timelines = [(n, scheds[n].get("timeline", [])) for n in ("off", "mux") if n in scheds]

    fig = plt.figure(figsize=(13, 4.2))
    grid = fig.add_gridspec(len(timelines) or 1, 2, width_ratios=[1, 1.6])
    ax = fig.add_subplot(grid[:, 0])
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(metrics))]
        bars = ax.bar(xs, values[name], width, label=name)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(metrics))], [m for _, m in metrics])
    ax.set_ylabel("seconds")
    bound = (result.get("lower_bound") or {}).get("bound_s")
    if bound:
        ax.axhline(bound, color="k", ls="--", lw=1, label=f"lower bound {bound:.1f} s")
    ax.legend(fontsize=8)
    trace = result.get("trace", {})
    ax.set_title(f"{result.get('model', '')}, {trace.get('conversations', '?')} conversations, "
                 f"{trace.get('requests', '?')} requests", fontsize=9)
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
        print("usage: python -m megatron_rollout.bench.plot ROLLOUT_JSON OUT_PNG", file=sys.stderr)
        return 2
    plot(json.loads(Path(args[0]).read_text()), args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
