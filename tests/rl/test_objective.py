import math

import pytest
import torch

from rl.objective import LossConfig, aggregate, entropy_from_logits, policy_loss

LN2 = math.log(2)


def _ppo_case():
    # ratios vs old = 0: [[1.5, 0.5], [1.1, 1.0]]; advantages [+1, -1]
    lp = torch.tensor([[math.log(1.5), math.log(0.5)], [math.log(1.1), 0.0]], requires_grad=True)
    return lp, torch.zeros(2, 2), torch.tensor([1.0, -1.0])


def test_ppo_clip_symmetric_values_and_grads():
    lp, old, adv = _ppo_case()
    out = policy_loss(LossConfig(clip_low=0.2, clip_high=0.2), lp, adv, torch.ones(2, 2), old_logprobs=old)
    # per token: -min(1.5, 1.2) = -1.2 (clipped), -min(0.5, 0.8) = -0.5, -min(-1.1, -1.1) = 1.1, 1.0
    assert out.loss.item() == pytest.approx((-1.2 - 0.5 + 1.1 + 1.0) / 4, abs=1e-6)
    assert out.metrics["clip_fraction"] == pytest.approx(0.25)
    assert out.metrics["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 1.0) / 4, abs=1e-6)
    out.loss.backward()
    # d/dlp of -ratio*A/4 = -ratio*A/4; the clipped token has no gradient
    assert lp.grad.flatten().tolist() == pytest.approx([0.0, -0.125, 0.275, 0.25], abs=1e-6)


def test_ppo_clip_high_asymmetric():
    lp, old, adv = _ppo_case()
    out = policy_loss(LossConfig(clip_low=0.2, clip_high=0.6), lp, adv, torch.ones(2, 2), old_logprobs=old)
    assert out.loss.item() == pytest.approx((-1.5 - 0.5 + 1.1 + 1.0) / 4, abs=1e-6)
    assert out.metrics["clip_fraction"] == 0.0


def test_ppo_clip_low_on_negative_advantage():
    lp = torch.tensor([[math.log(0.5), math.log(0.9)]])
    cfg = LossConfig(clip_low=0.2, clip_high=0.2)
    out = policy_loss(cfg, lp, torch.tensor([-1.0]), torch.ones(1, 2), old_logprobs=torch.zeros(1, 2))
    # -min(-0.5, -0.8) = 0.8 (clipped at 1 - 0.2); -min(-0.9, -0.9) = 0.9
    assert out.loss.item() == pytest.approx((0.8 + 0.9) / 2, abs=1e-6)
    assert out.metrics["clip_fraction"] == pytest.approx(0.5)
    wide = policy_loss(LossConfig(clip_low=0.6), lp, torch.tensor([-1.0]), torch.ones(1, 2),
                       old_logprobs=torch.zeros(1, 2))
    assert wide.loss.item() == pytest.approx((0.5 + 0.9) / 2, abs=1e-6)


def test_token_vs_sequence_aggregation():
    lp, old, adv = _ppo_case()
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    tok = policy_loss(LossConfig(aggregation="token"), lp, adv, mask, old_logprobs=old)
    seq = policy_loss(LossConfig(aggregation="sequence"), lp, adv, mask, old_logprobs=old)
    assert tok.loss.item() == pytest.approx((-1.2 - 0.5 + 1.1) / 3, abs=1e-6)
    assert seq.loss.item() == pytest.approx(((-1.2 - 0.5) / 2 + 1.1) / 2, abs=1e-6)
    assert tok.metrics["tokens"] == 3.0


def test_sequence_aggregation_skips_empty_rows():
    v = torch.tensor([[2.0, 4.0], [100.0, 100.0]])
    assert aggregate(v, torch.tensor([[1.0, 1.0], [0.0, 0.0]]), "sequence").item() == pytest.approx(3.0)


def test_default_old_is_ratio_one():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    out = policy_loss(LossConfig(), lp, torch.tensor([2.0]), torch.ones(1, 2))
    assert out.loss.item() == pytest.approx(-2.0)
    out.loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx([-1.0, -1.0])  # d(-ratio*A)/dlp / 2 tokens


def test_k3_kl():
    lp = torch.zeros(1, 2, requires_grad=True)
    ref = torch.tensor([[LN2, 0.0]])
    out = policy_loss(LossConfig(kl_coef=0.5), lp, torch.zeros(1), torch.ones(1, 2), ref_logprobs=ref)
    k3 = 2 - LN2 - 1
    assert out.metrics["kl"] == pytest.approx(k3 / 2, abs=1e-6)
    assert out.loss.item() == pytest.approx(0.5 * k3 / 2, abs=1e-6)
    out.loss.backward()
    # d k3/d lp = 1 - exp(ref - lp) -> 1 - 2 = -1 on the first token; times 0.5 / 2 tokens
    assert lp.grad.flatten().tolist() == pytest.approx([-0.25, 0.0], abs=1e-6)


def test_entropy_bonus():
    lp = torch.zeros(1, 2)
    ent = torch.tensor([[1.0, 2.0]])
    out = policy_loss(LossConfig(entropy_coef=0.1), lp, torch.zeros(1), torch.ones(1, 2), entropy=ent)
    assert out.loss.item() == pytest.approx(-0.15)
    assert out.metrics["entropy"] == pytest.approx(1.5)


def test_truncated_importance_sampling():
    lp = torch.zeros(1, 2, requires_grad=True)
    old = torch.zeros(1, 2)
    rollout = torch.tensor([[-LN2, LN2]])  # raw weights exp(old - rollout) = [2, 0.5]
    cfg = LossConfig(tis_cap=1.5)
    out = policy_loss(cfg, lp, torch.tensor([1.0]), torch.ones(1, 2), old_logprobs=old, rollout_logprobs=rollout)
    assert out.loss.item() == pytest.approx((-1.5 - 0.5) / 2, abs=1e-6)
    assert out.metrics["tis_weight_mean"] == pytest.approx(1.0, abs=1e-6)
    assert out.metrics["tis_clip_fraction"] == pytest.approx(0.5)
    assert out.metrics["rollout_abs_diff"] == pytest.approx(LN2, abs=1e-6)
    out.loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx([-0.75, -0.25], abs=1e-6)
    off = policy_loss(LossConfig(), lp, torch.tensor([1.0]), torch.ones(1, 2), old_logprobs=old,
                      rollout_logprobs=rollout)
    assert off.loss.item() == pytest.approx(-1.0)


def test_all_terms_compose():
    lp, old, adv = _ppo_case()
    ref = torch.full((2, 2), -0.3)
    ent = torch.tensor([[0.5, 1.0], [1.5, 2.0]])
    cfg = LossConfig(clip_low=0.2, clip_high=0.3, kl_coef=0.05, entropy_coef=0.01, tis_cap=2.0)
    out = policy_loss(cfg, lp, adv, torch.ones(2, 2), old_logprobs=old, rollout_logprobs=old - 0.1,
                      ref_logprobs=ref, entropy=ent)
    m = out.metrics
    assert out.loss.item() == pytest.approx(m["pg_loss"] + 0.05 * m["kl"] - 0.01 * m["entropy"], abs=1e-6)
    # every weight is exp(0.1); pg per token -min(1.5,1.3), -0.5, 1.1, 1.0
    assert m["pg_loss"] == pytest.approx(math.exp(0.1) * (-1.3 - 0.5 + 1.1 + 1.0) / 4, abs=1e-6)


def test_missing_inputs_and_bad_config():
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(LossConfig(kl_coef=0.1), lp, torch.zeros(1), torch.ones(1, 2))
    with pytest.raises(ValueError, match="rollout_logprobs"):
        policy_loss(LossConfig(tis_cap=2.0), lp, torch.zeros(1), torch.ones(1, 2))
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(LossConfig(entropy_coef=0.1), lp, torch.zeros(1), torch.ones(1, 2))
    with pytest.raises(ValueError, match="shape"):
        policy_loss(LossConfig(), lp, torch.zeros(1), torch.ones(1, 2), rollout_logprobs=torch.zeros(1, 3))
    for bad in (dict(clip_low=1.0), dict(clip_high=-0.1), dict(kl_coef=-1), dict(aggregation="seq"),
                dict(tis_cap=0.0)):
        with pytest.raises(ValueError):
            LossConfig(**bad)


def test_entropy_from_logits():
    ent = entropy_from_logits(torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]))
    assert ent.tolist() == pytest.approx([math.log(4), 0.0], abs=1e-5)
