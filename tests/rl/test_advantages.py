import math

import pytest
import torch

from rl.advantages import AdvantageConfig, grpo_advantages


def test_group_mean_and_sample_std():
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.tensor([0, 0, 1, 1]))
    s = 1 / (math.sqrt(0.5) + 1e-6)  # sample std of {1, 0} is sqrt(0.5)
    assert adv.values.tolist() == pytest.approx([0.5 * s, -0.5 * s, 0.0, 0.0], abs=1e-6)
    assert adv.keep.tolist() == [True, True, True, True]


def test_three_sample_group_and_interleaved_ids():
    adv = grpo_advantages(torch.tensor([2.0, 5.0, 0.0, 1.0, 9.0]), torch.tensor([7, 3, 7, 7, 3]))
    # group 7: {2, 0, 1} mean 1 std 1; group 3: {5, 9} mean 7 std sqrt(8)
    s3 = 2 / (math.sqrt(8) + 1e-6)
    assert adv.values.tolist() == pytest.approx([1 / (1 + 1e-6), -s3, -1 / (1 + 1e-6), 0.0, s3], abs=1e-6)


def test_without_std_division():
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.25, 0.75]), torch.tensor([0, 0, 1, 1]),
                          AdvantageConfig(scale_by_std=False))
    assert adv.values.tolist() == pytest.approx([0.5, -0.5, -0.25, 0.25])


def test_drop_uniform_groups():
    cfg = AdvantageConfig(drop_uniform_groups=True)
    adv = grpo_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.3, 0.3]), torch.tensor([0, 0, 1, 1, 2, 2]), cfg)
    assert adv.keep.tolist() == [False, False, True, True, False, False]
    assert adv.values[[0, 1, 4, 5]].abs().max() == 0


def test_single_sample_group_is_zero():
    adv = grpo_advantages(torch.tensor([0.7]), torch.tensor([0]))
    assert adv.values.tolist() == [0.0]


def test_bad_shapes_and_config():
    with pytest.raises(ValueError, match="equal 1-d shapes"):
        grpo_advantages(torch.tensor([1.0, 2.0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="eps"):
        AdvantageConfig(eps=0)
