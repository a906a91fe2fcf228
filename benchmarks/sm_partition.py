"""SM partitions for prefill and decode on one GPU, four ways, and where their work lands.

    python -m benchmarks.sm_partition --splits 100/32,108/24 --out benchmarks/results/pd-overlap

A partition pair gives the prefill phase (P) and the decode phase (D) a stream each:
- `driver`: the CUDA driver's green contexts, made disjoint by construction. The device's SM
  resource is split once (`cuDevSmResourceSplitByCount`): one group of the decode SM count
  (rounded up by the driver to its granularity) and the remainder; each becomes a green context
  (`cuDevResourceGenerateDesc`, `cuGreenCtxCreate`) with a stream (`cuGreenCtxStreamCreate`)
  wrapped as a `torch.cuda.ExternalStream` (`runner.partition`, through ctypes on libcuda).
- `held`: what the CUDA runner does with `RunnerConfig.decode_sms`: P on a green context of the
  device minus the decode count, D on an ordinary high-priority stream over every SM.
- `torch`: `torch.cuda.green_contexts.GreenContext.create(num_sms=...)` once per phase. Each call
  carves its SMs out of the whole device on its own, knowing nothing of the other, so the two
  sets need not be disjoint: the probe below says whether they are.
- `streams`: two ordinary streams, no partition (both phases may use every SM).

The probe is a Triton kernel whose programs record the SM they ran on (`%smid`), launched eagerly
and from a CUDA graph captured on the partition's stream (decode runs from graphs). The copy probe
times a device-to-device copy on a decode partition of each size: what a bandwidth-bound phase can
pull through that many SMs. Written to `<out>/sm_partition.json` (and printed). Left out: more than
two partitions, workqueue settings, and partitions that change while work runs.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.ceilings import time_cuda
from megatron_rollout.runner.partition import partition_streams

METHODS = ("driver", "held", "torch", "streams")
COPY_SMS = (8, 16, 32, 64)

@dataclass(frozen=True)
class Split:
    """SMs asked for the prefill and the decode partition (`--splits` entries read `P/D`)."""

    prefill_sms: int
    decode_sms: int

    def __post_init__(self) -> None:
        for name in ("prefill_sms", "decode_sms"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"Split.{name} must be a positive int, got {value!r}")

    @property
    def label(self) -> str:
        return f"{self.prefill_sms}/{self.decode_sms}"


def parse_splits(text: str) -> list[Split]:
    """'100/32,108/24' -> [Split(100, 32), Split(108, 24)]."""
    splits = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        parts = item.split("/")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise ValueError(f"a split reads PREFILL_SMS/DECODE_SMS (e.g. 108/24), got {item!r}")
        splits.append(Split(int(parts[0]), int(parts[1])))
    if not splits:
        raise ValueError(f"--splits names no split: {text!r}")
    return splits


@dataclass(frozen=True)
class Partition:
    """One phase's stream and the SMs its partition holds (None: not partitioned)."""

    stream: torch.cuda.Stream
    sms: int | None


@dataclass(frozen=True)
class PartitionPair:
    prefill: Partition
    decode: Partition


@contextmanager
def driver_pair(decode_sms: int, device: torch.device) -> Iterator[PartitionPair]:
    """Disjoint P and D partitions: D gets `decode_sms` (rounded up by the driver), P the rest."""
    p, d = partition_streams(decode_sms, device, decode_too=True)
    try:
        yield PartitionPair(Partition(p.stream, p.sms), Partition(d.stream, d.sms))
    finally:
        torch.cuda.synchronize(device)
        p.close()
        d.close()


@contextmanager
def held_pair(decode_sms: int, device: torch.device) -> Iterator[PartitionPair]:
    """What the CUDA runner does with `RunnerConfig.decode_sms`: P on the device minus `decode_sms`
    SMs, D on an ordinary high-priority stream over the whole device."""
    p, _ = partition_streams(decode_sms, device, decode_too=False)
    try:
        yield PartitionPair(Partition(p.stream, p.sms), Partition(torch.cuda.Stream(device, priority=-1), None))
    finally:
        torch.cuda.synchronize(device)
        p.close()


@contextmanager
def partitions(method: str, split: Split, device: torch.device) -> Iterator[PartitionPair]:
    """The P and D streams of `method` (module docstring) for `split`."""
    if method == "driver":
        with driver_pair(split.decode_sms, device) as pair:
            yield pair
    elif method == "held":
        with held_pair(split.decode_sms, device) as pair:
            yield pair
    elif method == "torch":
        from torch.cuda.green_contexts import GreenContext

        index = device.index or 0
        p_ctx = GreenContext.create(num_sms=split.prefill_sms, device_id=index)
        d_ctx = GreenContext.create(num_sms=split.decode_sms, device_id=index)
        yield PartitionPair(Partition(p_ctx.Stream(), split.prefill_sms), Partition(d_ctx.Stream(), split.decode_sms))
        torch.cuda.synchronize(device)
    elif method == "streams":
        yield PartitionPair(Partition(torch.cuda.Stream(device), None), Partition(torch.cuda.Stream(device), None))
    else:
        raise ValueError(f"unknown partition method {method!r}: one of {', '.join(METHODS)}")


def _smid_kernel():
    """The Triton probe, built on first use (Triton is there only on GPU machines)."""
    import triton
    import triton.language as tl

    @triton.jit
    def smid(out_ptr, scratch_ptr, spin: tl.constexpr):
        pid = tl.program_id(0)
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        acc = pid
        for _ in range(spin):  # a little work, so that programs spread over every SM they may use
            acc = acc * 1103515245 + 12345
        tl.store(scratch_ptr + pid, acc)
        tl.store(out_ptr + pid, sm)

    return smid


def sm_ids(stream: torch.cuda.Stream, graph: bool = False, programs: int = 8192) -> list[int]:
    """The sorted SM ids that a `programs`-wide probe launched on `stream` ran on (eagerly, or
    replayed from a graph captured on `stream`)."""
    kernel = _smid_kernel()
    out = torch.full((programs,), -1, dtype=torch.int32, device=stream.device)
    scratch = torch.empty_like(out)
    with torch.cuda.stream(stream):
        kernel[(programs,)](out, scratch, spin=256, num_warps=1)  # compiled and warm before any capture
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                kernel[(programs,)](out, scratch, spin=256, num_warps=1)
            out.fill_(-1)
            g.replay()
    stream.synchronize()
    return sorted(set(out.tolist()))


def probe(method: str, split: Split, device: torch.device) -> dict[str, Any]:
    """Which SMs each phase's eager and graphed work lands on, and how many both share."""
    with partitions(method, split, device) as pair:
        sets = {phase: {"eager": sm_ids(part.stream), "graph": sm_ids(part.stream, graph=True), "sms": part.sms}
                for phase, part in (("prefill", pair.prefill), ("decode", pair.decode))}
    shared = set(sets["prefill"]["eager"]) & set(sets["decode"]["eager"])
    return {"method": method, "split": split.label,
            **{f"{phase}_sms": s["sms"] for phase, s in sets.items()},
            **{f"{phase}_{how}": len(s[how]) for phase, s in sets.items() for how in ("eager", "graph")},
            "shared_sms": len(shared), "graph_same_as_eager": all(s["eager"] == s["graph"] for s in sets.values()),
            "sm_ids": {phase: s["eager"] for phase, s in sets.items()}}


def copy_bandwidth_on(stream: torch.cuda.Stream, nbytes: int = 1 << 30) -> float:
    """Bytes read plus written per second by a device-to-device copy on `stream`."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=stream.device).normal_()
    dst = torch.empty_like(src)
    torch.cuda.synchronize(stream.device)
    return 2 * nbytes / time_cuda(lambda: dst.copy_(src), iters=10, stream=stream)


def copy_by_partition(device: torch.device, sizes: tuple[int, ...] = COPY_SMS) -> list[dict[str, Any]]:
    """Copy bandwidth on a driver decode partition of each size, then on the whole device."""
    rows = []
    for sms in sizes:
        with driver_pair(sms, device) as pair:
            rows.append({"sms": pair.decode.sms, "gb_s": copy_bandwidth_on(pair.decode.stream) / 1e9})
    whole = torch.cuda.get_device_properties(device).multi_processor_count
    rows.append({"sms": whole, "gb_s": copy_bandwidth_on(torch.cuda.current_stream(device)) / 1e9})
    return rows


def cuda_python_importable() -> bool:
    """Whether cuda-python's driver bindings import here (the ctypes path does not need them)."""
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--splits", default="108/24,112/16", help="P/D SM counts, comma-separated")
    parser.add_argument("--methods", default="driver,torch", help=f"of {','.join(METHODS)}")
    parser.add_argument("--no-copy", action="store_true", help="skip the copy bandwidth per partition size")
    parser.add_argument("--out", type=Path, default=None, help="folder for sm_partition.json")
    args = parser.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device())
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                              "sms": torch.cuda.get_device_properties(device).multi_processor_count,
                              "cuda_python": cuda_python_importable(), "probes": []}
    for split in parse_splits(args.splits):
        for method in args.methods.split(","):
            result["probes"].append(probe(method, split, device))
    if not args.no_copy:
        result["copy"] = copy_by_partition(device)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sm_partition.json").write_text(text)
    return result


if __name__ == "__main__":
    main()
