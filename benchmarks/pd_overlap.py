"""Prefill and decode side by side on one GPU, each on its SM partition, in the steady state.

    python -m benchmarks.pd_overlap --out benchmarks/results/pd-overlap            # every method
    python -m benchmarks.pd_overlap --method driver --splits 100/32 --quick         # smoke

`mux` today runs a prefill epoch and the decode iterations one after the other on the whole
device. This measures what running them at once on two partitions (`benchmarks.sm_partition`)
would give, with stand-ins cheap to build and easy to reason about:
- prefill (P): `--prefill-layers` MLP layers of bf16 GEMMs over `--prefill-tokens` tokens (up
  and down projections, `--hidden` x `--ffn`), run eagerly: compute-bound, as a long prefill is;
- decode (D): steps of `--decode-layers` such layers over `--decode-rows` rows with their own
  weights (far larger than L2), each step one CUDA graph captured on D's stream: bound by
  memory bandwidth, as a decode step is.

For each method and split: P and one D step alone on the whole device (what `mux` does now), and
each alone on its partition; D gets as many steps as make it as long as P on their partitions,
then both run at once from one start event; the steps are re-sized once so that both phases end
together (the steady state: neither runs alone at the end), and that is measured `--repeats`
times. Reported: the times alone and beside each other, the factors `prefill_factor` and
`decode_factor` (each phase's time beside the other over its time alone on the whole device:
the meaning of `sim.levers.Overlap`'s fields) and the gain, the serial time (P alone + D alone,
whole device) over the overlapped time. Written to `<out>/pd_overlap.json` (and printed).
Left out: the engine's own forwards (attention, experts, host work between steps) and
partitions that follow the load.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.ceilings import time_cuda
from benchmarks.sm_partition import METHODS, Partition, Split, parse_splits, partitions

log = logging.getLogger("benchmarks.pd_overlap")

HOLD_CYCLES = 100_000_000
"""GPU cycles (~50 ms at 1.98 GHz) a spin kernel holds the start of each timing: longer than the
host takes to enqueue both phases, so the events time the device alone."""


@dataclass(frozen=True)
class Times:
    """Seconds measured for one method and split."""

    prefill_alone_s: float
    """P on the whole device, alone."""
    decode_alone_s: float
    """The D steps on the whole device, alone."""
    prefill_part_s: float
    """P alone on its partition."""
    decode_part_s: float
    """The D steps alone on theirs."""
    prefill_beside_s: float
    """From the common start to P's end, with D running at once (median of the repeats)."""
    decode_beside_s: float
    """From the common start to D's end (median of the repeats)."""
    together_s: float
    """From the common start to the later end (median of the repeats)."""


def summarize(t: Times) -> dict[str, float]:
    """The factors and the gain (module docstring) of one measurement."""
    sequential = t.prefill_alone_s + t.decode_alone_s
    return {"sequential_s": sequential,
            "prefill_factor": t.prefill_beside_s / t.prefill_alone_s,
            "decode_factor": t.decode_beside_s / t.decode_alone_s,
            "prefill_partition_factor": t.prefill_part_s / t.prefill_alone_s,
            "decode_partition_factor": t.decode_part_s / t.decode_alone_s,
            "gain": sequential / t.together_s}


def resized_steps(steps: int, prefill_beside_s: float, decode_beside_s: float) -> int:
    """D steps that end with P beside it, from a pilot where `steps` steps took `decode_beside_s`."""
    return max(1, round(steps * prefill_beside_s / decode_beside_s))


class Workload:
    """The P stand-in and the D steps' weights and buffers (module docstring)."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        h, f = args.hidden, args.ffn
        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device=device, dtype=torch.bfloat16) * shape[-2] ** -0.5
        self.p_layers = args.prefill_layers
        self.p_up, self.p_down = w(h, f), w(f, h)
        self.p_x = torch.randn(args.prefill_tokens, h, device=device, dtype=torch.bfloat16)
        self.p_mid = torch.empty(args.prefill_tokens, f, device=device, dtype=torch.bfloat16)
        self.p_out = torch.empty_like(self.p_x)
        self.d_up = [w(h, f) for _ in range(args.decode_layers)]  # [h, f] per layer
        self.d_down = [w(f, h) for _ in range(args.decode_layers)]  # [f, h] per layer
        self.d_x = torch.randn(args.decode_rows, h, device=device, dtype=torch.bfloat16)
        self.d_mid = torch.empty(args.decode_rows, f, device=device, dtype=torch.bfloat16)
        self.prefill_flop = 4 * args.prefill_tokens * h * f * self.p_layers
        self.step_bytes = 2 * 2 * h * f * args.decode_layers

    def prefill(self) -> None:
        for _ in range(self.p_layers):  # [tokens, h] @ [h, f] @ [f, h]
            torch.matmul(self.p_x, self.p_up, out=self.p_mid)
            torch.matmul(self.p_mid, self.p_down, out=self.p_out)

    def _step(self) -> None:
        for up, down in zip(self.d_up, self.d_down):  # [rows, h] -> [rows, f] -> [rows, h]
            torch.matmul(self.d_x, up, out=self.d_mid)
            torch.matmul(self.d_mid, down, out=self.d_x)

    def decode_graph(self, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
        """One decode step captured on `stream` (so on its partition, where it has one)."""
        with torch.cuda.stream(stream):
            self._step()  # cuBLAS picks and warms its kernels for this stream first
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            self._step()
        return graph


def steps_fn(graph: torch.cuda.CUDAGraph, steps: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(steps):
            graph.replay()
    return run


def beside(prefill: Callable[[], None], p: Partition, decode: Callable[[], None], d: Partition) -> tuple[float, float]:
    """(seconds to P's end, seconds to D's end) from one start event both streams wait for."""
    gate = torch.cuda.current_stream()
    start, p_end, d_end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    torch.cuda._sleep(HOLD_CYCLES)
    start.record(gate)
    for part, fn, end in ((p, prefill, p_end), (d, decode, d_end)):
        part.stream.wait_event(start)
        with torch.cuda.stream(part.stream):
            fn()
        end.record(part.stream)
    p_end.synchronize()
    d_end.synchronize()
    return start.elapsed_time(p_end) / 1e3, start.elapsed_time(d_end) / 1e3


def measure(work: Workload, method: str, split: Split, repeats: int, device: torch.device) -> dict[str, Any]:
    """One method and split: times alone, on partitions, and beside each other (module docstring)."""
    whole = torch.cuda.Stream(device)  # the whole device (graphs are not captured on the default stream)
    prefill_alone = time_cuda(work.prefill, iters=5, stream=whole, hold_cycles=HOLD_CYCLES)
    whole_graph = work.decode_graph(whole)
    step_alone = time_cuda(whole_graph.replay, iters=20, stream=whole)
    with partitions(method, split, device) as pair:
        p, d = pair.prefill, pair.decode
        prefill_part = time_cuda(work.prefill, iters=5, stream=p.stream, hold_cycles=HOLD_CYCLES)
        d_graph = work.decode_graph(d.stream)
        step_part = time_cuda(d_graph.replay, iters=20, stream=d.stream)
        pilot_steps = max(1, round(prefill_part / step_part))
        pilot = beside(work.prefill, p, steps_fn(d_graph, pilot_steps), d)
        steps = resized_steps(pilot_steps, *pilot)
        decode = steps_fn(d_graph, steps)
        decode_part = time_cuda(decode, iters=3, stream=d.stream, hold_cycles=HOLD_CYCLES)
        runs = [beside(work.prefill, p, decode, d) for _ in range(repeats)]
        sms = {"prefill_sms": p.sms, "decode_sms": d.sms}
        del decode, d_graph  # before the partition's context goes
    decode_alone = time_cuda(steps_fn(whole_graph, steps), iters=3, stream=whole, hold_cycles=HOLD_CYCLES)
    times = Times(prefill_alone, decode_alone, prefill_part, decode_part,
                  statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs),
                  statistics.median(max(r) for r in runs))
    return {"method": method, "split": split.label if p.sms is not None else None, **sms,
            "steps": steps, "pilot_steps": pilot_steps,
            "step_alone_s": step_alone, "step_part_s": step_part,
            "decode_gb_s": work.step_bytes / step_alone / 1e9, "decode_part_gb_s": work.step_bytes / step_part / 1e9,
            "prefill_tflop_s": work.prefill_flop / prefill_alone / 1e12,
            **asdict(times), **summarize(times), "runs_s": [list(r) for r in runs]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="streams,driver,torch", help=f"comma-separated, of {','.join(METHODS)}")
    parser.add_argument("--splits", default="100/32,108/24,116/16,124/8",
                        help="P/D SM counts, comma-separated (driver: D's count, P the rest; streams: ignored)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--prefill-tokens", type=int, default=8192)
    parser.add_argument("--prefill-layers", type=int, default=16)
    parser.add_argument("--decode-rows", type=int, default=16)
    parser.add_argument("--decode-layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a small P, one split, 2 repeats: a smoke run")
    parser.add_argument("--time-limit-s", type=float, default=None,
                        help="start no new method or split after this many seconds")
    parser.add_argument("--out", type=Path, default=None, help="folder for pd_overlap.json")
    args = parser.parse_args(argv)
    methods = args.method.split(",")
    if unknown := [m for m in methods if m not in METHODS]:
        parser.error(f"--method: unknown {unknown}; choose from {', '.join(METHODS)}")
    args.methods = methods
    try:
        args.split_list = parse_splits(args.splits)
    except ValueError as exc:
        parser.error(f"--splits: {exc}")
    if args.quick:
        args.prefill_layers, args.decode_layers, args.repeats = 2, 2, 2
        args.split_list = args.split_list[:1]
    for name in ("hidden", "ffn", "prefill_tokens", "prefill_layers", "decode_rows", "decode_layers", "repeats"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    return args


def plan(args: argparse.Namespace) -> list[tuple[str, Split]]:
    """(method, split) of every measurement: `streams` once (it has no split), the others per split."""
    return [(m, s) for m in args.methods for s in (args.split_list[:1] if m == "streams" else args.split_list)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device())
    work = Workload(args, device)
    settings = {k: getattr(args, k) for k in ("hidden", "ffn", "prefill_tokens", "prefill_layers", "decode_rows",
                                              "decode_layers", "repeats", "quick")}
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                              "settings": settings, "runs": [], "stopped": None}
    t0 = time.monotonic()
    for method, split in plan(args):
        if args.time_limit_s is not None and time.monotonic() - t0 > args.time_limit_s:
            result["stopped"] = f"time limit {args.time_limit_s:g} s before {method} {split.label}"
            break
        try:
            run = measure(work, method, split, args.repeats, device)
        except Exception as exc:  # a method this driver or torch refuses is a finding, not the end of the run
            run = {"method": method, "split": split.label, "error": f"{type(exc).__name__}: {exc}"}
        result["runs"].append(run)
        log.info("%s %s: %s", method, split.label,
                 run.get("error") or f"gain {run['gain']:.3f}, P x{run['prefill_factor']:.2f}, "
                                     f"D x{run['decode_factor']:.2f}")
        write(result, args.out)  # after every run: a run cut short keeps what it measured
    write(result, args.out)
    print(json.dumps(result, indent=1))
    return result


def write(result: dict[str, Any], out: Path | None) -> None:
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "pd_overlap.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
