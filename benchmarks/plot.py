"""Draw the benchmark's figure from its JSON: `python -m benchmarks.plot rollout.json out.png`.

Left panel: median makespan, p99 request and p99 trajectory completion per schedule (each at its
best budget, error bars from the repeats' min to max) and the vLLM peer, with the trace's lower
bound as a line. Right panels: three seconds of the host timeline (P segments above, D
iterations below) from the middle of the first timed `off` and `mux` replays. Beside it, where
the time went (`plot_breakdowns`): decode step stretch beside decode wait per schedule, and each
schedule's busy-over-time and critical-path figure. Needs matplotlib (a
plotting extra, not a dependency of the package).
"""
from __future__ import annotations

import json
import re
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


def plot_breakdowns(result: dict, path: str | Path) -> list[Path]:
    """Beside the main figure at `path`: `<stem>.stretch.png`, each schedule's decode step stretch
    beside its mean decode wait (medians, min-max bars), and `<stem>.breakdown.<schedule>.png`,
    `trace.breakdown.plot_breakdown` of its first finished repeat. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_rollout.trace.breakdown import plot_breakdown

    path = Path(path)
    written = []
    rows = {name: s["breakdown"] for name, s in result.get("schedules", {}).items()
            if ((s.get("breakdown") or {}).get("median") or {}).get("decode_step_stretch") is not None}
    if rows:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        for ax, key, label in ((axes[0], "decode_step_stretch", "decode step stretch (x pure decode)"),
                               (axes[1], "mean_decode_wait_ms", "mean decode wait (ms)")):
            med = [b["median"][key] or 0.0 for b in rows.values()]
            lo = [m - (b["min"][key] or 0.0) for m, b in zip(med, rows.values())]
            hi = [(b["max"][key] or 0.0) - m for m, b in zip(med, rows.values())]
            bars = ax.bar(range(len(rows)), med, yerr=[lo, hi], capsize=2)
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
            ax.set_xticks(range(len(rows)), list(rows), rotation=30, fontsize=7)
            ax.set_title(label, fontsize=9)
        fig.tight_layout()
        out = path.with_name(f"{path.stem}.stretch.png")
        fig.savefig(out, dpi=110)
        plt.close(fig)
        written.append(out)
    for name, s in result.get("schedules", {}).items():
        first = next((r["report"]["breakdown"] for r in s.get("repeats") or []
                      if r.get("finished") and (r.get("report") or {}).get("breakdown")), None)
        if first is not None:
            out = path.with_name(f"{path.stem}.breakdown.{re.sub(r'[/:]', '-', name)}.png")
            plot_breakdown(first, str(out))
            written.append(out)
    return written


def plot_segments(sweep: dict, path: str | Path) -> Path:
    """`sim_replay.segment_sweep`: mux's makespan and mean TTFT over off's by segments per epoch,
    the run's own count marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = [r["segments"] for r in sweep["mux"]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label in (("makespan_over_off", "makespan over off"), ("ttft_over_off", "mean TTFT over off")):
        ax.plot(counts, [r[key] for r in sweep["mux"]], marker="o", label=label)
    ax.axvline(sweep["measured_segments"], color="grey", linestyle=":", label="the run's mux")
    ax.axhline(1.2, color="tab:red", linestyle="--", linewidth=0.8, label="TTFT target (1.2x off)")
    ax.set_xlabel("prefill segments per mux epoch (simulated)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_sim_errors(report: dict, path: str | Path) -> Path:
    """`sim_replay.sim_replay`: each schedule's simulated makespan over its measured one, minus 1, in and
    out of sample, for each fit; the 10% band the simulator is held to shaded. A skipped check has no bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(report["schedules"])
    parts = [(part, fit) for part in ("in_sample", "out_of_sample") for fit in ("linear", "experts")]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(labels)), 3.8))
    width = 0.8 / len(parts)
    for i, (part, fit) in enumerate(parts):
        errors = [100 * ((report["schedules"][n].get(part) or {}).get(fit) or {}).get("error", float("nan"))
                  for n in labels]
        ax.bar([j + (i - (len(parts) - 1) / 2) * width for j in range(len(labels))], errors, width,
               label=f"{part.replace('_', ' ')}, {fit}")
    ax.axhspan(-10, 10, color="grey", alpha=0.12, label="within 10%")
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_xticks(range(len(labels)), [re.sub(r"(~|/)", r"\n\1", n) for n in labels], fontsize=7)
    ax.set_ylabel("simulated / measured - 1 (%)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m benchmarks.plot ROLLOUT_JSON OUT_PNG", file=sys.stderr)
        return 2
    result = json.loads(Path(args[0]).read_text())
    plot(result, args[1])
    plot_breakdowns(result, args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
