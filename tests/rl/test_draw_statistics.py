"""The sampler's draws, as the GRPO loop issues them, follow their distributions independently.

Settles whether the inverse-CDF draw (one uniform per row from the request's own generator) is
wrong in a way that only learning would show: the audit (`draw_audit`) runs the loop's own
rollouts and tests every draw's PIT value, alone and in the pairs the loop couples (tokens of one
request, turns of one episode, members of one group, one episode slot across steps, rows of one
batch). The engine's eager draw, its one-launch kernel (`kernels.draw`, on CUDA or in Triton's
interpreter) and the `torch.multinomial` draw it replaced all pass; draws broken in each of those
ways are rejected, so the audit has the power to see them.
"""
import pytest
import torch

from megatron_rollout.kernels import draw, fused
from rl.loop import GRPOConfig
from tests.rl.draw_audit import audit, draw_functions, run_loop_draws, significant, smallest
from tests.rl.test_loop import TOOL_CONFIG

ALPHA = 1e-3  # per p-value; a correct draw's smallest of ~24 p-values is below it about 2% of the time,
# and the runs are seeded, so a pass or a fail here is the same on every run of one machine
_INTERPRET = fused.interpreting() and fused.triton_available()
# the kernel draws on CUDA when there is one (`draw_audit._kernel`), else on CPU in the interpreter
KERNEL = pytest.param("kernel", id="kernel", marks=pytest.mark.gpu if torch.cuda.is_available() else [
    pytest.mark.interpret, pytest.mark.skipif(not _INTERPRET, reason="needs CUDA, or TRITON_INTERPRET=1 and triton")])


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", ["ours", KERNEL, "multinomial"])
@pytest.mark.parametrize("sharpen", [1.0, 6.0])
@pytest.mark.timeout(600)
def test_draws_follow_their_distribution_independently(name, sharpen):
    cfg = GRPOConfig.from_yaml(TOOL_CONFIG)
    launches = draw.LAUNCHES["draw"]
    draws, slots = run_loop_draws(cfg, draw_functions[name], steps=8, sharpen=sharpen)
    assert len(draws) > 2500
    # what drew is the function audited: the kernel launched only when it is the one audited
    assert (draw.LAUNCHES["draw"] > launches) == (name == "kernel")
    results = audit(draws, slots)
    assert len(results) == 12  # the marginal and five pair kinds, in two vocabulary orders
    assert not significant(results, ALPHA), (smallest(results), results)


@pytest.mark.parametrize("name", ["shared_uniform", "biased", "turn_seeded"])
@pytest.mark.timeout(600)
def test_the_audit_rejects_broken_draws(name):
    cfg = GRPOConfig.from_yaml(TOOL_CONFIG)
    draws, slots = run_loop_draws(cfg, draw_functions[name], steps=4)
    assert significant(audit(draws, slots), ALPHA)
