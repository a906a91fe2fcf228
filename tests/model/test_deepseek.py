"""DeepSeek-V3 on CPU: parity with transformers' `DeepseekV3ForCausalLM` (tiny random checkpoints),
greedy tokens and logprobs through the engine's paged latent cache, lossless conversion both ways,
YaRN tables, the biased group-limited router, and clear refusals of what is not supported."""
from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from megatron_rollout.engine import EngineConfig, RolloutEngine, SamplingParams, SchedulerConfig
from megatron_rollout.kv.paged import PagedKVCache
from megatron_rollout.model import checkpoint as ckpt
from megatron_rollout.model.config import ModelConfig
from megatron_rollout.model.rope import rope_for
from megatron_rollout.model.router import ScoredRouter
from megatron_rollout.model.sharding import full_shapes
from megatron_rollout.model.transformer import MoETransformer
from tests.model.test_checkpoint import _prompts, max_logit_diff

V = 96


def deepseek_config(variant: str) -> transformers.DeepseekV3Config:
    """Two tiny DeepSeek-V3s that between them cover every option the import maps."""
    common = dict(vocab_size=V, hidden_size=32, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                  qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, moe_intermediate_size=16,
                  intermediate_size=48, n_routed_experts=8, rms_norm_eps=1e-6, max_position_embeddings=256,
                  attn_implementation="eager")
    if variant == "yarn-grouped":  # q low-rank, YaRN, 4 groups pick 2, first layer dense, renormalised
        return transformers.DeepseekV3Config(
            **common, num_hidden_layers=3, q_lora_rank=24, n_shared_experts=1, routed_scaling_factor=2.5,
            n_group=4, topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1, norm_topk_prob=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8,
                             "original_max_position_embeddings": 64})
    # one q projection, plain RoPE, no groups, every layer MoE, two shared experts, unnormalised weights
    return transformers.DeepseekV3Config(
        **common, num_hidden_layers=2, q_lora_rank=None, n_shared_experts=2, routed_scaling_factor=1.5,
        n_group=1, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=0, norm_topk_prob=False,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0})


def randomise(model: torch.nn.Module, seed: int) -> None:
    """HF's 0.02-std init gives near-zero logits and a zero router bias; larger values make routing,
    the bias and parity meaningful."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if "embed" in name else 0.2))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)


def make_checkpoint(variant: str, path) -> torch.nn.Module:
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(deepseek_config(variant)).eval()
    randomise(hf, seed=1)
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module", params=["yarn-grouped", "plain-qproj"])
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_checkpoint(request.param, path)
    return request.param, hf, path, ckpt.load_pretrained(path)


def hf_greedy(hf, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from transformers, one full forward per token (no cache)."""
    ids, tokens, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(steps):
            logp = hf(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
            tokens.append(int(logp.argmax()))
            logprobs.append(float(logp.max()))
            ids.append(tokens[-1])
    return tokens, logprobs


def test_config_maps_every_option(family):
    name, hf, _, model = family
    cfg = model.cfg
    assert cfg.multi_latent_attention and cfg.moe_router_score_function == "sigmoid"
    assert cfg.moe_router_enable_expert_bias and cfg.kv_cache_dims == (1, 16 + 8)
    if name == "yarn-grouped":
        assert cfg.moe_layer_freq == (0, 1, 1) and cfg.q_lora_rank == 24 and cfg.rope_type == "yarn"
        assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk, cfg.moe_router_topk) == (4, 2, 4)
        assert (cfg.moe_router_topk_scaling_factor, cfg.moe_shared_expert_intermediate_size) == (2.5, 16)
        assert (cfg.rotary_scaling_factor, cfg.original_max_position_embeddings, cfg.mscale_all_dim) == (4.0, 64, 0.8)
    else:
        assert cfg.moe_layer_freq == () and cfg.q_lora_rank is None and cfg.rope_type == "rope"
        assert cfg.moe_router_num_groups == 0 and not cfg.moe_renormalize_topk
        assert cfg.moe_shared_expert_intermediate_size == 32 and cfg.rotary_base == 50000.0


def test_logits_match_transformers(family):
    _, hf, _, model = family
    assert max_logit_diff(hf, model, _prompts()) < 1e-4


def test_greedy_tokens_and_logprobs_match_transformers(family):
    """Through the engine: prefill and absorbed-form decode over the paged latent cache."""
    _, hf, _, model = family
    prompts = [p.tolist() for p in _prompts(seed=5, lens=(7, 3, 12))]
    steps = 6
    results = RolloutEngine(model, EngineConfig(scheduler=SchedulerConfig(block_size=4))).generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=steps, ignore_stop=True))
    for prompt, result in zip(prompts, results):
        tokens, logprobs = hf_greedy(hf, prompt, steps)
        assert result.token_ids == tokens
        assert max(abs(a - b) for a, b in zip(result.logprobs, logprobs)) < 1e-3


def test_round_trip_is_lossless(family, tmp_path):
    _, hf, path, model = family
    arch = ckpt.DEEPSEEK_V3
    on_disk = load_file(path / "model.safetensors")  # per-expert layout, what transformers writes
    state = ckpt.hf_to_megatron(on_disk, model.cfg, arch)
    assert {k: tuple(v.shape) for k, v in state.items()} == full_shapes(model.cfg)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    back = ckpt.megatron_to_hf(state, model.cfg, arch)
    assert back.keys() == on_disk.keys() and all(torch.equal(back[k], on_disk[k]) for k in on_disk)
    fused = ckpt.hf_to_megatron(hf.state_dict(), model.cfg, arch)  # transformers 5's in-memory experts
    assert all(torch.equal(fused[k], state[k]) for k in state)
    ckpt.save_pretrained(model, model.cfg, tmp_path, arch)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = _prompts(lens=(10,))[0][None]
    with torch.no_grad():
        assert torch.equal(again(ids).logits, hf(ids).logits)
    assert ckpt.config_from_hf(tmp_path) == model.cfg


def test_hot_swap_copies_every_megatron_tensor(family):
    """`update_weights` with another checkpoint's Megatron state (router bias included) makes the
    engine generate what that checkpoint generates."""
    name, _, _, model = family
    other = MoETransformer(model.cfg).init_weights(seed=7, std=0.2)
    with torch.no_grad():
        for layer in other.decoder.layers:
            if hasattr(layer.mlp, "router"):
                layer.mlp.router.expert_bias.normal_(0, 0.1, generator=torch.Generator().manual_seed(8))
    prompts, params = [[1, 2, 3, 4], [50, 7]], SamplingParams(temperature=0.0, max_new_tokens=5, ignore_stop=True)
    engine = RolloutEngine(other, EngineConfig(scheduler=SchedulerConfig(block_size=4)))
    want = [r.token_ids for r in engine.generate(prompts, params)]
    swapped = MoETransformer(model.cfg)
    swapped.load_state_dict(model.state_dict())
    engine = RolloutEngine(swapped, EngineConfig(scheduler=SchedulerConfig(block_size=4)))
    before = [r.token_ids for r in engine.generate(prompts, params)]
    engine.update_weights(other.state_dict(), version=1)
    after = engine.generate(prompts, params)
    assert [r.token_ids for r in after] == want != before
    assert {v for r in after for v in r.weight_versions} == {1}


def test_layers_past_the_loaded_ones_are_ignored_on_load(tmp_path):
    """A stray layer after the last (here no full MTP layer: no eh_proj) is not read, nor refused."""
    hf = make_checkpoint("plain-qproj", tmp_path)
    state = {k: v.clone() for k, v in load_file(tmp_path / "model.safetensors").items()}
    state["model.layers.2.enorm.weight"] = torch.ones(32)  # an MTP layer after the last decoder layer
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = ckpt.load_pretrained(tmp_path)
    with torch.no_grad():
        ids = _prompts(lens=(6,))[0][None]
        assert torch.allclose(model(ids), hf(ids).logits, atol=1e-4)
    assert set(ckpt.hf_to_megatron(state, model.cfg, ckpt.DEEPSEEK_V3)) == set(full_shapes(model.cfg))
    state["model.layers.1.self_attn.q_a_proj.weight"] = torch.zeros(4, 32)  # not MTP: still refused
    with pytest.raises(ValueError, match="unexpected tensor"):
        ckpt.hf_to_megatron(state, model.cfg, ckpt.DEEPSEEK_V3)


def test_mtp_layers_load_from_a_deepseek_checkpoint(tmp_path):
    """MTP layer K is HF decoder layer num_hidden_layers + K (enorm, hnorm, eh_proj, shared_head.norm
    besides a MoE layer); its copies of the embedding and output layer are not read."""
    cfg = ckpt.config_from_hf(deepseek_config("yarn-grouped")).replace(mtp_num_layers=1)
    model = MoETransformer(cfg).init_weights(seed=5, std=0.2)
    ckpt.save_pretrained(model, cfg, tmp_path, ckpt.DEEPSEEK_V3)
    state = load_file(tmp_path / "model.safetensors")
    assert {"model.layers.3.eh_proj.weight", "model.layers.3.shared_head.norm.weight",
            "model.layers.3.mlp.gate.e_score_correction_bias"} <= set(state)
    state["model.layers.3.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    state["model.layers.3.shared_head.head.weight"] = state["lm_head.weight"].clone()
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    loaded = ckpt.load_pretrained(tmp_path)
    assert loaded.cfg == cfg
    theirs = loaded.state_dict()
    assert theirs.keys() == model.state_dict().keys()
    assert all(torch.equal(theirs[k], v) for k, v in model.state_dict().items())


# ---------------------------------------------------------------- pieces

def test_yarn_tables_match_transformers():
    hc = deepseek_config("yarn-grouped")
    rotary = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding(hc)
    cfg = ckpt.config_from_hf(hc)
    positions = torch.tensor([0, 1, 5, 63, 64, 200, 255])
    cos_ref, sin_ref = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    cos, sin = rope_for(cfg, positions, torch.float32)
    assert rotary.attention_scaling != 1.0  # the magnitude scale is exercised
    assert torch.allclose(cos, cos_ref[0], atol=1e-6) and torch.allclose(sin, sin_ref[0], atol=1e-6)


def _router(groups: int = 0, group_topk: int = 0, topk: int = 2, renormalize: bool = True) -> ScoredRouter:
    cfg = ModelConfig(vocab_size=8, hidden_size=4, num_layers=1, num_attention_heads=1, num_query_groups=1,
                      kv_channels=4, num_moe_experts=8, moe_router_topk=topk, moe_ffn_hidden_size=4,
                      moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                      moe_router_num_groups=groups, moe_router_group_topk=group_topk,
                      moe_router_topk_scaling_factor=2.0, moe_renormalize_topk=renormalize)
    router = ScoredRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.eye(4).repeat(2, 1))  # expert e's logit is x[e % 4]
    return router


def test_expert_bias_changes_the_choice_not_the_weights():
    router = _router(renormalize=False)
    x = torch.tensor([[3.0, 2.0, 1.0, 0.0]])  # scores: experts 0 and 4 best, then 1 and 5
    _, ids = router(x)
    assert sorted(ids[0].tolist()) == [0, 4]
    with torch.no_grad():
        router.expert_bias[[1, 5]] = 1.0
    weights, ids = router(x)
    assert sorted(ids[0].tolist()) == [1, 5]
    assert torch.allclose(weights[0], 2.0 * torch.sigmoid(torch.tensor([2.0, 2.0])))  # unbiased scores, scaled


def test_group_limited_topk_stays_inside_the_best_groups():
    router = _router(groups=4, group_topk=2, topk=4)  # groups {0,1} {2,3} {4,5} {6,7}
    x = torch.tensor([[3.0, 2.5, 0.0, 2.9]])
    # best experts alone would be 0, 4, 3, 7 (groups 0, 2, 1, 3); group sums pick groups 0 and 2
    weights, ids = router(x)
    assert sorted(ids[0].tolist()) == [0, 1, 4, 5]
    assert torch.allclose(weights.sum(), torch.tensor(2.0))  # renormalised, times the scaling factor


def test_paged_cache_holds_one_latent_row_per_token():
    cfg = ckpt.config_from_hf(deepseek_config("yarn-grouped"))
    cache = PagedKVCache(cfg, num_blocks=5, block_size=4, kv_heads=cfg.num_query_groups)
    assert tuple(cache.k.shape) == (3, 20, 1, 24) and cache.v is cache.k
    gqa = cfg.replace(multi_latent_attention=False)
    assert PagedKVCache.bytes_per_block(cfg, 4, 4) == 3 * 4 * 24 * 4
    assert PagedKVCache.bytes_per_block(gqa, 4, 4) == 2 * 3 * 4 * 4 * cfg.kv_channels * 4


# ---------------------------------------------------------------- refusals

@pytest.mark.parametrize("change,message", [
    (dict(rope_interleave=False), "rope_interleave=False"),
    (dict(n_group=4, topk_group=1, num_experts_per_tok=4), "top-2 sum"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "'linear'"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_unsupported_options_are_refused(change, message):
    hc = deepseek_config("yarn-grouped")
    for key, value in change.items():
        setattr(hc, key, value)
    with pytest.raises(ValueError, match=message):
        ckpt.config_from_hf(hc)


def test_model_config_checks_mla_and_routing_fields():
    base = ckpt.config_from_hf(deepseek_config("yarn-grouped"))
    with pytest.raises(ValueError, match="positive kv_lora_rank"):
        base.replace(kv_lora_rank=0)
    with pytest.raises(ValueError, match="must be even"):
        base.replace(qk_pos_emb_head_dim=7)
    with pytest.raises(ValueError, match="group-limited routing"):
        base.replace(moe_router_num_groups=3)
    with pytest.raises(ValueError, match="experts per group"):
        base.replace(moe_router_num_groups=8, moe_router_group_topk=1, moe_router_topk=4)  # 1 expert, 4 wanted
    with pytest.raises(ValueError, match="'sigmoid'"):
        base.replace(moe_router_score_function="tanh")
    with pytest.raises(ValueError, match="cannot express this ModelConfig as DeepseekV3"):
        ckpt.hf_config_from(base.replace(moe_router_score_function="softmax"), ckpt.DEEPSEEK_V3)


def test_mla_models_take_the_portable_runner_off_cuda():
    """The CUDA runner runs MLA (`kernels.mla_attention`); off CUDA `auto` is portable and `cuda` says why not."""
    from megatron_rollout.runner.config import RunnerConfig
    from megatron_rollout.runner.cuda import make_runner

    cfg = ckpt.config_from_hf(deepseek_config("plain-qproj"))
    model = MoETransformer(cfg)
    cache = PagedKVCache(cfg, num_blocks=2, block_size=4, kv_heads=1)
    with pytest.raises(RuntimeError, match="needs a single-rank model on a CUDA device"):
        make_runner(model, cache, RunnerConfig(kind="cuda"))
    assert type(make_runner(model, cache, RunnerConfig(kind="auto"))).__name__ == "ModelRunner"
