"""The engine built from an in-process Megatron-core `GPTModel` (model.megatron_config, megatron_bridge,
`RolloutEngine.from_megatron`): the config read back, shared storage, the copy path, and
`update_weights` taking a Megatron `state_dict()`.

Megatron builds on CPU (local spec) in a one-process gloo world, as in test_megatron_names; its
forward needs CUDA, so the engine's outputs are compared with a native model loaded from the
GPTModel's weights. A Transformer Engine spec model cannot be built without TE, so the TE case uses
a stand-in module holding parameters under the TE spec's state-dict names (test_te_megatron's list).
"""
from __future__ import annotations

import copy
import io
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_rollout.engine import EngineConfig, KVConfig, RolloutEngine, SamplingParams
from megatron_rollout.model.config import PRESETS
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.weights.megatron_bridge import native_from_megatron, shares_storage
from megatron_rollout.weights.megatron_config import model_config_from_megatron, model_config_of
from megatron_rollout.weights.megatron_layout import transformer_config
from megatron_rollout.weights.store import WeightVersionError
from tests.model import test_megatron_names
from tests.model.test_megatron_names import CONFIGS, build_megatron, megatron_weights
from tests.model.test_te_megatron import te_spec_state

gloo_world = test_megatron_names.gloo_world  # the one-process gloo world Megatron builds in
IDS = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))


def reference(gpt, cfg) -> MoETransformer:
    """A native model holding a copy of the GPTModel's current weights."""
    native = MoETransformer(cfg)
    native.load_state_dict(megatron_weights(gpt), strict=True)
    return native


def optimizer_step(gpt, seed: int) -> None:
    """One in-place SGD step on made-up gradients (Megatron's forward needs CUDA)."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(gpt.parameters(), lr=0.5)
    for p in gpt.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 0.05
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_model_config_is_read_from_the_gpt_model(gloo_world, name):
    cfg = CONFIGS[name]
    assert model_config_of(build_megatron(cfg)) == cfg  # the test's own TransformerConfig, written independently
    assert model_config_from_megatron(transformer_config(cfg), cfg.vocab_size, cfg.max_position_embeddings,
                                      tie_word_embeddings=cfg.tie_word_embeddings) == cfg


def _namespace(**changes):
    tc = transformer_config(PRESETS["tiny-moe"])
    return types.SimpleNamespace(**{**vars(tc), **changes})


@pytest.mark.parametrize("changes, fix", [
    (dict(qk_l2_norm=True), "qk_l2_norm=False"),
    (dict(add_bias_linear=True), "add_bias_linear=False"),
    (dict(normalization="LayerNorm"), "normalization='RMSNorm'"),
    (dict(multi_latent_attention=True), "multi_latent_attention=False"),
    (dict(activation_func=F.gelu), "F.silu"),
    (dict(pipeline_model_parallel_size=2), "pipeline_model_parallel_size=2"),
    (dict(params_dtype=torch.int8), "params_dtype=torch.int8"),
])
def test_unsupported_megatron_options_are_refused_by_name(changes, fix):
    with pytest.raises(ValueError, match="does not implement") as err:
        model_config_from_megatron(_namespace(**changes), 260, 4096)
    assert fix in str(err.value)


def test_an_integer_moe_layer_freq_is_every_nth_layer():
    cfg = model_config_from_megatron(_namespace(num_layers=4, moe_layer_freq=2), 260, 4096)
    assert cfg.moe_layer_freq == (1, 0, 1, 0) and cfg.ffn_hidden_size == 128
    every = model_config_from_megatron(_namespace(num_layers=4, moe_layer_freq=1), 260, 4096)
    assert every.moe_layer_freq == () and every.moe_ffn_hidden_size == 32


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_engine_serves_the_trainers_storage_and_follows_an_optimizer_step(gloo_world, name):
    cfg = CONFIGS[name]
    gpt = build_megatron(cfg)
    engine = RolloutEngine.from_megatron(gpt, EngineConfig(kv=KVConfig(num_blocks=32)))
    assert engine.model.cfg == cfg
    theirs = megatron_weights(gpt)
    ours = dict(engine.model.named_parameters())
    assert ours.keys() == theirs.keys()
    assert all(p.data_ptr() == theirs[n].data_ptr() for n, p in ours.items())  # no second copy
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    with torch.no_grad():
        before = engine.model(IDS)
        assert torch.equal(before, reference(gpt, cfg)(IDS))
        first = engine.generate([[256, 72, 105]], params)[0].token_ids

        optimizer_step(gpt, seed=2)  # in place: no update_weights call follows
        after = engine.model(IDS)
    assert shares_storage(engine.model, gpt)
    assert (after - before).abs().max() > 1e-3
    ref = reference(gpt, cfg)
    with torch.no_grad():
        assert torch.equal(after, ref(IDS))
    want = RolloutEngine(ref, EngineConfig(kv=KVConfig(num_blocks=32))).generate([[256, 72, 105]], params)[0].token_ids
    assert engine.generate([[256, 72, 105]], params)[0].token_ids == want and len(want) == 4
    assert len(first) == 4


def test_the_copy_path_owns_its_weights_and_update_weights_takes_a_megatron_state_dict(gloo_world):
    cfg = CONFIGS["tiny-moe"]
    gpt = build_megatron(cfg)
    engine = RolloutEngine.from_megatron(gpt, EngineConfig(kv=KVConfig(num_blocks=32)), share_storage=False)
    theirs = megatron_weights(gpt)
    for n, p in engine.model.named_parameters():
        assert p.data_ptr() != theirs[n].data_ptr() and torch.equal(p, theirs[n])
    snapshot = reference(gpt, cfg)
    optimizer_step(gpt, seed=3)
    with torch.no_grad():
        stale = engine.model(IDS)
        assert torch.equal(stale, snapshot(IDS))  # the step did not reach the copy
        state = gpt.state_dict()
        extra = [k for k in state if k.endswith("._extra_state")]
        assert len(extra) > 0  # Megatron's local spec leaves them (None); they must be skipped
        engine.update_weights(state, 1)
        assert torch.equal(engine.model(IDS), reference(gpt, cfg)(IDS))
        assert not torch.equal(engine.model(IDS), stale)
    assert engine.weight_version == 1
    bad = dict(gpt.state_dict(), **{"decoder.layers.0.self_attention.linear_qv.weight": torch.zeros(2)})
    with pytest.raises(KeyError, match="linear_qv"):
        engine.update_weights(bad, 2)
    assert engine.weight_version == 1
    with pytest.raises(WeightVersionError, match="leaves 1 tensors unset"):
        engine.update_weights({k: v for k, v in gpt.state_dict().items() if "final_layernorm" not in k}, 2)


class FP8Metadata(nn.Module):
    """A module with extra state, as every TE module has (`<prefix>._extra_state` in its state dict)."""

    def get_extra_state(self) -> io.BytesIO:
        return io.BytesIO(b"fp8 meta")

    def set_extra_state(self, state) -> None:
        pass


class TESpecStandIn(nn.Module):
    """Parameters under a Transformer Engine spec GPTModel's state-dict names, and the attributes
    `model_config_of` reads; one module reports TE's `_extra_state`."""

    def __init__(self, cfg, config, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.config, self.vocab_size, self.max_sequence_length = config, cfg.vocab_size, cfg.max_position_embeddings
        self.position_embedding_type, self.rotary_percent, self.rotary_base = "rope", 1.0, int(cfg.rotary_base)
        self.share_embeddings_and_output_weights = cfg.tie_word_embeddings
        self.extra = FP8Metadata()
        for name, t in tensors.items():
            owner, _, leaf = name.rpartition(".")
            module = self
            for part in owner.split(".") if owner else []:
                if not hasattr(module, part):
                    module.add_module(part, nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, nn.Parameter(t.clone()))


def test_a_te_spec_model_shares_storage_and_its_state_dict_updates_a_copy():
    cfg = PRESETS["tiny-moe"]
    native = MoETransformer(cfg).init_weights(5)
    names = {k: v for k, v in te_spec_state(native.state_dict(), cfg, grouped=True).items() if v is not None
             and not k.endswith("_extra_state")}
    te = TESpecStandIn(cfg, transformer_config(cfg), names)
    assert "extra._extra_state" in te.state_dict()
    engine = RolloutEngine.from_megatron(te, EngineConfig(kv=KVConfig(num_blocks=32)))
    fused = te.get_parameter("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight")
    assert engine.model.get_parameter("decoder.layers.0.input_layernorm.weight").data_ptr() == fused.data_ptr()
    grouped = te.get_parameter("decoder.layers.1.mlp.experts.linear_fc2.weight3")
    assert engine.model.get_parameter("decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"
                                      ).data_ptr() == grouped.data_ptr()
    assert shares_storage(engine.model, te)
    with torch.no_grad():
        assert torch.equal(engine.model(IDS), native(IDS))
    copy = native_from_megatron(te, share_storage=False)
    rest = RolloutEngine(copy, EngineConfig(kv=KVConfig(num_blocks=32)))
    with torch.no_grad():
        fused.mul_(1.5)
        rest.update_weights(te.state_dict(), 1)  # TE names and `_extra_state` as the trainer has them
        assert torch.equal(copy.get_parameter("decoder.layers.0.input_layernorm.weight"), fused)
        assert torch.equal(rest.model(IDS), engine.model(IDS))


def test_sharing_with_a_sharded_trainer_is_refused_with_the_way_out():
    cfg = PRESETS["tiny-moe"]
    te = TESpecStandIn(cfg, _namespace(tensor_model_parallel_size=2, expert_model_parallel_size=1), {})
    with pytest.raises(ValueError, match="TP=2, EP=1.*share_storage=False"):
        native_from_megatron(te, share_storage=True)


def _experts(model):
    from megatron_rollout.model.layers import Experts

    return [m for m in model.modules() if isinstance(m, Experts)]


def test_the_cuda_runners_restack_keeps_shared_experts_and_a_moving_runner_is_refused(gloo_world, monkeypatch):
    """The CUDA runner stacks the routed experts for its grouped kernels (`Experts.restack`); over a
    shared trainer they already are its stacks, and stay. A runner that moved a weight is refused."""
    from megatron_rollout.engine import engine as engine_module

    real = engine_module.make_runner
    moved = {"on": False}

    def runner(model, cache, config):
        for experts in _experts(model):
            experts.restack()
            if moved["on"]:
                w = experts.local_experts[0].linear_fc1.weight
                w.data = w.data.clone()
        return real(model, cache, config)

    monkeypatch.setattr(engine_module, "make_runner", runner)
    gpt = build_megatron(CONFIGS["tiny-moe"])
    engine = RolloutEngine.from_megatron(gpt, EngineConfig(kv=KVConfig(num_blocks=32)))
    assert engine.weights.shared and shares_storage(engine.model, gpt)
    moved["on"] = True
    with pytest.raises(ValueError, match="out of the trainer's storage; pass share_storage=False"):
        RolloutEngine.from_megatron(gpt, EngineConfig(kv=KVConfig(num_blocks=32)))
    engine = RolloutEngine.from_megatron(gpt, EngineConfig(kv=KVConfig(num_blocks=32)), share_storage=False)
    assert engine.model.cfg == CONFIGS["tiny-moe"] and not engine.weights.shared


def test_a_bf16_trainer_is_shared_with_fp32_norms_and_experts_stacked_in_place(gloo_world):
    cfg = CONFIGS["tiny-moe"].replace(dtype="bfloat16")
    gpt = build_megatron(cfg)
    params = dict(gpt.named_parameters())
    norm = "decoder.layers.0.input_layernorm.weight"
    assert params[norm].dtype == torch.float32  # Megatron's local spec: torch RMSNorm, fp32 weights
    engine = RolloutEngine.from_megatron(gpt, EngineConfig(kv=KVConfig(num_blocks=32)))
    assert engine.weights.shared and shares_storage(engine.model, gpt)
    assert engine.model.get_parameter(norm).dtype == torch.float32
    assert engine.model.get_parameter("decoder.layers.0.self_attention.linear_qkv.weight").dtype == torch.bfloat16
    assert dict(gpt.named_parameters()) == params  # the trainer keeps its Parameter objects (the optimizer's)
    stacked = [(n, m) for n, m in engine.model.named_modules() if m in _experts(engine.model)]
    assert len(stacked) == 2
    for prefix, experts in stacked:  # the trainer's experts were moved into the stacks the kernels read
        assert experts.aliased()
        fc1, fc2 = experts._stacked
        assert fc1.shape == (cfg.num_moe_experts, 2 * cfg.moe_ffn_hidden_size, cfg.hidden_size)
        for k in range(cfg.num_moe_experts):
            assert params[f"{prefix}.local_experts.{k}.linear_fc1.weight"].data_ptr() == fc1[k].data_ptr()
            assert params[f"{prefix}.local_experts.{k}.linear_fc2.weight"].data_ptr() == fc2[k].data_ptr()
        ptr = fc1.data_ptr()
        experts.restack()  # what the CUDA runner calls: nothing moves
        assert experts._stacked[0].data_ptr() == ptr
    again = RolloutEngine.from_megatron(gpt, EngineConfig(kv=KVConfig(num_blocks=32)))  # stacks found, not moved
    assert _experts(again.model)[0]._stacked[0].data_ptr() == _experts(engine.model)[0]._stacked[0].data_ptr()

    prompt, greedy = [[256, 72, 105]], SamplingParams(temperature=0.0, max_new_tokens=4)
    with torch.no_grad():
        before = engine.model(IDS)
        snapshot = copy.deepcopy(engine.model)  # the same mixed dtypes, its own storage
        first = engine.generate(prompt, greedy)[0]
        opt = torch.optim.AdamW(gpt.parameters(), lr=1e-2)  # in place, fp32 norms and bf16 matrices alike
        for p in gpt.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        after = engine.model(IDS)
        reference = copy.deepcopy(engine.model)
        assert torch.equal(snapshot(IDS), before) and not torch.equal(after, before)
        assert torch.equal(reference(IDS), after)
    assert shares_storage(engine.model, gpt)
    want = RolloutEngine(reference, EngineConfig(kv=KVConfig(num_blocks=32))).generate(prompt, greedy)[0]
    got = engine.generate(prompt, greedy)[0]
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs and len(first.token_ids) == 4


def test_experts_inside_a_shared_buffer_are_refused_or_copied(gloo_world):
    """Megatron's distributed optimizer keeps every parameter in one flat buffer (reverse order) that
    its all-gather writes: such experts cannot be moved into stacks, so sharing is refused or copied."""
    cfg = CONFIGS["tiny-moe"]
    gpt = build_megatron(cfg)
    params = list(gpt.parameters())[::-1]
    flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype)
    offset = 0
    with torch.no_grad():
        for p in params:
            flat[offset:offset + p.numel()].copy_(p.view(-1))
            p.data = flat[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
    with pytest.raises(ValueError, match=r"local_experts\.\d+\.linear_fc\d\.weight lies inside a storage.*"
                                         "share_storage=False"):
        RolloutEngine.from_megatron(gpt, EngineConfig(kv=KVConfig(num_blocks=32)), share_storage=True)
    engine = RolloutEngine.from_megatron(gpt, EngineConfig(kv=KVConfig(num_blocks=32)))
    assert not engine.weights.shared and not shares_storage(engine.model, gpt)
    assert all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in gpt.parameters())
    with torch.no_grad():
        assert torch.equal(engine.model(IDS), reference(gpt, cfg)(IDS))


def test_a_rotary_embedding_off_the_reported_base_is_refused(gloo_world):
    gpt = build_megatron(CONFIGS["tiny-moe"])
    gpt.rotary_base = 500000  # what newer megatron-core reports from its config, while the embedding kept 10000
    with pytest.raises(ValueError, match="does not run rotary_base=500000 unscaled"):
        model_config_of(gpt)


def _cuda_gpt(cfg, monkeypatch):
    """A GPTModel of `cfg` on CUDA, seeded, with weights larger than Megatron's init so that routing
    is not a tie."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe import moe_utils

    monkeypatch.setattr(moe_utils, "te_general_gemm", getattr(moe_utils, "te_general_gemm", None), raising=False)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    gpt = build_megatron(cfg)
    with torch.no_grad():
        for k, p in gpt.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if k.endswith("layernorm.weight") else 0.2 * torch.randn_like(p))
    return gpt.cuda()


@pytest.mark.gpu
def test_on_cuda_the_engine_gives_megatrons_logits_before_and_after_an_adam_step(gloo_world, monkeypatch):
    """Megatron's own forward (CUDA) against the engine over the same storage, with no update call."""
    from megatron_rollout.engine.config import RunnerConfig

    cfg = CONFIGS["tiny-moe"]
    gpt = _cuda_gpt(cfg, monkeypatch)
    engine = RolloutEngine.from_megatron(gpt,
                                         EngineConfig(kv=KVConfig(num_blocks=32), runner=RunnerConfig(kind="eager")))
    ids = IDS.cuda()
    positions = torch.arange(ids.shape[1], device="cuda")[None].expand_as(ids)
    mask = torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool, device="cuda").triu(1)

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        gpt.eval()
        with torch.no_grad():
            return gpt(ids, positions, mask).float(), engine.model(ids).float()

    theirs, ours = both()
    assert (theirs - ours).abs().max() < 1e-3
    gpt.train()
    opt = torch.optim.Adam(gpt.parameters(), lr=1e-2)
    logits = gpt(ids, positions, mask)
    F.cross_entropy(logits[:, :-1].float().reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1)).backward()
    opt.step()
    theirs2, ours2 = both()
    assert (theirs2 - theirs).abs().max() > 1e-2  # the step moved the trainer
    assert (theirs2 - ours2).abs().max() < 1e-3  # and the engine serves it with no update call
    assert shares_storage(engine.model, gpt)


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_on_cuda_decode_graphs_over_a_shared_bf16_trainer_follow_an_adam_step(gloo_world, monkeypatch):
    """A bf16 GPTModel (fp32 norms, per-expert tensors) shared by the CUDA runner with decode graphs:
    Megatron's logits, then an in-place Adam step served by the graphs captured before it (no
    re-capture, no update call), as a fresh engine over the updated weights generates."""
    from megatron_rollout.engine.config import RunnerConfig

    cfg = CONFIGS["tiny-moe"].replace(dtype="bfloat16")
    gpt = _cuda_gpt(cfg, monkeypatch)
    config = EngineConfig(kv=KVConfig(num_blocks=64),
                          runner=RunnerConfig(kind="cuda", graph_batch_sizes=(1, 2, 4), prefill_graph_tokens=()))
    engine = RolloutEngine.from_megatron(gpt, config)
    runner = engine.runner
    assert type(runner).__name__ == "CudaRunner" and runner.graph_safe and engine.weights.shared
    assert shares_storage(engine.model, gpt)
    assert engine.model.get_parameter("decoder.final_layernorm.weight").dtype == torch.float32
    prompts, greedy = [[256, 72, 105], [256, 50, 51, 52]], SamplingParams(temperature=0.0, max_new_tokens=6)
    before = engine.generate(prompts, greedy)
    graphs = dict(runner._graphs)
    assert graphs and runner.stats["graph_replays"] > 0

    ids = IDS.cuda()
    positions = torch.arange(ids.shape[1], device="cuda")[None].expand_as(ids)
    mask = torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool, device="cuda").triu(1)
    gpt.eval()
    with torch.no_grad():
        theirs, ours = gpt(ids, positions, mask).float(), engine.model(ids).float()
    # bf16 kernels on both sides (a routing near-tie may send a token elsewhere): normwise
    assert float((theirs - ours).norm() / theirs.norm()) < 0.1
    gpt.train()
    opt = torch.optim.Adam(gpt.parameters(), lr=1e-2)
    logits = gpt(ids, positions, mask)
    F.cross_entropy(logits[:, :-1].float().reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1)).backward()
    opt.step()

    replays = runner.stats["graph_replays"]
    after = engine.generate(prompts, greedy)
    assert runner.stats["graph_replays"] > replays  # decode replayed the graphs captured before the step
    assert runner._graphs.keys() == graphs.keys() and all(runner._graphs[b] is g for b, g in graphs.items())
    assert shares_storage(engine.model, gpt) and engine.weight_version == 0
    want = RolloutEngine.from_megatron(gpt, config).generate(prompts, greedy)  # graphs over the new weights
    assert [o.token_ids for o in after] == [o.token_ids for o in want]
    for got, fresh in zip(after, want):
        assert got.logprobs == pytest.approx(fresh.logprobs, abs=2e-3)
    assert [o.logprobs for o in after] != [o.logprobs for o in before]


def test_deepseek_routing_is_read_and_its_fp32_expert_bias_shared(gloo_world, monkeypatch):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    cfg = PRESETS["tiny-moe"].replace(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                      moe_router_num_groups=2, moe_router_group_topk=1,
                                      moe_router_topk_scaling_factor=2.5)
    tc = transformer_config(cfg)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # Megatron puts the expert bias there
    assert model_config_from_megatron(tc, cfg.vocab_size, cfg.max_position_embeddings) == cfg
    gpt = GPTModel(tc, get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm"),
                   vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
                   position_embedding_type="rope", rotary_base=int(cfg.rotary_base))
    bias = gpt.get_buffer("decoder.layers.1.mlp.router.expert_bias")
    with torch.no_grad():
        bias.copy_(torch.linspace(-1, 1, cfg.num_moe_experts))
    engine = RolloutEngine.from_megatron(gpt, EngineConfig(kv=KVConfig(num_blocks=32)))
    ours = engine.model.get_parameter("decoder.layers.1.mlp.router.expert_bias")
    assert ours.dtype == torch.float32 and ours.data_ptr() == bias.data_ptr()
    assert shares_storage(engine.model, gpt)
