"""The Transformer Engine path (model/te_layers.py).

CPU part: config validation, the error when TE is absent, and (with a FAKE `transformer_engine`
injected into sys.modules: it checks name/shape/storage plumbing only, never TE's numerics) which
modules are swapped, that state_dict names are unchanged and that TE's weights share the model's
storage. GPU part (`@pytest.mark.gpu`, skipped where TE does not import): the real TE on the H200.
"""
from __future__ import annotations

import contextlib
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_rollout.engine import KVConfig, RunnerConfig, SchedulerConfig
from megatron_rollout.model import te_layers
from megatron_rollout.model.config import PRESETS
from megatron_rollout.model.layers import Experts, Linear
from megatron_rollout.model.transformer import MoETransformer

CFG = PRESETS["tiny-moe"]


def test_config_validation():
    assert te_layers.TEConfig().recipe == "current"
    with pytest.raises(ValueError, match="unknown TE recipe 'mxfp8'"):
        te_layers.TEConfig(recipe="mxfp8")
    with pytest.raises(ValueError, match="amax_history_len must be positive, got 0"):
        te_layers.TEConfig(recipe="delayed", amax_history_len=0)
    with pytest.raises(ValueError, match="include is empty"):
        te_layers.TEConfig(include=())


def test_missing_te_names_the_install_commands(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    te_layers.te_missing.cache_clear()
    try:
        why = te_layers.te_missing()
        assert why is not None and "pip install transformer-engine" in why and "docs/fp8-te.md" in why
        with pytest.raises(RuntimeError, match="te_session.sh"):
            te_layers.apply_te(MoETransformer(CFG), te_layers.TEConfig())
        from megatron_rollout.engine import RolloutEngine
        from megatron_rollout.engine.config import EngineConfig

        with pytest.raises(RuntimeError, match="Transformer Engine is not importable"):  # at construction
            RolloutEngine(MoETransformer(CFG), EngineConfig(runner=RunnerConfig(fp8="te-current")))
    finally:
        te_layers.te_missing.cache_clear()


# ---------------------------------------------------------------- FAKE TE: plumbing only

class _FakeLinear(nn.Module):
    def __init__(self, in_features, out_features, bias=False, params_dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype, device=device))
        self.calls = []

    def forward(self, x, is_first_microbatch=None):
        self.calls.append((tuple(x.shape), is_first_microbatch))
        return F.linear(x, self.weight)


class _FakeGrouped(nn.Module):
    def __init__(self, num_gemms, in_features, out_features, bias=False, params_dtype=None, device=None,
                 use_grouped_tensor=None):
        super().__init__()
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", nn.Parameter(torch.empty(out_features, in_features,
                                                                           dtype=params_dtype, device=device)))

    def forward(self, x, m_splits, is_first_microbatch=None):
        """As TE's device-split path: the first sum(m_splits) rows are the groups', the rest left out
        (zeros here; TE leaves them unwritten); the output has x's rows."""
        assert len(m_splits) <= te_layers.TE_MAX_GROUPS
        n = int(m_splits.sum())
        y = torch.cat([F.linear(p, getattr(self, f"weight{i}")) for i, p in enumerate(x[:n].split(m_splits.tolist()))])
        return torch.cat([y, y.new_zeros(x.shape[0] - n, y.shape[1])])


@pytest.fixture
def fake_te(monkeypatch):
    """A stand-in `transformer_engine` with TE 2.20's call signatures (names/shapes plumbing only)."""
    state = {"grouped_ok": False}
    te = types.ModuleType("transformer_engine")
    pt = types.ModuleType("transformer_engine.pytorch")
    pt.Linear, pt.GroupedLinear = _FakeLinear, _FakeGrouped
    pt.autocast = lambda enabled=True, recipe=None: contextlib.nullcontext()
    pt.is_fp8_available = lambda return_reason=False: (True, "")
    pt.is_fp8_block_scaling_available = lambda return_reason=False: (True, "")
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.Format = types.SimpleNamespace(E4M3="E4M3")
    for name in ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"):
        setattr(recipe, name, type(name, (), {"__init__": lambda self, **kw: setattr(self, "kw", kw)}))
    common.recipe = recipe
    module = types.ModuleType("transformer_engine.pytorch.module")
    gl = types.ModuleType("transformer_engine.pytorch.module.grouped_linear")
    gl.is_module_grouped_tensor_path_supported = lambda r, dtype: state["grouped_ok"]
    module.grouped_linear = gl
    tex = types.ModuleType("transformer_engine_torch")
    tex.get_cublasLt_version = lambda: 130000
    te.pytorch, te.common, pt.module = pt, common, module
    for name, mod in {"transformer_engine": te, "transformer_engine.pytorch": pt, "transformer_engine.common": common,
                      "transformer_engine.common.recipe": recipe, "transformer_engine.pytorch.module": module,
                      "transformer_engine.pytorch.module.grouped_linear": gl, "transformer_engine_torch": tex}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    te_layers.te_missing.cache_clear()
    yield state
    te_layers.te_missing.cache_clear()


def test_fake_te_swaps_attention_and_dense_mlp_only_and_keeps_names(fake_te):
    model = MoETransformer(CFG).init_weights(seed=0)
    keys = list(model.state_dict())
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    with torch.no_grad():
        before = model(ids)
        result = te_layers.apply_te(model, te_layers.TEConfig(recipe="block"))
        after = model(ids)
    # per layer qkv + proj, dense layer 0 fc1 + fc2; no expert, shared expert or output layer
    assert len(result.linears) == 3 * 2 + 2
    assert all(n.endswith(("linear_qkv", "linear_proj")) or n.startswith("decoder.layers.0.mlp.")
               for n in result.linears)
    assert list(model.state_dict()) == keys  # TE modules are not registered: Megatron's names only
    assert "multiple of 128" in result.experts_skipped and result.experts == ()
    torch.testing.assert_close(after, before)  # the fake computes F.linear on the shared storage
    qkv = model.get_submodule(result.linears[0])
    assert isinstance(qkv.fp8, te_layers.TEWeight) and qkv.fp8.recipe.kw == {"fp8_format": "E4M3"}
    assert qkv.fp8.module.weight.data_ptr() == qkv.weight.data_ptr()
    assert qkv.fp8.module.calls[0] == ((16, CFG.hidden_size), True)  # 5 rows padded to 16, cache built


def test_fake_te_weight_update_reaches_the_te_module_and_refreshes_its_cache(fake_te):
    model = MoETransformer(CFG).init_weights(seed=0)
    te_layers.apply_te(model, te_layers.TEConfig(recipe="delayed"))
    lin: Linear = model.decoder.layers[0].self_attention.linear_proj
    x = torch.randn(3, lin.weight.shape[1])
    with torch.no_grad():
        y0 = lin(x)
        assert lin.fp8.module.calls[-1][1] is True
        lin(x)
        assert lin.fp8.module.calls[-1][1] is False  # cached: weight unchanged
        lin.weight.copy_(torch.randn_like(lin.weight))  # what update_weights does
        y1 = lin(x)
    assert lin.fp8.module.calls[-1][1] is True  # the weight's _version moved: re-quantised
    torch.testing.assert_close(y1, F.linear(x, lin.weight))
    assert not torch.allclose(y0, y1)
    lin.weight.data = torch.zeros_like(lin.weight)  # a re-bind (WeightStore.bind) is followed too
    with torch.no_grad():
        assert lin(x).abs().max() == 0
    assert te_layers.refresh_te(model) == 8
    assert te_layers.remove_te(model) == 8 and lin.fp8 is None


def _assert_grouped_matches_experts(experts: Experts, counts: list[int]) -> None:
    """`experts.grouped_offsets` on expert-sorted rows (`counts[k]` rows for expert k) equals each
    expert's own MLP on its rows."""
    x = torch.randn(sum(counts), CFG.hidden_size, dtype=torch.bfloat16)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    with torch.no_grad():
        got = experts.grouped_offsets(x, offsets)
        want = torch.cat([experts.local_experts[k](p) for k, p in enumerate(x.split(counts)) if counts[k]])
    torch.testing.assert_close(got, want)


def test_fake_te_experts_on_grouped_linear_when_the_device_split_path_applies(fake_te):
    fake_te["grouped_ok"] = True
    model = MoETransformer(CFG.replace(dtype="bfloat16")).init_weights(seed=0)
    experts: Experts = model.decoder.layers[1].mlp.experts
    result = te_layers.apply_te(model)
    assert result.experts == ("decoder.layers.1.mlp.experts", "decoder.layers.2.mlp.experts")
    assert result.experts_skipped is None
    fc1, fc2 = experts._stacked
    assert len(experts.te.chunks) == 1
    assert experts.te.chunks[0].fc1.weight3.data_ptr() == fc1[3].data_ptr()
    assert experts.te.chunks[0].fc2.weight7.data_ptr() == fc2[7].data_ptr()
    _assert_grouped_matches_experts(experts, [3, 0, 2, 1, 0, 4, 1, 5])
    assert te_layers.remove_te(model) == 8 + 2 and "grouped_offsets" not in experts.__dict__


@pytest.mark.parametrize("counts", [[3, 0, 2, 1, 0, 4, 1, 5], [0, 0, 0, 6, 0, 0, 0, 0], [0] * 7 + [2]])
def test_fake_te_experts_run_in_chunks_of_at_most_the_grouped_gemm_limit(fake_te, monkeypatch, counts):
    """More experts than one grouped GEMM takes: chunks of `TE_MAX_GROUPS` (3 here: 3 + 3 + 2), each
    chunk's rows rotated to the front by device offsets, the rows of the others left as they were."""
    fake_te["grouped_ok"] = True
    monkeypatch.setattr(te_layers, "TE_MAX_GROUPS", 3)
    model = MoETransformer(CFG.replace(dtype="bfloat16")).init_weights(seed=0)
    experts: Experts = model.decoder.layers[1].mlp.experts
    te_layers.apply_te(model, te_layers.TEConfig(recipe="current"))
    assert [(c.first, c.stop) for c in experts.te.chunks] == [(0, 3), (3, 6), (6, 8)]
    assert experts.te.chunks[2].fc2.weight1.data_ptr() == experts._stacked[1][7].data_ptr()
    _assert_grouped_matches_experts(experts, counts)


def test_fake_te_experts_are_not_bypassed_by_the_small_batch_kernels(fake_te):
    """The runner may pick `moe_triton` for small batches; experts on TE keep TE's grouped GEMM (the
    Triton kernels cannot run on CPU, so reaching them here would raise)."""
    from megatron_rollout.kernels import moe

    fake_te["grouped_ok"] = True
    model = MoETransformer(CFG.replace(dtype="bfloat16")).init_weights(seed=0)
    experts: Experts = model.decoder.layers[1].mlp.experts
    te_layers.apply_te(model)
    assert moe.expert_path(experts) == "te"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, CFG.hidden_size, dtype=torch.bfloat16, generator=g)
    ids = torch.stack([torch.randperm(CFG.num_moe_experts, generator=g)[:2] for _ in range(5)])
    weights = torch.rand(5, 2, generator=g).softmax(-1)
    with torch.no_grad():
        got = moe.routed_experts(x, ids, weights, experts, small="triton", small_pairs=1 << 20)
        want = sum(weights[:, j, None] * torch.stack([experts.local_experts[int(e)](x[n]) for n, e in
                                                      enumerate(ids[:, j])]) for j in range(2))
    torch.testing.assert_close(got, want.to(got.dtype), rtol=2e-2, atol=2e-2)
    te_layers.remove_te(model)
    assert moe.expert_path(experts) == "bf16"


def test_fake_te_engine_mode_puts_the_model_on_te_and_updates_refresh_its_caches(fake_te):
    """`RunnerConfig(fp8="te-current")` puts the engine's model on TE when the engine is built, and
    every weight update re-quantises TE's caches in place (a decode graph replays them and would
    never rebuild them itself): the TE module's next call after `update_weights` is a refresh."""
    from megatron_rollout.engine import RolloutEngine, SamplingParams
    from megatron_rollout.engine.config import EngineConfig

    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
    prompts = [[5, 17, 33, 2, 9], [40, 41, 3]]
    base = MoETransformer(CFG).init_weights(seed=0)
    want = [r.token_ids for r in RolloutEngine(base, EngineConfig()).generate(prompts, greedy)]
    model = MoETransformer(CFG).init_weights(seed=0)
    engine = RolloutEngine(model, EngineConfig(runner=RunnerConfig(fp8="te-current")))
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    assert isinstance(qkv.fp8, te_layers.TEWeight) and type(qkv.fp8.recipe).__name__ == "Float8CurrentScaling"
    assert [r.token_ids for r in engine.generate(prompts, greedy)] == want  # the fake TE computes exactly
    qkv.fp8.module.calls.clear()
    engine.update_weights({k: v * 1.01 for k, v in model.state_dict().items()}, version=1)
    assert qkv.fp8.module.calls == [((16, CFG.hidden_size), True)]  # refreshed by the update itself
    with pytest.raises(ValueError, match="fp8 must be one of .*te-current.*got 'te-fast'"):
        EngineConfig(runner=RunnerConfig(fp8="te-fast"))


def test_fake_te_refuses_shapes_te_cannot_run(fake_te):
    model = MoETransformer(CFG.replace(vocab_size=260)).init_weights(seed=0)
    with pytest.raises(ValueError, match=r"output_layer: weight shape \(260, 64\) is not a multiple of 16"):
        te_layers.apply_te(model, te_layers.TEConfig(include=("output_layer",)))
    with pytest.raises(ValueError, match="no Linear layer matches"):
        te_layers.apply_te(model, te_layers.TEConfig(include=("*nothing*",)))


# ---------------------------------------------------------------- the real TE (GPU)

TE_MISSING = "Transformer Engine not installed (docs/fp8-te.md)"


def _te_model(num_layers: int, seed: int = 0, experts: int = 16):
    """Skip without TE; else a random-weight `qwen3-30b-a3b` of `num_layers` layers and `experts` experts on CUDA."""
    pytest.importorskip("transformer_engine.pytorch", reason=TE_MISSING)
    from benchmarks.rollout import random_model

    cfg = PRESETS["qwen3-30b-a3b"].replace(num_layers=num_layers, num_moe_experts=experts)
    return cfg, random_model(cfg, torch.device("cuda"), seed)


@pytest.mark.gpu
def test_te_bf16_linear_matches_torch():
    te = pytest.importorskip("transformer_engine.pytorch", reason=TE_MISSING)
    layer = te.Linear(2048, 5120, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(37, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        got, want = layer(x).float(), F.linear(x, layer.weight).float()
    assert float((got - want).norm() / want.norm()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", te_layers.RECIPES)
def test_te_fp8_logits_error_is_bounded(recipe):
    cfg, model = _te_model(2)
    ids = torch.randint(0, cfg.vocab_size, (1, 64), device="cuda")
    with torch.no_grad():
        ref = model(ids).float()
        result = te_layers.apply_te(model, te_layers.TEConfig(recipe=recipe))
        got = model(ids).float()
    rel = float((got - ref).norm() / ref.norm())
    print(f"TE {recipe}: logits rel err {rel:.4f}; experts {result.experts or result.experts_skipped}")
    assert 0 < rel < 0.15  # FP8 rounds (never exact) but stays near bf16


@pytest.mark.gpu
def test_te_update_weights_changes_outputs():
    cfg, model = _te_model(1)
    te_layers.apply_te(model, te_layers.TEConfig(recipe="current"))
    lin = model.decoder.layers[0].self_attention.linear_qkv
    x = torch.randn(8, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        y0 = lin(x)
        new = torch.randn_like(lin.weight) * 0.02
        lin.weight.copy_(new)
        y1 = lin(x)
        want = F.linear(x, new)
    assert float((y1 - y0).norm() / y0.norm()) > 0.5
    assert float((y1.float() - want.float()).norm() / want.float().norm()) < 0.1


@pytest.mark.gpu
def test_te_decode_graph_capture_and_refresh():
    cfg, model = _te_model(1)
    te_layers.apply_te(model, te_layers.TEConfig(recipe="current"))
    lin = model.decoder.layers[0].self_attention.linear_proj
    x = torch.randn(4, lin.weight.shape[1], device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        eager = lin(x).clone()  # builds TE's FP8 weight cache outside the capture
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            lin(x)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = lin(x)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, eager)
        lin.weight.mul_(-1.0)
        assert te_layers.refresh_te(model) > 0  # in place: the captured graph reads the new cache
        graph.replay()
        torch.cuda.synchronize()
    torch.testing.assert_close(out, -eager, rtol=0.05, atol=0.05)


def _routing(cfg, tokens: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=g)
    scores = torch.rand(tokens, cfg.num_moe_experts, device="cuda", generator=g)
    weights, ids = scores.topk(cfg.moe_router_topk, dim=-1)
    return x, ids, weights.softmax(-1)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe,experts", [("current", 16), ("current", 128), ("block", 16)])
def test_te_grouped_experts_match_bf16_and_replay_in_a_graph(recipe, experts):
    """Routed experts on TE's GroupedLinear (device splits, where cuBLASLt allows it; 128 experts run
    as two chunks of 64) against the bf16 grouped GEMM on the same weights; then captured in a CUDA
    graph, replayed, and refreshed in place after a weight update. Tolerance: FP8 e4m3 rounding of
    weights and activations, 0.1 relative."""
    from megatron_rollout.kernels import moe

    cfg, model = _te_model(1, experts=experts)
    why = te_layers.experts_unsupported(te_layers.TEConfig(recipe=recipe), torch.bfloat16)
    if why:
        pytest.skip(why)
    layer = model.decoder.layers[0].mlp.experts
    layer.restack()
    x, ids, weights = _routing(cfg, 48, seed=1)
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
    with torch.no_grad():
        ref = moe.routed_experts(x, ids, weights, layer)
        result = te_layers.apply_te(model, te_layers.TEConfig(recipe=recipe))
        assert result.experts and moe.expert_path(layer) == "te"
        assert len(layer.te.chunks) == -(-experts // te_layers.TE_MAX_GROUPS)
        eager = moe.routed_experts(x, ids, weights, layer, small="triton", small_pairs=1 << 20)
        print(f"TE {recipe} experts: rel err vs bf16 {rel(eager, ref):.4f}")
        assert 0 < rel(eager, ref) < 0.1
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            moe.routed_experts(x, ids, weights, layer)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe.routed_experts(x, ids, weights, layer)
        graph.replay()
        torch.cuda.synchronize()
        assert rel(out, eager) < 1e-2
        fc1, _ = layer._stacked
        fc1.mul_(-1.0)  # the gate and up halves flip sign: silu(-g) * -u differs from silu(g) * u
        assert te_layers.refresh_te(model) > 0
        graph.replay()
        torch.cuda.synchronize()
        te_layers.remove_te(model)
        want = moe.routed_experts(x, ids, weights, layer)
    assert rel(out, want) < 0.1 and rel(out, eager) > 0.5


@pytest.mark.gpu
def test_te_engine_decodes_in_graphs_and_follows_weight_updates():
    """A CUDA engine with `fp8="te-current"` (TE linears, and TE experts where cuBLASLt allows)
    replays decode graphs; after `update_weights` it generates what a fresh TE engine built on the
    new weights generates (TE's caches were refreshed in place, under the captured graphs)."""
    from megatron_rollout.engine import RolloutEngine, SamplingParams
    from megatron_rollout.engine.config import EngineConfig

    cfg, model = _te_model(2)
    config = EngineConfig(scheduler=SchedulerConfig(block_size=16, max_batch_tokens=512), kv=KVConfig(num_blocks=256),
                          runner=RunnerConfig(fp8="te-current"))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    prompts = [list(range(3, 40)), list(range(100, 117))]
    new = {k: v + 0.02 * torch.randn_like(v) for k, v in model.state_dict().items()}
    engine = RolloutEngine(model, config)
    engine.generate(prompts, greedy)  # captures the decode graphs on the old weights
    engine.update_weights(new, version=1)
    replays = engine.runner.stats["graph_replays"]
    got = [r.token_ids for r in engine.generate(prompts, greedy)]
    assert engine.runner.stats["graph_replays"] > replays > 0
    _, fresh = _te_model(2)
    fresh.load_state_dict(new)
    want = [r.token_ids for r in RolloutEngine(fresh, config).generate(prompts, greedy)]
    assert got == want
