"""Host cost of `kernels.pdl.options`, called at every Triton kernel launch, PDL on: the version that
read the environment at each call (commit d97c04c) against the one that caches each device's answer
(the working tree). 3 interleaved rounds of 200,000 calls each; no GPU on the CPU machine, so the
capability a Hopper device reports is stood in (both versions ask torch for it).

    PYTHONPATH=$PWD python benchmarks/results/2026-12-06-pdl-options-cpu/pdl_options.py > pdl_options.json
"""
import importlib.util
import json
import statistics
import subprocess
import tempfile
import timeit
from pathlib import Path

import torch

PATH = "megatron_rollout/kernels/pdl.py"


def load(name: str, source: str):
    file = Path(tempfile.mkdtemp()) / f"pdl_{name}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(f"pdl_{name}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.ENABLED = True
    return module


def main() -> dict:
    torch.cuda.get_device_capability = lambda index=None: (9, 0)  # what a Hopper device reports
    versions = {"d97c04c": load("old", subprocess.run(["git", "show", f"d97c04c:{PATH}"], capture_output=True,
                                                        text=True, check=True).stdout),
                "tree": load("new", Path(PATH).read_text())}
    dev = torch.device("cuda", 0)
    assert all(m.options(dev)["PDL"] for m in versions.values())
    us: dict[str, list[float]] = {n: [] for n in versions}
    for _ in range(3):
        for name, module in versions.items():
            us[name].append(timeit.timeit(lambda: module.options(dev), number=200_000) / 200_000 * 1e6)
    return {name: {"median_us": statistics.median(xs), "min_us": min(xs), "max_us": max(xs), "rounds_us": xs}
            for name, xs in us.items()}


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
