"""What one turnstile rendezvous costs, on the store path and on the native shared-memory path.

    python -m benchmarks.rendezvous --ranks 8 --json

Spawns N CPU processes (gloo, TCP store on localhost), and on each path runs warm-up meetings,
then timed ones back to back. The figure per meeting is the period between consecutive
completions on each rank (what a rank pays per meeting in a tight loop, Python call included),
pooled over ranks: median, p10, p90. Prints one JSON object (`--json`) or a short table.

Why periods and not single call durations: a rank that arrives last waits for nobody, so its call
is short while the others' are long; the period is the same on every rank and is the real cost.
What it leaves out: the turnstile's own work between meetings and arrival skew from unequal D
iterations (then a meeting costs the wake-up latency of a sleeping rank, see docs/multi-gpu.md).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

from megatron_rollout.comm.shm_rendezvous import ShmBarrierConfig


def _periods_us(rdv, rounds: int, warmup: int) -> list[float]:
    for k in range(warmup):
        rdv.meet(0, k, "pre-D" if k % 2 else "post-D", (k,))
    stamps = [0] * (rounds + 1)
    clock = time.perf_counter_ns
    stamps[0] = clock()
    for k in range(rounds):
        rdv.meet(1, k, "pre-D" if k % 2 else "post-D", (k, 1))
        stamps[k + 1] = clock()
    return [(b - a) / 1e3 for a, b in zip(stamps, stamps[1:])]


def _rank(rank: int, n: int, port: int, args: dict, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if args["pin"]:  # rank r on CPU r mod cpus, as a launcher binding ranks to cores would
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                                timeout=timedelta(seconds=120))
        from megatron_rollout.comm.shm_rendezvous import NativeUnavailable
        from megatron_rollout.multiplex.native_rendezvous import make_rendezvous

        out: dict[str, Any] = {}
        store = make_rendezvous(timeout_s=60, name="bench-store", prefer="store")
        out["store"] = _periods_us(store, args["store_rounds"], args["warmup"])
        try:
            native = make_rendezvous(timeout_s=60, name="bench-native", prefer="native",
                                     config=args["config"])
            out["native"] = _periods_us(native, args["rounds"], args["warmup"])
        except NativeUnavailable as exc:
            out["native_error"] = str(exc)
        queue.put((rank, out))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))


def _spread(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=10)
    return {"median": statistics.median(values), "p10": q[0], "p90": q[-1], "min": min(values)}


def measure(ranks: int, rounds: int, store_rounds: int, warmup: int,
            config: ShmBarrierConfig = ShmBarrierConfig(), pin: bool = False) -> dict[str, Any]:
    """Run the benchmark on `ranks` processes; the JSON-ready summary."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = {"rounds": rounds, "store_rounds": store_rounds, "warmup": warmup, "config": config, "pin": pin}
    procs = [ctx.Process(target=_rank, args=(r, ranks, port, cfg, queue), daemon=True) for r in range(ranks)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=600) for _ in range(ranks))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = {r: v["error"] for r, v in results.items() if "error" in v}
    if errors:
        raise RuntimeError(f"benchmark ranks failed: {errors}")
    store = [x for v in results.values() for x in v["store"]]
    summary: dict[str, Any] = {"ranks": ranks, "rounds": rounds, "store_rounds": store_rounds, "warmup": warmup,
                               "spin_us": config.resolved(ranks)[0], "yield_us": config.yield_us, "pinned": pin,
                               "cpus": len(os.sched_getaffinity(0)), "host": socket.gethostname(),
                               "load_avg_1m": os.getloadavg()[0]}
    st = _spread(store)
    summary.update(store_us=st["median"], store_p10_us=st["p10"], store_p90_us=st["p90"])
    native_errors = [v["native_error"] for v in results.values() if "native_error" in v]
    if native_errors:
        summary.update(native_us=None, native_error=native_errors[0], speedup=None)
        return summary
    nt = _spread([x for v in results.values() for x in v["native"]])
    summary.update(native_us=nt["median"], native_p10_us=nt["p10"], native_p90_us=nt["p90"],
                   native_min_us=nt["min"], speedup=st["median"] / nt["median"])
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2, help="CPU processes that meet (default 2)")
    ap.add_argument("--rounds", type=int, default=20000, help="timed native meetings per rank (default 20000)")
    ap.add_argument("--store-rounds", type=int, default=500, help="timed store meetings per rank (default 500)")
    ap.add_argument("--warmup", type=int, default=200, help="untimed meetings first, per path (default 200)")
    ap.add_argument("--spin-us", type=float, default=None, help="native: busy-wait this long (default: auto)")
    ap.add_argument("--yield-us", type=float, default=None, help="native: then sched_yield this long (default: auto)")
    ap.add_argument("--pin", action="store_true", help="bind rank r to CPU r mod cpus (default: unbound)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args(argv)
    for name, least in (("ranks", 1), ("rounds", 2), ("store_rounds", 2), ("warmup", 0)):
        if getattr(a, name) < least:
            ap.error(f"--{name.replace('_', '-')} must be at least {least}, got {getattr(a, name)}")
    config = ShmBarrierConfig(a.spin_us, **({} if a.yield_us is None else {"yield_us": a.yield_us}))
    res = measure(a.ranks, a.rounds, a.store_rounds, a.warmup, config, a.pin)
    if a.json:
        print(json.dumps(res))
    else:
        native = "n/a: " + res["native_error"] if res["native_us"] is None else (
            f"{res['native_us']:.1f} us (p10 {res['native_p10_us']:.1f}, p90 {res['native_p90_us']:.1f}); "
            f"speedup {res['speedup']:.0f}x")
        print(f"{a.ranks} ranks: store {res['store_us']:.1f} us (p10 {res['store_p10_us']:.1f}, "
              f"p90 {res['store_p90_us']:.1f}); native {native}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
