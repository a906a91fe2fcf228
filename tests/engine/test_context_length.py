"""`max_model_len`: None means the model's positions, 0 and non-ints are refused, and a length beyond
the model's positions is refused unless `allow_long_context` says it is on purpose (random-weight
benchmarks)."""
from __future__ import annotations

import pytest

from megatron_rollout.engine import EngineConfig, KVConfig, RolloutEngine


@pytest.mark.parametrize("value", [0, -4, 2.5, True])
def test_non_positive_or_non_int_lengths_are_refused(value):
    with pytest.raises(ValueError, match=f"max_model_len must be a positive int or None, got {value!r}"):
        EngineConfig(max_model_len=value)


def test_none_is_the_model_length_and_longer_needs_the_flag(qwen):
    model = qwen[1]  # 128 positions
    assert RolloutEngine(model, EngineConfig(kv=KVConfig(num_blocks=8))).max_model_len == 128
    assert RolloutEngine(model, EngineConfig(kv=KVConfig(num_blocks=8), max_model_len=64)).max_model_len == 64
    with pytest.raises(ValueError, match=r"max_model_len 200 exceeds the model's 128 positions \(max_position_embed"
                                         r"dings\); lower it, or pass allow_long_context=True"):
        RolloutEngine(model, EngineConfig(kv=KVConfig(num_blocks=8), max_model_len=200))
    long = RolloutEngine(model, EngineConfig(kv=KVConfig(num_blocks=64), max_model_len=200, allow_long_context=True))
    assert long.max_model_len == 200
    result = long.generate([list(range(1, 90)) * 2], None)[0]  # 178 positions: beyond the model's 128
    assert result.error is None and len(result.token_ids) > 0
    with pytest.raises(ValueError, match="allow_long_context must be True or False, got 'yes'"):
        EngineConfig(allow_long_context="yes")
