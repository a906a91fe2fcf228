"""MTP drafting with same-forward verification on a tiny DeepSeek-V3: temperature-0 tokens equal
plain greedy decoding (with drafts rejected, and with drafts accepted), and the logprobs returned
at temperature > 0 are the target model's."""
from __future__ import annotations

import pytest
import torch

from megatron_rollout.engine import EngineConfig, RolloutEngine, SamplingParams
from megatron_rollout.engine.mtp_decode import generate_with_mtp
from megatron_rollout.model import checkpoint as ckpt
from megatron_rollout.model.sharding import full_shapes
from megatron_rollout.model.transformer import MoETransformer
from tests.model.test_deepseek import deepseek_config

CFG = ckpt.config_from_hf(deepseek_config("yarn-grouped")).replace(mtp_num_layers=1, vocab_size=12)
PROMPTS = [[1, 2, 3, 4, 5], [7], [3, 3, 9, 0, 11, 2, 6]]
STEPS = 24


def model(seed: int = 0) -> MoETransformer:
    return MoETransformer(CFG).init_weights(seed=seed, std=0.3)


def plain_greedy(m: MoETransformer) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_new_tokens=STEPS, ignore_stop=True)
    return [r.token_ids for r in RolloutEngine(m, EngineConfig(block_size=4)).generate(PROMPTS, params)]


def test_mtp_parameters_have_megatron_names():
    names = set(model().state_dict())
    assert names == set(full_shapes(CFG))
    assert {"mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
            "mtp.layers.0.final_layernorm.weight", "mtp.layers.0.transformer_layer.mlp.router.expert_bias",
            "mtp.layers.0.transformer_layer.self_attention.linear_kv_up_proj.weight"} <= names
    assert full_shapes(CFG)["mtp.layers.0.eh_proj.weight"] == (CFG.hidden_size, 2 * CFG.hidden_size)


def test_greedy_tokens_equal_plain_greedy_with_rejected_drafts():
    m = model()
    want = plain_greedy(m)
    got = [generate_with_mtp(m, p, SamplingParams(temperature=0.0), STEPS, block_size=4) for p in PROMPTS]
    assert [g.token_ids for g in got] == want
    assert sum(g.drafted for g in got) > 0 and all(len(g.logprobs) == STEPS for g in got)


def test_greedy_tokens_equal_plain_greedy_with_accepted_drafts():
    """Zeroed final norms: target and MTP both see all-zero logits and pick token 0, so every draft
    is accepted and each iteration emits two tokens."""
    m = model()
    with torch.no_grad():
        m.decoder.final_layernorm.weight.zero_()
        m.mtp.layers[0].final_layernorm.weight.zero_()
    want = plain_greedy(m)
    got = [generate_with_mtp(m, p, SamplingParams(temperature=0.0), STEPS, block_size=4) for p in PROMPTS]
    assert [g.token_ids for g in got] == want == [[0] * STEPS] * len(PROMPTS)
    assert all(g.acceptance == 1.0 and g.drafted == STEPS // 2 for g in got)


@pytest.mark.parametrize("seed", [0, 1])
def test_sampled_logprobs_are_the_targets(seed):
    m = model(seed)
    prompt = PROMPTS[0]
    g = generate_with_mtp(m, prompt, SamplingParams(temperature=1.0), STEPS,
                          generator=torch.Generator().manual_seed(seed), block_size=4)
    with torch.no_grad():
        teacher = m.token_logprobs(torch.tensor([prompt + g.token_ids]))[0, len(prompt) - 1:]
    assert torch.allclose(torch.tensor(g.logprobs), teacher, atol=1e-4)
    assert g.drafted > 0


def test_needs_an_mtp_layer():
    with pytest.raises(ValueError, match="no MTP layer"):
        generate_with_mtp(MoETransformer(CFG.replace(mtp_num_layers=0)), [1], SamplingParams(), 3)


@pytest.mark.timeout(600)  # 1,000 sequential MTP generations: a minute or two on a loaded machine
def test_sampled_distribution_with_mtp_is_the_plain_samplers():
    """Three tokens after one prompt, over a 4-token vocabulary: MTP-drafted sampling against the
    engine's plain sampler (chi-square contingency) and against the exact law (goodness of fit)."""
    import itertools

    stats = pytest.importorskip("scipy.stats")
    m = MoETransformer(CFG.replace(vocab_size=4)).init_weights(seed=2, std=0.3)
    prompt, n, params = [1, 2, 3], 1000, SamplingParams(temperature=1.0, max_new_tokens=3, ignore_stop=True)
    cells = list(itertools.product(range(4), repeat=3))
    with torch.no_grad():
        logp = m.token_logprobs(torch.tensor([prompt + list(c) for c in cells]))[:, len(prompt) - 1:]
    law = logp.sum(-1).double().exp()
    gen = torch.Generator().manual_seed(3)
    mtp_runs = [generate_with_mtp(m, prompt, params, 3, generator=gen, block_size=4) for _ in range(n)]
    plain = RolloutEngine(m, EngineConfig(block_size=4, seed=4)).generate([prompt] * n, params)
    count = {"mtp": [0] * len(cells), "plain": [0] * len(cells)}
    for kind, runs in (("mtp", [r.token_ids for r in mtp_runs]), ("plain", [r.token_ids for r in plain])):
        for tokens in runs:
            count[kind][cells.index(tuple(tokens))] += 1
    accepted = sum(r.accepted for r in mtp_runs) / sum(r.drafted for r in mtp_runs)
    assert 0.05 < accepted < 0.95, accepted  # both accepted and rejected drafts are exercised
    expected = (law / law.sum() * n).tolist()
    assert stats.chisquare(count["mtp"], expected).pvalue > 1e-3
    assert stats.chisquare(count["plain"], expected).pvalue > 1e-3
    seen = [i for i in range(len(cells)) if count["mtp"][i] + count["plain"][i]]
    assert stats.chi2_contingency([[count[k][i] for i in seen] for k in ("mtp", "plain")]).pvalue > 1e-3
