"""The check against real replays runs end to end on CPU (its timings are the host's, so only
their consistency is asserted here; the figures are in docs)."""
import pytest
import torch

from megatron_rollout.engine import EngineConfig
from megatron_rollout.model.checkpoint import load_model
from megatron_rollout.sim.check import check
from megatron_rollout.trace.make import make_trace


def test_check_fits_simulates_and_compares():
    torch.manual_seed(0)
    model = load_model("tiny-moe", device="cpu")
    configs = [EngineConfig(schedule=s, num_blocks=512) for s in ("off", "chunked")]
    fit_trace, test_trace = make_trace(2, 1, 0.01), make_trace(2, 2, 0.01)
    costs, results = check(model, configs, fit_trace, test_trace, warmup=make_trace(1, 0, 0.01), rounds=1)
    assert len(costs) == 1 and [r.schedule for r in results] == ["off", "chunked"]
    for r in results:
        assert len(r.test_real_s) == len(r.test_sim_s) == len(r.errors) == 1
        assert r.errors[0] == pytest.approx(r.test_sim_s[0] / r.test_real_s[0] - 1)
        assert r.test_error == r.errors[0]
        assert 0 < r.lower_bound_s[0] <= r.test_sim_s[0] + 1e-9 and r.lower_bound_s[0] <= r.oracle_s[0] + 1e-9
        # every turn's tool wait is in both the real and the simulated makespan
        conversations = {t.conversation for t in test_trace}
        waits = max(sum(t.wait_ms for t in test_trace if t.conversation == c) for c in conversations)
        assert r.test_real_s[0] >= waits / 1e3 and r.test_sim_s[0] >= waits / 1e3
