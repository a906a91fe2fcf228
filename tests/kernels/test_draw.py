"""The one-launch draw (`kernels.draw`) against the sampler's eager path, on the GPU and in Triton's
interpreter: the same greedy tokens, the same inverse-CDF tokens at the same uniforms (except a
target within rounding of a boundary), the raw softmax's logprobs, the row's max, NaN rows flagged."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_rollout.engine.api import SamplingParams
from megatron_rollout.engine.sampler import PendingDraw, filtered_logprobs, inverse_cdf
from megatron_rollout.kernels import draw, fused

pytestmark = pytest.mark.timeout(300)

_INTERPRET = fused.interpreting() and fused.triton_available()
DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
           pytest.param("cpu", marks=[pytest.mark.interpret,
                                      pytest.mark.skipif(not _INTERPRET, reason="needs TRITON_INTERPRET=1 and triton")],
                        id="interpret")]
NEG = float("-inf")


def _logits(rows: int, vocab: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rows * 7919 + vocab)
    x = torch.randn(rows, vocab, generator=gen) * 4
    x[rows // 3:, vocab // 2 + 1:] = NEG  # masked tails
    x[-1, :] = NEG
    x[-1, vocab // 3] = 2.0  # one token left
    return x.to(device, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rows,vocab", [(1, 5), (3, draw.BLOCK + 17), (16, 3 * draw.BLOCK - 1)])
def test_the_kernel_draws_what_the_eager_path_draws(device, dtype, rows, vocab):
    logits = _logits(rows, vocab, device, dtype)
    raw = logits.float().log_softmax(-1).cpu()
    u = torch.rand(rows, generator=torch.Generator().manual_seed(vocab))
    u[0] = 0.0
    for uniforms in (None, u):
        tokens, packed = draw.draw(logits, None if uniforms is None else uniforms.to(device))
        packed = packed.cpu()
        want = raw.argmax(-1) if uniforms is None else inverse_cdf(raw, u)
        if uniforms is None:
            assert torch.equal(tokens.cpu(), want)
        else:  # away from rounding of a boundary, the token the flat search picks; always one of mass
            cdf = raw.double().exp().cumsum(-1)
            clear = ((cdf - u.double()[:, None] * cdf[:, -1:]).abs() > 1e-5).all(-1)
            assert clear.sum() >= rows - 1
            assert torch.equal(tokens.cpu()[clear], want[clear])
            assert torch.isfinite(raw.gather(-1, tokens.cpu()[:, None])).all()
        assert torch.equal(packed[rows:2 * rows].long(), tokens.cpu())
        torch.testing.assert_close(packed[:rows], logits.float().amax(-1).cpu())
        torch.testing.assert_close(packed[2 * rows:], raw.gather(-1, tokens.cpu()[:, None])[:, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_rows_are_flagged_and_stay_in_range(device):
    logits = _logits(4, 300, device, torch.float32)
    logits[0, 7] = float("nan")
    logits[1, :] = NEG
    logits[2, 5] = float("inf")
    for u in (None, torch.full((4,), 0.5, device=device)):
        tokens, packed = draw.draw(logits, u)
        packed = packed.cpu()
        assert math.isnan(packed[0]) and packed[1] == NEG and packed[2] == math.inf
        assert ((tokens >= 0) & (tokens < 300)).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_pending_draw_takes_one_launch_for_one_law(device, temperature):
    """A batch of one law, greedy or at temperature 1, unfiltered: one launch, the results of the
    eager path (greedy: the same; sampled: the same uniforms, so the same tokens off boundaries);
    another law or a mixed batch stays eager."""
    logits = _logits(6, 1000, device, torch.bfloat16)
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(6)]

    def results(gens_seed: int):
        gens = [torch.Generator().manual_seed(gens_seed + i) for i in range(6)]
        return PendingDraw(logits, params, gens).result(range(6))

    before = draw.LAUNCHES["draw"]
    fast = results(0)
    assert draw.LAUNCHES["draw"] == before + 1
    gens = [torch.Generator().manual_seed(i) for i in range(6)]
    raw = logits.float().log_softmax(-1).cpu()
    if temperature == 0.0:
        want = raw.argmax(-1)
    else:
        want = inverse_cdf(filtered_logprobs(logits.cpu(), params[0]), torch.cat([torch.rand(1, generator=g)
                                                                                   for g in gens]))
    assert [s.token for s in fast[:-1]] == want[:-1].tolist()
    assert fast[-1].token == 1000 // 3  # the one token left
    for i, s in enumerate(fast):
        assert s.ok and s.logprob == pytest.approx(raw[i, s.token].item(), abs=1e-5)
    mixed = [SamplingParams(temperature=1.0 - temperature), *params[1:]]  # the other law on one row
    filtered = [SamplingParams(temperature=temperature or 1.0, top_k=5)] * 6
    for other in (mixed, filtered):
        PendingDraw(logits, other, [torch.Generator().manual_seed(i) for i in range(6)]).result(range(6))
    assert draw.LAUNCHES["draw"] == before + 1


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_ties_take_the_first_index(device):
    """Equal maxima within a block and in two blocks: the first index, as torch's argmax."""
    logits = torch.zeros(2, 2 * draw.BLOCK + 5)
    logits[0, [9, 3, draw.BLOCK + 1]] = 5.0
    logits[1, [draw.BLOCK + 2, 2 * draw.BLOCK + 1]] = 5.0
    tokens, _ = draw.draw(logits.to(device), None)
    assert tokens.tolist() == [3, draw.BLOCK + 2] == logits.argmax(-1).tolist()
