"""`benchmarks.micro.prefill`'s bookkeeping without CUDA: which path each figure times (CPU)."""
import types

import numpy as np
import pytest

pytest.importorskip("torch")

from benchmarks import micro  # noqa: E402
from benchmarks.bounds import model_costs  # noqa: E402
from megatron_rollout.engine.config import RunnerConfig  # noqa: E402
from megatron_rollout.engine.cuda_runner import CudaRunner  # noqa: E402
from megatron_rollout.model.config import PRESETS  # noqa: E402


class FakeRunner:
    """What `micro.prefill` reads off a CudaRunner; each forward records the buckets it ran with."""

    def __init__(self) -> None:
        self.cfg = PRESETS["tiny-moe"]
        self.cache = types.SimpleNamespace(block_size=16, num_blocks=4096)
        self.config = RunnerConfig(prefill_graph_tokens=(64, 4096))
        self.runs: list[tuple[int, ...]] = []

    def prefill_bucket(self, inputs):
        n = sum(i.span.new for i in inputs)
        return next((b for b in self.config.prefill_graph_tokens if b >= n), None)

    configured, PER_FORWARD_SETTINGS = CudaRunner.configured, CudaRunner.PER_FORWARD_SETTINGS

    def forward(self, inputs, phase):
        self.runs.append(self.config.prefill_graph_tokens)
        return iter(())


def test_figures_interleave_and_the_eager_one_runs_without_buckets(monkeypatch):
    timings = []  # (hold, buckets the runner had during the timed calls) per timing

    def fake_time_cuda(fn, iters=20, warmup=3, stream=None, hold_cycles=0):
        start = len(runner.runs)
        for _ in range(warmup + iters):
            fn()
        timings.append((hold_cycles, set(runner.runs[start:])))
        return {0: 0.003, micro.PREFILL_HOLD_CYCLES: 0.002}[hold_cycles] + 0.001 * (() in runner.runs[start:])

    monkeypatch.setattr(micro, "time_cuda", fake_time_cuda)
    runner = FakeRunner()
    costs = model_costs(runner.cfg)
    rows = micro.prefill(runner, costs, 1e12, [[(0, 4096)], [(0, 8192)]], np.random.default_rng(0), iters=2,
                         rounds=3)
    piecewise, eager = rows
    assert piecewise["mode"] == "piecewise" and eager["mode"] == "eager"
    assert piecewise["ms"] == pytest.approx(3.0) and piecewise["device_ms"] == pytest.approx(2.0)
    assert piecewise["eager_ms"] == pytest.approx(3.0) and "eager_ms" not in eager  # buckets off: the slower path
    assert piecewise["device_ms_range"] == pytest.approx([2.0, 2.0]) and piecewise["rounds"] == 3
    assert piecewise["compiles"] == 0
    h, buckets = micro.PREFILL_HOLD_CYCLES, (64, 4096)
    # rounds interleave the variants: held as run, free as run, held with the buckets off; then the
    # eager-only spec: held, free
    assert timings == [(h, {buckets}), (0, {buckets}), (h, {()})] * 3 + [(h, {buckets}), (0, {buckets})] * 3
    assert runner.config.prefill_graph_tokens == buckets  # the runner got its buckets back
