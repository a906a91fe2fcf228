"""`bench.micro.prefill`'s bookkeeping without CUDA: which path each figure times (CPU)."""
import types

import numpy as np
import pytest

pytest.importorskip("torch")

from megatron_rollout.bench import micro  # noqa: E402
from megatron_rollout.bench.bounds import model_costs  # noqa: E402
from megatron_rollout.engine.config import RunnerConfig  # noqa: E402
from megatron_rollout.model.config import PRESETS  # noqa: E402


class FakeRunner:
    """What `micro.prefill` reads off a CudaRunner; each forward records the buckets it ran with."""

    def __init__(self) -> None:
        self.cfg = PRESETS["tiny-moe"]
        self.cache = types.SimpleNamespace(block_size=16, num_blocks=4096)
        self.config = RunnerConfig(prefill_graph_tokens=(64, 4096))
        self.runs: list[tuple[int, ...]] = []

    def _prefill_bucket(self, inputs):
        n = sum(i.span.new for i in inputs)
        return next((b for b in self.config.prefill_graph_tokens if b >= n), None)

    def forward(self, inputs, phase):
        self.runs.append(self.config.prefill_graph_tokens)
        return iter(())


def test_eager_figure_runs_without_buckets_and_the_device_figure_is_held(monkeypatch):
    holds = []

    def fake_time_cuda(fn, iters=20, warmup=3, stream=None, hold_cycles=0):
        for _ in range(warmup + iters):
            fn()
        holds.append(hold_cycles)
        return 0.002 if hold_cycles else 0.003

    monkeypatch.setattr(micro, "time_cuda", fake_time_cuda)
    runner = FakeRunner()
    costs = model_costs(runner.cfg)
    rows = micro.prefill(runner, costs, 1e12, [[(0, 4096)], [(0, 8192)]], np.random.default_rng(0), iters=3)
    piecewise, eager = rows
    assert piecewise["mode"] == "piecewise" and eager["mode"] == "eager"
    assert piecewise["ms"] == pytest.approx(3.0) and piecewise["device_ms"] == pytest.approx(2.0)
    assert piecewise["eager_ms"] == pytest.approx(2.0) and "eager_ms" not in eager
    assert piecewise["compiles"] == 0
    # the eager figure ran with the buckets off, and the runner got its buckets back
    assert () in runner.runs and runner.config.prefill_graph_tokens == (64, 4096)
    h = micro.PREFILL_HOLD_CYCLES  # per spec: warm-up, as run, held; piecewise: eager warm-up, eager held
    assert holds == [0, 0, h, 0, h, 0, 0, h]
