"""benchmarks.te_megatron: TE-spec Megatron names -> rollout names (CPU), and the trainer step -> hot swap ->
logits parity run on the GPU.

A TE-spec `GPTModel` cannot be built without Transformer Engine (megatron-core 0.16.1's
`get_gpt_layer_with_transformer_engine_spec` dies with a NameError on `TESpecProvider` when TE is
absent, and its TE classes are MagicMock stand-ins), so the CPU tests use a hand-written list of the
state-dict names such a model has, read from the sources:
- megatron-core 0.16.1 and 0.19.2, `models/gpt/gpt_layer_specs.py`,
  `get_gpt_layer_with_transformer_engine_spec`(_submodules): `linear_qkv` is
  `TELayerNormColumnParallelLinear` (input norm fused in) and there is no `input_layernorm`;
  `pre_mlp_layernorm` is `TENorm` for MoE layers and `IdentityOp` for dense ones, whose
  `mlp.linear_fc1` is again `TELayerNormColumnParallelLinear` (`get_mlp_module_spec_for_backend`);
  `q_layernorm`/`k_layernorm` are `TENorm`;
- `extensions/transformer_engine_spec_provider.py`, `grouped_mlp_modules`: with `moe_grouped_gemm`,
  `TEGroupedMLP` over `TEColumnParallelGroupedLinear`/`TERowParallelGroupedLinear`, else
  `SequentialMLP` of `TEColumnParallelLinear`/`TERowParallelLinear` (`local_experts.K`);
- Transformer Engine 2.20.2, `pytorch/module/layernorm_linear.py`: `register_parameter("layer_norm_weight")`,
  `layer_norm_bias` only when normalization is not RMSNorm; `pytorch/module/grouped_linear.py`:
  `register_parameter(f"weight{i}")` per GEMM; every TE module adds an `_extra_state` entry.
"""
from __future__ import annotations

import io
import re

import pytest
import torch

from benchmarks import te_megatron as tm
from megatron_rollout.engine import EngineConfig, KVConfig, RolloutEngine, SamplingParams
from megatron_rollout.model.config import PRESETS, ModelConfig
from megatron_rollout.model.sharding import full_shapes
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.weights import megatron_names as mn

# Layer 0 dense, layer 1 MoE (2 experts, a shared expert), qk norm, untied output layer.
SMALL = ModelConfig(vocab_size=32, hidden_size=16, num_layers=2, num_attention_heads=2, num_query_groups=1,
                    kv_channels=8, ffn_hidden_size=32, num_moe_experts=2, moe_router_topk=1, moe_ffn_hidden_size=16,
                    moe_shared_expert_intermediate_size=16, moe_layer_freq=(0, 1), qk_layernorm=True)

_ATTN = ["self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight",
         "self_attention.linear_qkv._extra_state", "self_attention.q_layernorm.weight",
         "self_attention.q_layernorm._extra_state", "self_attention.k_layernorm.weight",
         "self_attention.k_layernorm._extra_state", "self_attention.core_attention._extra_state",
         "self_attention.linear_proj.weight", "self_attention.linear_proj._extra_state"]
# The state-dict names of SMALL's GPTModel on the TE spec with grouped experts (see the module docstring;
# TE's RMSNorm is an `ops` module, whose `get_extra_state` (TE 2.20.2 pytorch/ops/op.py) adds its entry).
TE_SPEC_NAMES_GROUPED = (
    ["embedding.word_embeddings.weight"]
    + [f"decoder.layers.0.{n}" for n in _ATTN]
    + [f"decoder.layers.0.mlp.{n}" for n in ("linear_fc1.layer_norm_weight", "linear_fc1.weight",
                                             "linear_fc1._extra_state", "linear_fc2.weight", "linear_fc2._extra_state")]
    + [f"decoder.layers.1.{n}" for n in _ATTN]
    + ["decoder.layers.1.pre_mlp_layernorm.weight", "decoder.layers.1.pre_mlp_layernorm._extra_state",
       "decoder.layers.1.mlp.router.weight"]
    + [f"decoder.layers.1.mlp.experts.{n}" for n in ("linear_fc1.weight0", "linear_fc1.weight1",
                                                     "linear_fc1._extra_state", "linear_fc2.weight0",
                                                     "linear_fc2.weight1", "linear_fc2._extra_state")]
    + [f"decoder.layers.1.mlp.shared_experts.{n}" for n in ("linear_fc1.weight", "linear_fc1._extra_state",
                                                            "linear_fc2.weight", "linear_fc2._extra_state")]
    + ["decoder.final_layernorm.weight", "decoder.final_layernorm._extra_state", "output_layer.weight"])
TE_SPEC_NAMES_SEQUENTIAL = [
    n for n in TE_SPEC_NAMES_GROUPED if ".mlp.experts." not in n] + [
    f"decoder.layers.1.mlp.experts.local_experts.{k}.linear_fc{f}.{s}"
    for k in (0, 1) for f in (1, 2) for s in ("weight", "_extra_state")]


def te_spec_state(native: dict[str, torch.Tensor], cfg: ModelConfig, grouped: bool = True) -> dict[str, object]:
    """A native (local-spec) state renamed as the TE spec names it, plus an `_extra_state` entry per TE
    module; written from Megatron's and TE's sources, independently of the module under test."""
    out: dict[str, object] = {}
    for name, t in native.items():
        m = re.match(r"^(decoder\.layers\.(\d+)\.)(.*)$", name)
        layer, rest = (m.group(1), m.group(3)) if m else ("", name)
        expert = re.match(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$", rest)
        if rest == "input_layernorm.weight":
            name = layer + "self_attention.linear_qkv.layer_norm_weight"
        elif rest == "pre_mlp_layernorm.weight" and not cfg.is_moe_layer(int(m.group(2))):
            name = layer + "mlp.linear_fc1.layer_norm_weight"
        elif grouped and expert:
            name = f"{layer}mlp.experts.linear_fc{expert.group(2)}.weight{expert.group(1)}"
        out[name] = t
    te_modules = {re.sub(r"\.(layer_norm_weight|weight\d*)$", "", n) for n in out}
    te_modules -= {"embedding.word_embeddings", "output_layer"} | {n for n in te_modules if n.endswith("router")}
    te_modules |= {f"decoder.layers.{i}.self_attention.core_attention" for i in range(cfg.num_layers)}
    for module in sorted(te_modules):
        out[module + "._extra_state"] = io.BytesIO() if len(module) % 2 else None
    return out


def _tensors(names, cfg: ModelConfig) -> dict[str, object]:
    """Each weight name with a distinct tensor of its rollout shape; extra states as TE leaves them."""
    shapes = full_shapes(cfg)
    out: dict[str, object] = {}
    for i, name in enumerate(names):
        if "_extra_state" in name:
            out[name] = io.BytesIO() if i % 2 else None
        else:
            out[name] = torch.full(shapes[mn.rollout_name(name)], float(i))
    return out


def test_the_hand_written_state_matches_the_listed_te_spec_names():
    native = MoETransformer(SMALL).state_dict()
    assert sorted(te_spec_state(native, SMALL, grouped=True)) == sorted(TE_SPEC_NAMES_GROUPED)
    assert sorted(te_spec_state(native, SMALL, grouped=False)) == sorted(TE_SPEC_NAMES_SEQUENTIAL)


@pytest.mark.parametrize("names, renamed", [(TE_SPEC_NAMES_GROUPED, 7), (TE_SPEC_NAMES_SEQUENTIAL, 3)])
def test_te_spec_names_map_onto_the_rollout_names(names, renamed):
    state = _tensors(names, SMALL)
    mapped = mn.megatron_state_to_rollout(state, SMALL)
    assert list(mapped.tensors) == list(full_shapes(SMALL))  # every rollout tensor, in the model's order
    assert mapped.renamed == renamed
    assert mapped.skipped == sum("_extra_state" in n for n in names) > 0
    t, l0, l1 = mapped.tensors, "decoder.layers.0.", "decoder.layers.1."
    assert t[l0 + "input_layernorm.weight"] is state[l0 + "self_attention.linear_qkv.layer_norm_weight"]
    assert t[l0 + "pre_mlp_layernorm.weight"] is state[l0 + "mlp.linear_fc1.layer_norm_weight"]
    assert t[l1 + "input_layernorm.weight"] is state[l1 + "self_attention.linear_qkv.layer_norm_weight"]
    assert t[l1 + "pre_mlp_layernorm.weight"] is state[l1 + "pre_mlp_layernorm.weight"]
    expert = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"
    te_expert = "decoder.layers.1.mlp.experts.linear_fc2.weight1" if renamed == 7 else expert
    assert t[expert] is state[te_expert]
    assert t["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"] is state[
        "decoder.layers.1.mlp.shared_experts.linear_fc1.weight"]


@pytest.mark.parametrize("name, fix", [
    ("decoder.layers.0.self_attention.linear_qkv.layer_norm_bias", "normalization='RMSNorm'"),
    ("decoder.layers.0.self_attention.linear_qkv.bias", "add_bias_linear=False"),
    ("decoder.layers.1.mlp.shared_experts.gate_weight", "moe_shared_expert_gate=False"),
    ("decoder.layers.1.mlp.experts.linear_fc1.weight", "moe_single_grouped_weight=False"),
    ("decoder.layers.0.mlp.1.basic_ops.0.weight", "use_te_op_fuser=False"),
    ("decoder.layers.0.self_attention.linear_qkv.weightx", "known renames"),
    ("mtp.layers.0.enorm.weight", "known renames"),
])
def test_unknown_te_names_are_refused_naming_the_fix(name, fix):
    with pytest.raises(ValueError) as err:
        mn.rollout_name(name)
    assert repr(name) in str(err.value) and fix in str(err.value)
    state = _tensors(TE_SPEC_NAMES_GROUPED, SMALL)
    state[name] = torch.zeros(3)
    with pytest.raises(ValueError, match=re.escape(repr(name))):
        mn.megatron_state_to_rollout(state, SMALL)


def test_incomplete_mixed_or_foreign_states_are_refused():
    state = _tensors(TE_SPEC_NAMES_GROUPED, SMALL)
    del state["decoder.layers.1.mlp.experts.linear_fc1.weight1"]
    with pytest.raises(ValueError, match=r"1 rollout tensors unset.*local_experts\.1\.linear_fc1"):
        mn.megatron_state_to_rollout(state, SMALL)
    state = _tensors(TE_SPEC_NAMES_GROUPED, SMALL)
    state["decoder.layers.0.pre_mlp_layernorm.weight"] = torch.ones(16)  # the local spec's name as well
    with pytest.raises(ValueError, match="both map to rollout tensor 'decoder.layers.0.pre_mlp_layernorm.weight'"):
        mn.megatron_state_to_rollout(state, SMALL)
    with pytest.raises(ValueError, match=r"not in this ModelConfig.*decoder\.layers\.1\."):
        mn.megatron_state_to_rollout(_tensors(TE_SPEC_NAMES_GROUPED, SMALL),
                                     SMALL.replace(num_layers=1, moe_layer_freq=(0,)))


@pytest.mark.parametrize("grouped", [True, False])
def test_a_te_spec_state_hot_swaps_through_update_weights(grouped):
    cfg = PRESETS["tiny-moe"]
    trained = MoETransformer(cfg).init_weights(3)
    state = te_spec_state(trained.state_dict(), cfg, grouped)
    engine = tm.rollout_engine(cfg, torch.device("cpu"))  # the script's engine: NaN until the copy
    assert all(p.isnan().all() for p in engine.model.parameters())
    engine.update_weights(mn.megatron_state_to_rollout(state, cfg).tensors, 1)
    got = engine.model.state_dict()
    assert all(torch.equal(got[n], t) for n, t in trained.state_dict().items())
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        parity = tm.logit_parity(engine.model(ids), trained(ids))
    assert (parity.rel_err, parity.max_token_rel_err, parity.top1_agreement) == (0.0, 0.0, 1.0)
    params = SamplingParams(temperature=0.0, max_new_tokens=5)
    want = RolloutEngine(trained, EngineConfig(kv=KVConfig(num_blocks=32))).generate([[256, 72, 105]], params)[0]
    out = engine.generate([[256, 72, 105]], params)[0]
    assert out.token_ids == want.token_ids and len(out.token_ids) == 5 and out.weight_versions == [1] * 5
    # A name the mapping accepts still meets update_weights' shape check (a transposed expert here).
    bad = dict(mn.megatron_state_to_rollout(state, cfg).tensors)
    name = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"
    bad[name] = bad[name].t().contiguous()
    with pytest.raises(ValueError, match=f"weight {re.escape(name)}: shape"):
        engine.update_weights(bad, 2)
    assert engine.weight_version == 1


def test_the_te_layer_spec_takes_the_keywords_the_script_passes():
    """megatron-core 0.16.1 (here) names them in its signature; 0.19.2 forwards them to
    `get_gpt_layer_with_transformer_engine_submodules`, whose signature has the same three."""
    pytest.importorskip("megatron.core")
    import inspect

    from megatron.core.models.gpt import gpt_layer_specs as specs

    params = inspect.signature(specs.get_gpt_layer_with_transformer_engine_spec).parameters
    assert {"num_experts", "moe_grouped_gemm", "qk_layernorm"} <= set(params)
    assert "use_transformer_engine" in inspect.signature(specs.get_gpt_decoder_block_spec).parameters


def test_config_validation_and_the_model_it_builds():
    cfg = tm.TEMegatronConfig().model_config()
    assert (cfg.num_layers, cfg.dtype, cfg.num_moe_experts, cfg.hidden_size) == (2, "bfloat16", 128, 2048)
    tiny = tm.TEMegatronConfig(model="tiny-moe", num_layers=2).model_config()
    assert tiny.moe_layer_freq == (0, 1) and tiny.dtype == "bfloat16"
    for bad, match in [(dict(num_layers=0), "num_layers"), (dict(num_layers=13), r"\[1, 12\]"),
                       (dict(seq_len=1), "seq_len >= 2"), (dict(lr=0.0), "lr"), (dict(model="nope"), "preset"),
                       (dict(fp8_recipes=("mx",)), "unknown FP8 recipes")]:
        with pytest.raises(ValueError, match=match):
            tm.TEMegatronConfig(**bad)


def test_logit_parity_measures_what_it_says():
    ref = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]]])  # [B=1, T=2, V=3]
    same = tm.logit_parity(ref.clone(), ref)
    assert (same.rel_err, same.max_token_rel_err, same.top1_agreement) == (0.0, 0.0, 1.0)
    got = ref.clone()
    got[0, 0] = torch.tensor([1.0, 2.0, 0.0])  # token 0: error norm 2 over norm 1, argmax flips
    p = tm.logit_parity(got, ref)
    assert p.max_token_rel_err == pytest.approx(2.0) and p.mean_token_rel_err == pytest.approx(1.0)
    assert p.rel_err == pytest.approx(2.0 / 5 ** 0.5) and p.top1_agreement == 0.5


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_without_cuda_the_run_says_so():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        tm.run(tm.TEMegatronConfig(model="tiny-moe"))
    with pytest.raises(SystemExit, match="te_megatron: .*CUDA"):
        tm.main(["--model", "tiny-moe", "--layers", "1"])


@pytest.mark.gpu
def test_megatron_te_spec_step_hot_swaps_into_the_rollout_with_logit_parity():
    pytest.importorskip("transformer_engine.pytorch", reason="Transformer Engine not installed (docs/fp8-te.md)")
    pytest.importorskip("megatron.core")
    result = tm.run(tm.TEMegatronConfig(model="tiny-moe", num_layers=3, batch=2, seq_len=64, fp8_recipes=()))
    print(tm.summary(result))
    cfg = tm.TEMegatronConfig(model="tiny-moe", num_layers=3).model_config()
    assert result["spec"].startswith("get_gpt_decoder_block_spec")  # tiny-moe mixes dense and MoE layers
    assert result["names"]["rollout_tensors"] == len(full_shapes(cfg)) and result["names"]["renamed"] > 0
    assert result["params_moved"] > 0 and result["train_loss"] == result["train_loss"]
    assert result["weight_version"] == 1 and result["te_linears"] == 3 * 2 + 2  # qkv, proj per layer; dense fc1/fc2
    te = result["parity"]["te_bf16"]
    assert te["rel_err"] < 2e-2, result["parity"]
    assert te["top1_agreement"] >= 0.9, result["parity"]
    assert result["parity"]["native_bf16"]["rel_err"] < 2e-2, result["parity"]
