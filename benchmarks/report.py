"""The tables of docs/benchmarks.md and docs/kernels.md, regenerated from the result JSON.

A page marks each generated table with a comment naming its kind and its JSON file (relative to
the repository root); everything up to the closing comment is rewritten:

    <!-- report rollout benchmarks/results/2026-12-02-rollout-vllm-two-settings/current.json -->
    | schedule | ... |
    <!-- end report -->

`python -m benchmarks.report docs/benchmarks.md docs/benchmarks-earlier.md docs/kernels.md` rewrites
the tables in place; `--check` rewrites nothing and exits 1 if a page differs from its JSON. `python -m
benchmarks.report KIND FILE` prints one table. Kinds (`TABLES`): `rollout` (a
`benchmarks.rollout` replay: every schedule at its best budget and vLLM at each setting run),
`decode` and `prefill` (the micro stage, `benchmarks.rollout --micro`), `gap` (its P segment
gap), `ops`, `fused-decode` and `sort` (`benchmarks.kernels`), `idle` (`benchmarks.profile`'s decode-only
windows), `fp8` (`benchmarks.te`). Each figure is the median over repeats with [min-max] where
the JSON has them. Left out: prose; each page's text around the tables is written by hand.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.agreement import agreement_note

ROOT = Path(__file__).resolve().parents[1]

MARK = re.compile(r"^<!-- report (?P<kind>[\w-]+) (?P<path>\S+) -->\n(?P<body>.*?)^<!-- end report -->$",
                  re.M | re.S)
VLLM_BLOCK = 16
"""vLLM's KV block size when it is not told one (0.26, FlashAttention); another is named in the table."""


def num(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def spread(med: Any, lo: Any, hi: Any, spec: str) -> str:
    """`med [lo-hi]`, or `med` alone where the range is missing."""
    if not isinstance(lo, (int, float)) or not isinstance(hi, (int, float)) or num(lo, spec) == num(hi, spec):
        return num(med, spec)  # no range, or one sample
    return f"{num(med, spec)} [{num(lo, spec)}-{num(hi, spec)}]"


def markdown(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


ROLLOUT_HEAD = ["schedule", "budget", "n", "makespan s", "p50 request s", "p99 request s", "p99 trajectory s",
                "mean TTFT ms", "decode wait ms", "tokens/s", "compilations"]


def _rollout_row(label: str, budget: str, n: int, med: dict, lo: dict, hi: dict, compiles: str) -> list[str]:
    def fig(key: str, spec: str, scale: float = 1.0) -> str:
        at = [(d or {}).get(key) for d in (med, lo, hi)]
        at = [v * scale if isinstance(v, (int, float)) else None for v in at]
        return spread(*at, spec)

    return [label, budget, str(n), fig("makespan_s", ".2f"), num(med.get("p50_request_s"), ".3f"),
            fig("p99_request_s", ".2f"), fig("p99_trajectory_s", ".2f"), fig("mean_ttft_s", ".1f", 1e3),
            fig("mean_decode_wait_ms", ".2f"), fig("tokens_per_s", ".0f"), compiles]


def rollout(result: dict) -> str:
    """Our schedules at their best budget, vLLM at each setting it ran, then the bound and ratios."""
    rows = []
    for name, s in result.get("schedules", {}).items():
        if (s.get("median") or {}).get("makespan_s") is None:
            rows.append([name, num(s.get("budget"), "d"), "0"] + ["-"] * (len(ROLLOUT_HEAD) - 3))
            continue
        rows.append(_rollout_row(name, num(s.get("budget"), "d"), s.get("n", 0), s["median"], s.get("min") or {},
                                 s.get("max") or {}, str(s.get("compilations", "-"))))
    vllm = result.get("vllm") or {}
    for key, entry in (vllm.get("budgets") or {}).items():
        passes = [p for p in entry.get("passes") or [] if isinstance(p.get("makespan_s"), (int, float))]
        if not passes:
            continue
        keys = [k for k in passes[0] if all(isinstance(p.get(k), (int, float)) for p in passes)]
        lo = {k: min(p[k] for p in passes) for k in keys}
        hi = {k: max(p[k] for p in passes) for k in lo}
        chosen = (entry.get("chosen") or {}).get("max_num_batched_tokens")
        budget, _, mode = str(key).partition("/")
        budget, _, drafts = budget.partition("~")  # '<budget>~ngram:K': its own n-gram speculation
        label = (f"vLLM {vllm.get('vllm', '')}, its default ({num(chosen, 'd')})" if budget == "default"
                 else f"vLLM {vllm.get('vllm', '')} at {num(chosen, 'd')}") + (", core in process" if mode else "")
        label += f", {drafts} drafts" if drafts else ""
        block = (entry.get("chosen") or {}).get("block_size")
        label += f", KV blocks of {block}" if block not in (None, VLLM_BLOCK) else ""
        label += ", interleaved with ours" if entry.get("interleaved", vllm.get("interleaved")) else ""
        if str(key) == str(vllm.get("best_budget")):
            label += ": its best"
        rows.append(_rollout_row(label, "-", len(passes), entry.get("median") or {}, lo, hi, "-"))
    text = markdown(ROLLOUT_HEAD, rows)
    notes = []
    bound = (result.get("lower_bound") or {}).get("bound_s")
    if bound is not None:
        notes.append(f"lower bound {bound:.2f} s")
    r = result.get("ratios") or {}
    for key, label in (("mux_over_best_baseline", "mux over the best of off and chunked"),
                       ("mux_over_vllm", "mux over vLLM's best"), ("best_over_vllm", "our best over vLLM's best"),
                       ("mux_ttft_over_off", "mux mean TTFT over off's")):
        if isinstance(r.get(key), (int, float)):
            notes.append(f"{label} {r[key]:.3f}")
    oracle = {n: o for n, o in (result.get("oracle") or {}).items() if "over_fifo" in o}
    if oracle:
        notes.append("the oracle order over arrival order, simulated on each schedule's own fit: " + ", ".join(
            f"{n} {o['over_fifo']:.3f}" for n, o in oracle.items()))
    if (accepted := acceptance_note(result)) is not None:
        notes.append(accepted)
    if (alike := agreement_note(result)) is not None:
        notes.append(alike)
    if result.get("stopped"):
        notes.append(f"stopped early: {result['stopped']}")
    return text + ("\n\n" + "; ".join(notes) + "." if notes else "")


def acceptance_note(result: dict) -> str | None:
    """Drafted tokens kept, ours per drafting schedule (over all its repeats) beside the peer's (its
    median pass), and whose weights the peer ran; None unless the peer counted its drafts."""
    vllm = result.get("vllm") or {}
    theirs = (vllm.get("median") or {}).get("acceptance")
    if not isinstance(theirs, (int, float)):
        return None
    parts = []
    for name, s in result.get("schedules", {}).items():
        stats = [r.get("engine_stats") or {} for r in s.get("repeats") or []]
        made = sum(st.get("drafted_tokens", 0) for st in stats)
        if made:
            parts.append(f"{name} {sum(st.get('accepted_tokens', 0) for st in stats) / made:.3f}")
    weights = "ours" if vllm.get("weights") not in (None, "dummy") else "its dummy init"
    return "drafts accepted: " + ", ".join(parts + [f"vLLM {theirs:.3f} (on {weights})"])


def _micro(result: dict) -> dict:
    return result.get("micro", result)


def decode(result: dict) -> str:
    """Graph-replayed decode steps against the memory roofline (the micro stage)."""
    rows = [[str(r["rows"]), num(r["context"], ",d"), num(r["graph_ms"], ".3f"), num(r["eager_ms"], ".2f"),
             num(r["roofline_ms"], ".3f"), num(r["graph_over_roofline"], ".2f"), str(r.get("compiles", "-"))]
            for r in _micro(result).get("decode", [])]
    return markdown(["rows", "context", "graph ms", "eager ms", "roofline ms", "graph / roofline", "compilations"],
                    rows)


def prefill(result: dict) -> str:
    """One P forward's device time against the bf16 matmul rate measured in the same run."""
    rows = []
    for r in _micro(result).get("prefill", []):
        spans = r["spans"]
        shape = f"{len(spans)} x ({spans[0][0]} + {spans[0][1]})" if len({tuple(s) for s in spans}) == 1 else \
            " + ".join(f"({p} + {n})" for p, n in spans)
        rows.append([shape, num(r["tokens"], ",d"), r.get("mode", "-"),
                     spread(r.get("device_ms"), *(r.get("device_ms_range") or [None, None]), ".2f"),
                     num(100 * r["device_fraction_of_matmul_peak"], ".1f") if "device_fraction_of_matmul_peak" in r
                     else "-", spread(r.get("eager_ms"), *(r.get("eager_ms_range") or [None, None]), ".2f"),
                     spread(r.get("ms"), *(r.get("ms_range") or [None, None]), ".2f"), str(r.get("compiles", "-"))])
    return markdown(["batch (past + new)", "tokens", "mode", "device ms", "% of matmul rate", "eager device ms",
                     "ms from the call", "compilations"], rows)


def gap(result: dict) -> str:
    """A P forward as piecewise graphs against one whole-forward graph: the launch cost left."""
    rows = [[num(r["tokens"], ",d"), str(r["segments"]), num(r["piecewise_ms"], ".3f"), num(r["whole_graph_ms"], ".3f"),
             num(r["eager_ms"], ".3f"), num(r["gap_ms"], ".3f"), num(r["gap_ms_per_segment"], ".3f")]
            for r in _micro(result).get("gap", [])]
    head = ["tokens", "segments", "piecewise ms", "whole graph ms", "eager ms", "gap ms", "gap ms per segment"]
    return markdown(head, rows)


def ops(result: dict) -> str:
    """Each fused small op against the portable ops it replaces, in graph replay."""
    rows = [[r["op"], num(r["rows"], ",d"), num(r["portable_graph_us"], ".1f"), num(r["fused_graph_us"], ".1f"),
             num(r["graph_speedup"], ".2f")] for r in result.get("ops", [])]
    return markdown(["op", "rows", "portable us", "fused us", "speedup"], rows)


def fused_decode(result: dict) -> str:
    """The whole decode step replayed with the portable ops and with the fused ones."""
    d = result.get("decode") or {}
    rows = [[str(a["rows"]), num(a["context"], ",d"), num(a["graph_ms"], ".3f"), num(b["graph_ms"], ".3f"),
             num(b["roofline_ms"], ".3f"), num(b["graph_over_roofline"], ".2f"),
             num(a["graph_ms"] / b["graph_ms"], ".2f")]
            for a, b in zip(d.get("portable", []), d.get("fused", []))]
    return markdown(["rows", "context", "portable ms", "fused ms", "roofline ms", "fused / roofline", "speedup"], rows)


SORT_PATHS = ("one_hot", "argsort", "torch", "triton", "padded_torch", "padded_triton")


def sort(result: dict) -> str:
    """The expert sort (destination of every routed pair) by each path, microseconds."""
    rows = [[num(r["tokens"], ",d"), num(r["pairs"], ",d")]
            + [num((r.get(k) or {}).get("us"), ".1f") for k in SORT_PATHS] for r in result.get("destinations", [])]
    return markdown(["tokens", "pairs"] + [f"{k} us" for k in SORT_PATHS], rows)


def idle(result: dict) -> str:
    """The GPU's idle share of decode-only engine windows, with and without decode issued ahead."""
    rows = []
    for key, entry in result.items():
        if not key.startswith("decode_idle_") or not isinstance(entry, dict):
            continue
        rows_n, _, rest = key.removeprefix("decode_idle_").partition("_")
        med, lo, hi = (entry.get(k) or {} for k in ("median", "min", "max"))
        rows.append([rows_n, "off" if rest == "no_ahead" else "auto", str(entry.get("n", "-")),
                     spread(med.get("wall_ms_per_step"), lo.get("wall_ms_per_step"), hi.get("wall_ms_per_step"), ".3f"),
                     num(med.get("device_busy_ms_per_step"), ".3f"),
                     spread(*(100 * (d.get("idle_share") or 0) for d in (med, lo, hi)), ".1f"),
                     num(100 * med["host_idle_share"] if isinstance(med.get("host_idle_share"), float) else None,
                         ".1f")])
    return markdown(["rows", "decode ahead", "n", "wall ms per step", "busy ms per step", "idle %", "host's idle %"],
                    rows)


def fp8(result: dict) -> str:
    """Decode and prefill in bf16 and in each FP8 variant (`benchmarks.te`), medians of the rounds."""
    rows = []
    for name, v in result.get("variants", {}).items():
        med, lo, hi = (v.get(k) or {} for k in ("median", "min", "max"))
        if "error" in v or not med:
            rows.append([name, f"failed: {v.get('error', 'no round')}"[:80], "-", "-", "-"])
            continue
        rows.append([name, spread(med["decode_ms"], lo.get("decode_ms"), hi.get("decode_ms"), ".3f"),
                     num(med["roofline_ms"], ".3f"), spread(med["prefill_ms"], lo.get("prefill_ms"),
                                                            hi.get("prefill_ms"), ".2f"), str(v.get("compiles", "-"))])
    return markdown([f"variant ({result.get('rows')} rows x {result.get('context')} context; "
                     f"{result.get('prefill_tokens')}-token prefill)", "decode ms", "roofline ms", "prefill ms",
                     "compilations"], rows)


def verify(result: dict) -> str:
    """Verify attention with each one-query row alone against runs (`benchmarks.attention --verify`);
    where a grid of the runs' launch settings ran (`--verify-block-n`), the fastest of it too."""
    def us(x: dict) -> str:
        return spread(x["ms"] * 1e3, min(x["rounds_ms"]) * 1e3, max(x["rounds_ms"]) * 1e3, ".1f")

    rows, grid = [], any(len(v["variants"]) > 2 for v in (result.get("verify") or {}).values())
    for shape, v in (result.get("verify") or {}).items():
        alone, runs = v["variants"]["max_run=1"], v["variants"]["max_run=8"]
        row = [shape, num(v["kv_bytes"] / 1e6, ",.0f"), us(alone), us(runs), num(runs["gb_per_s"], ",.0f"),
               num(v["alone_over_runs"], ".2f")]
        if grid:
            best = (result.get("best_verify") or {}).get(shape, "max_run=8")
            b = v["variants"][best]
            row += [us(b), best.removeprefix("max_run=8").removeprefix(" triton ") or "the default",
                    num(b["gb_per_s"], ",.0f")]
        rows.append(row + [num(v["rel_err_runs_vs_alone"], ".1e"), str(v.get("compiles", "-"))])
    head = ["rows x (cached + queries)", "history MB", "rows alone us", "runs us", "runs GB/s", "alone / runs"]
    if grid:
        head += ["fastest setting us", "its setting", "its GB/s"]
    return markdown(head + ["rel. difference", "compilations"], rows)


def segments(result: dict) -> str:
    """`benchmarks.sim_replay --mux-segments`: mux at each count of prefill segments per epoch against off."""
    sweep = result["mux_segments"]
    rows = [[f"{r['segments']:g}", num(r["makespan_s"], ".2f"), num(r["makespan_over_off"], ".3f"),
             num(1e3 * r["mean_ttft_s"], ",.0f"), num(r["ttft_over_off"], ".2f"), num(1e3 * r["mean_queue_s"], ",.0f")]
            for r in sweep["mux"]]
    off = sweep["off"]
    return markdown(["mux segments per epoch", "makespan s", "over off", "mean TTFT ms", "over off",
                     "mean queue ms"], rows) + \
        f"\noff: {off['makespan_s']:.2f} s, mean TTFT {1e3 * off['mean_ttft_s']:.0f} ms; the run's mux cut " \
        f"{sweep['measured_segments']:.2f} segments per epoch"


def what_if_table(result: dict) -> str:
    """`benchmarks.sim_replay --what-if`: each schedule not measured, simulated beside the one it extends."""
    rows = []
    for spec, row in result["what_if"].items():
        overlap = row.get("overlap")
        factors = (f"{overlap['decode_factor']:.2f} / {overlap['prefill_factor']:.2f} / "  # older results: alone at 1
                   f"{overlap.get('alone_factor', 1.0):.2f} / {overlap.get('decode_alone_factor', 1.0):.2f}"
                   if overlap else "-")
        fits = [(row.get(fit) or {}) for fit in ("linear", "experts")]
        cells = [f"{c['sim_s']:.2f} / {c['base_sim_s']:.2f} = {c['over_base']:.3f}" if "sim_s" in c else "-"
                 for c in fits]
        rows.append([f"`{spec}`", f"`{row['of']}`", factors, *cells, row.get("skipped") or ""])
    return markdown(["schedule (simulated)", "extends", "decode / prefill / prefill alone / decode alone factor",
                     "linear fit: s / base s", "experts fit: s / base s", "skipped"], rows)


def orderings_table(report: dict) -> str:
    """`benchmarks.sim_replay --orderings`: each schedule's simulated makespan under each ordering over FIFO's."""
    parts = [(label, part, cells) for label, row in report["orderings"].items() if "skipped" not in row
             for part in ("in_sample", "out_of_sample") if (cells := row.get(part)) and "skipped" not in cells]
    names = [n for n in (parts[0][2] if parts else {}) if n != "fifo"]
    rows = [[f"`{label}`", part.replace("_", " "), f"{cells['fifo']['sim_s']:.2f}",
             *(f"{cells[n]['over_fifo']:.3f}" for n in names)] for label, part, cells in parts]
    return markdown(["schedule", "fit", "FIFO s", *(f"{n} / FIFO" for n in names)], rows)


TABLES: dict[str, Callable[[dict], str]] = {"rollout": rollout, "decode": decode, "prefill": prefill, "gap": gap,
                                            "ops": ops, "fused-decode": fused_decode, "sort": sort, "idle": idle,
                                            "fp8": fp8, "verify": verify, "segments": segments,
                                            "what-if": what_if_table, "orderings": orderings_table}


def host_table(folder: Path) -> str:
    """A markdown table of the stages of `folder`'s `host-before-*.json` against its
    `host-after-*.json` (invocations of two commits, alternated): per figure, the median over the
    invocations of their medians, [min-max]."""
    runs = {v: [json.loads(f.read_text()) for f in sorted(folder.glob(f"host-{v}-*.json"))]
            for v in ("before", "after")}
    if not runs["before"] or not runs["after"]:
        raise SystemExit(f"{folder}: needs host-before-*.json and host-after-*.json")

    def cell(v: str, stage: str, size: str, variant: str, spec: str) -> str:
        xs = [r[stage][size][variant]["median"] for r in runs[v]]
        return spread(statistics.median(xs), min(xs), max(xs), spec)

    rows = []
    for stage, unit, spec, what in (("drafting_step_ms", "ms", ".3f", "rows"), ("lookup_us", "us", ".1f", "tokens"),
                                    ("sample_ms", "ms", ".3f", "rows"),
                                    ("append_us", "us", ".1f", "tokens"),
                                    ("fill_ms", "ms", ".3f", "rows x entries"),
                                    ("verify_fill_ms", "ms", ".3f", "rows x entries"),
                                    ("layout_ms", "ms", ".3f", "rows x entries"),
                                    ("turn_layout_ms", "ms", ".3f", "sessions x entries")):
        for size, variants in runs["before"][0].get(stage, {}).items():
            for variant in variants:
                rows.append([f"{stage.rsplit('_', 1)[0].replace('_', ' ')}, {unit}", f"{size} {what}", variant,
                             cell("before", stage, size, variant, spec), cell("after", stage, size, variant, spec)])
    if all(r.get("startup") for rs in runs.values() for r in rs):
        first = runs["before"][0]["startup"]
        ms = {v: [r["startup"]["ms"]["median"] for r in rs] for v, rs in runs.items()}
        rows.append(["startup, ms", f"{first['tokens']} tokens of {first['turns']} first turns", "submit",
                     *(spread(statistics.median(ms[v]), min(ms[v]), max(ms[v]), ".1f") for v in ("before", "after"))])
    return markdown(["stage", "size", "variant", "before", "after"], rows)


FOLDER_TABLES: dict[str, Callable[[Path], str]] = {"host": host_table}
"""Tables of a folder's files, not of one JSON: `host` is `benchmarks.host --compare`'s before/after table."""


def table(kind: str, path: str | Path) -> str:
    if kind in FOLDER_TABLES:
        if not (ROOT / path).is_dir():
            raise FileNotFoundError(f"folder {path} not found (paths are relative to the repository root {ROOT})")
        return FOLDER_TABLES[kind](ROOT / path)
    if kind not in TABLES:
        raise ValueError(f"unknown table kind {kind!r}: use one of {sorted([*TABLES, *FOLDER_TABLES])}")
    file = ROOT / path
    if not file.is_file():
        raise FileNotFoundError(f"result file {path} not found (paths are relative to the repository root {ROOT})")
    return TABLES[kind](json.loads(file.read_text()))


def render(page: str) -> str:
    """`page` with every marked table regenerated from its JSON."""
    return MARK.sub(lambda m: f"<!-- report {m['kind']} {m['path']} -->\n{table(m['kind'], m['path'])}\n"
                              "<!-- end report -->", page)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.splitlines()[0])
    ap.add_argument("args", nargs="+", help="pages to regenerate, or KIND FILE to print one table")
    ap.add_argument("--check", action="store_true", help="exit 1 if a page's tables differ from its JSON")
    args = ap.parse_args(argv)
    if len(args.args) == 2 and (args.args[0] in TABLES or args.args[0] in FOLDER_TABLES):
        print(table(*args.args))
        return 0
    stale = []
    for name in args.args:
        page = Path(name)
        text = page.read_text()
        fresh = render(text)
        if fresh != text:
            stale.append(name)
            if not args.check:
                page.write_text(fresh)
    if args.check and stale:
        print(f"tables out of date with their JSON: {', '.join(stale)}; run python -m benchmarks.report "
              f"{' '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
