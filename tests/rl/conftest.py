import copy

import pytest

from megatron_rollout.model.config import preset
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.tokenizer import ByteTokenizer


@pytest.fixture(scope="session")
def base_model() -> MoETransformer:
    return MoETransformer(preset("tiny-moe")).init_weights(0)


@pytest.fixture
def policy(base_model) -> MoETransformer:
    return copy.deepcopy(base_model)


@pytest.fixture(scope="session")
def tok() -> ByteTokenizer:
    return ByteTokenizer()
