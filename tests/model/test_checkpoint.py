"""HF checkpoint import/export: logits parity with transformers per family, lossless round trips,
sharded lazy loading, and clear errors for checkpoints that do not fit."""
from __future__ import annotations

import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from megatron_rollout.comm.facade import LocalComm
from megatron_rollout.model import checkpoint as ckpt
from megatron_rollout.model.attention import DenseKVCache
from megatron_rollout.model.config import PRESETS
from megatron_rollout.model.layers import run_to_end
from megatron_rollout.model.sharding import full_shapes, local_name, shard_tensor
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.types import Axis, Phase

V = 96
_COMMON = dict(vocab_size=V, hidden_size=32, num_attention_heads=4, rms_norm_eps=1e-6, attn_implementation="eager",
               max_position_embeddings=256)
# Each family also covers a corner: mixed dense/MoE + unnormalised top-k (qwen3_moe), tied embeddings
# (qwen3), one KV head (llama), head_dim != hidden/heads + sliding window (mistral), renormalised top-k (mixtral).
FAMILIES = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **_COMMON, num_hidden_layers=3, num_key_value_heads=2, head_dim=8, intermediate_size=48,
        moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2, mlp_only_layers=[1], decoder_sparse_step=1,
        norm_topk_prob=False, rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
    "qwen3": lambda: transformers.Qwen3Config(
        **_COMMON, num_hidden_layers=2, num_key_value_heads=2, head_dim=8, intermediate_size=48,
        tie_word_embeddings=True),
    "llama": lambda: transformers.LlamaConfig(
        **_COMMON, num_hidden_layers=2, num_key_value_heads=1, intermediate_size=48),
    "mistral": lambda: transformers.MistralConfig(
        **_COMMON, num_hidden_layers=2, num_key_value_heads=2, head_dim=16, intermediate_size=48, sliding_window=64),
    "mixtral": lambda: transformers.MixtralConfig(
        **_COMMON, num_hidden_layers=2, num_key_value_heads=2, intermediate_size=24, num_local_experts=4,
        num_experts_per_tok=2),
}
MAX_DIFF: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def _report_parity():
    yield
    if MAX_DIFF:
        print("\nmax |logit diff| vs transformers per family: "
              + ", ".join(f"{k} {v:.2e}" for k, v in sorted(MAX_DIFF.items())))


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """HF's 0.02-std init gives near-zero logits; larger weights make routing and parity meaningful."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if "embed" in name else 0.2))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(FAMILIES[name]()).eval()
    _randomise(hf, seed=1)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    return name, hf, path, ckpt.load_pretrained(path)


def _prompts(seed: int = 3, lens=(9, 5, 1, 12)) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=gen) for n in lens]


def incremental(model: MoETransformer, seqs: list[torch.Tensor], rounds: list[list[int]]) -> list[torch.Tensor]:
    """Feed `rounds[r][s]` new tokens of sequence s per forward through a DenseKVCache; per-sequence logits."""
    cache = DenseKVCache(model.cfg.num_layers, len(seqs))
    done, out = [0] * len(seqs), [[] for _ in seqs]
    for new in rounds:
        cache.begin(new)
        tokens = torch.cat([s[d:d + n] for s, d, n in zip(seqs, done, new)])
        logits = run_to_end(model.step(tokens, cache.positions(), cache, Phase.D))
        cache.end()
        for i, part in enumerate(logits.split(new)):
            out[i].append(part)
            done[i] += new[i]
    return [torch.cat(o) for o in out]


def max_logit_diff(hf, model, seqs: list[torch.Tensor]) -> float:
    """Largest |logit| difference against transformers over `seqs`, for the native model's padded
    full-sequence forward and for its incremental (chunked prefill, then decode) forward."""
    with torch.no_grad():
        ref = [hf(s[None]).logits[0] for s in seqs]
        padded = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.long)
        for i, s in enumerate(seqs):
            padded[i, : len(s)] = s
        full = model(padded)
        inc = incremental(model, seqs, [[4, 2, 1, 7], [5, 0, 0, 1], [0, 3, 0, 4]])
    assert ref[0].abs().max() > 1.0, "logits too small for the comparison to mean anything"
    return max(max((full[i, : len(s)] - r).abs().max().item(), (inc[i] - r).abs().max().item())
               for i, (s, r) in enumerate(zip(seqs, ref)))


def test_logits_match_transformers(family):
    name, hf, _, model = family
    diff = max_logit_diff(hf, model, _prompts())
    MAX_DIFF[name] = diff
    print(f"\n[{name}] max |logit diff| vs transformers (fp32): {diff:.2e}")
    assert diff < 1e-4


def test_round_trip_is_lossless(family):
    name, hf, path, model = family
    arch = ckpt.architecture_of(hf.config)
    on_disk = load_file(path / "model.safetensors")  # per-expert layout, what transformers writes
    state = ckpt.hf_to_megatron(on_disk, model.cfg, arch)
    assert {k: tuple(v.shape) for k, v in state.items()} == full_shapes(model.cfg)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    back = ckpt.megatron_to_hf(state, model.cfg, arch)
    assert back.keys() == on_disk.keys()
    assert all(torch.equal(back[k], on_disk[k]) for k in on_disk)
    # transformers 5's in-memory modules hold fused experts; that layout converts to the same weights
    tied = model.cfg.tie_word_embeddings
    in_memory = {k: v for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    fused = ckpt.hf_to_megatron(in_memory, model.cfg, arch)
    assert all(torch.equal(fused[k], state[k]) for k in state)
    back_fused = ckpt.megatron_to_hf(state, model.cfg, arch, fused_experts=True)
    assert back_fused.keys() == in_memory.keys()
    assert all(torch.equal(back_fused[k], in_memory[k]) for k in in_memory)
    streamed = list(ckpt.hf_items(state.items(), model.cfg, arch))  # one tensor at a time, as a peer loads them
    assert sorted(k for k, _ in streamed) == sorted(on_disk) and len(streamed) == len(on_disk)
    assert all(torch.equal(t, on_disk[k]) for k, t in streamed)
    with pytest.raises(ValueError, match="not a tensor of this config"):
        next(ckpt.hf_items([("decoder.layers.0.nothing.weight", torch.zeros(1))], model.cfg, arch))


def test_saved_checkpoint_loads_in_transformers(family, tmp_path):
    name, hf, _, model = family
    ckpt.save_pretrained(model, model.cfg, tmp_path, ckpt.architecture_of(hf.config))
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = _prompts(lens=(10,))[0][None]
    with torch.no_grad():
        assert torch.equal(again(ids).logits, hf(ids).logits)
    assert ckpt.config_from_hf(tmp_path) == model.cfg


# ---------------------------------------------------------------- config

def test_config_corners():
    hc = transformers.Qwen3MoeConfig(vocab_size=V, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                     num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=3,
                                     moe_intermediate_size=8, intermediate_size=40, decoder_sparse_step=2,
                                     mlp_only_layers=[3], norm_topk_prob=True, rms_norm_eps=1e-5,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    cfg = ckpt.config_from_hf(hc)
    assert cfg.moe_layer_freq == (0, 1, 0, 0)  # layers 0 and 2 by the sparse step, 3 by mlp_only_layers
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.ffn_hidden_size) == (4, 3, 8, 40)
    assert cfg.moe_renormalize_topk and cfg.qk_layernorm and not cfg.tie_word_embeddings
    assert (cfg.kv_channels, cfg.num_query_groups, cfg.rotary_base, cfg.layernorm_epsilon) == (16, 1, 1e6, 1e-5)
    mistral = ckpt.config_from_hf(FAMILIES["mistral"]())
    assert mistral.max_position_embeddings == 64 and not mistral.qk_layernorm  # capped at the sliding window
    for arch_name, make in FAMILIES.items():
        cfg = ckpt.config_from_hf(make())
        arch = ckpt.architecture_of(make())
        assert ckpt.config_from_hf(ckpt.hf_config_from(cfg, arch)).replace(max_position_embeddings=1) == \
            cfg.replace(max_position_embeddings=1), arch_name


def test_rope_scaling_is_rejected():
    hc = transformers.LlamaConfig(vocab_size=V, hidden_size=32, num_attention_heads=4, num_hidden_layers=1,
                                  rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(ValueError, match="'linear'.*not supported"):
        ckpt.config_from_hf(hc)


def test_unknown_architecture(tmp_path):
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*Qwen3MoeForCausalLM.*MixtralForCausalLM"):
        ckpt.load_pretrained(tmp_path)


def test_config_that_an_architecture_cannot_express():
    with pytest.raises(ValueError, match="shared expert"):
        ckpt.hf_config_from(PRESETS["tiny-moe"], ckpt.QWEN3_MOE)
    with pytest.raises(ValueError, match="dense but layers"):
        ckpt.hf_config_from(PRESETS["tiny-moe"].replace(qk_layernorm=False, moe_shared_expert_intermediate_size=0),
                            ckpt.LLAMA)


# ---------------------------------------------------------------- bad checkpoints

def _drop(t):
    del t["model.layers.0.self_attn.k_proj.weight"]


def _extra(t):
    t["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)


def _reshape(t):
    t["model.layers.1.mlp.up_proj.weight"] = torch.zeros(40, 32)


def _float64(t):
    t["model.norm.weight"] = t["model.norm.weight"].double()


@pytest.mark.parametrize("mutate, message", [
    (_drop, r"lacks 1 tensor.*model\.layers\.0\.self_attn\.k_proj\.weight"),
    (_extra, r"unexpected tensor.*model\.layers\.0\.self_attn\.q_proj\.bias"),
    (_reshape, r"model\.layers\.1\.mlp\.up_proj\.weight.*shape \(40, 32\), expected \(48, 32\)"),
    (_float64, r"model\.norm\.weight.*dtype torch\.float64.*supported"),
])
def test_bad_checkpoint_fails_before_building_a_model(tmp_path_factory, monkeypatch, mutate, message):
    src = tmp_path_factory.mktemp("good")
    hf = transformers.AutoModelForCausalLM.from_config(FAMILIES["llama"]())
    hf.save_pretrained(src)
    bad = tmp_path_factory.mktemp("bad")
    shutil.copy(src / "config.json", bad / "config.json")
    tensors = load_file(src / "model.safetensors")
    mutate(tensors)
    save_file(tensors, bad / "model.safetensors")

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built before the checkpoint was validated")

    monkeypatch.setattr(ckpt, "MoETransformer", no_model)
    with pytest.raises(ValueError, match=message):
        ckpt.load_pretrained(bad)


def test_pytorch_bin_checkpoint(family, tmp_path):
    name, _, path, model = family
    shutil.copy(path / "config.json", tmp_path / "config.json")
    torch.save(load_file(path / "model.safetensors"), tmp_path / "pytorch_model.bin")
    loaded = ckpt.load_pretrained(tmp_path)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())


def test_multi_file_checkpoint_reads_the_files_its_index_names(family, tmp_path):
    name, hf, _, model = family
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)}, tmp_path / "consolidated.safetensors")
    loaded = ckpt.load_pretrained(tmp_path)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())


def test_tokens_outside_vocabulary(family):
    _, _, _, model = family
    with pytest.raises(ValueError, match=f"token id {V} is outside the vocabulary"):
        model(torch.tensor([[1, 2, V]]))
    with pytest.raises(ValueError, match="token id -1"):
        model(torch.tensor([[-1, 2]]))


# ---------------------------------------------------------------- sharded, lazy loading

class _FakeShardComm(LocalComm):
    """Claims a place in an ATP x EP layout; nothing here issues a collective."""

    def __init__(self, atp: tuple[int, int], ep: tuple[int, int]) -> None:
        super().__init__()
        self.ranks = {Axis.ATP: atp, Axis.EP: ep}

    def size(self, axis):
        return self.ranks.get(axis, (0, 1))[1]

    def rank(self, axis):
        return self.ranks.get(axis, (0, 1))[0]


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
def test_sharded_load_reads_only_its_experts(family, monkeypatch, tmp_path, fused):
    name, hf, path, full_model = family
    cfg = full_model.cfg
    if not cfg.num_moe_experts:
        pytest.skip("dense family")
    if fused:  # the same weights with experts stored as [E, ...] tensors
        shutil.copy(path / "config.json", tmp_path / "config.json")
        arch = ckpt.architecture_of(hf.config)
        save_file(ckpt.megatron_to_hf(full_model.state_dict(), cfg, arch, fused_experts=True),
                  tmp_path / "model.safetensors")
        path = tmp_path
    reads = []
    original = ckpt._SafetensorsSource.read
    monkeypatch.setattr(ckpt._SafetensorsSource, "read", lambda self, part: reads.append(part) or original(self, part))
    comm = _FakeShardComm(atp=(1, 2), ep=(1, 2))
    model = ckpt.load_pretrained(path, comm=comm)
    local = model.state_dict()
    for full_name, tensor in full_model.state_dict().items():
        mine = local_name(full_name, cfg, comm.shard)
        if mine is not None:
            assert torch.equal(local[mine], shard_tensor(full_name, tensor, cfg, comm.shard)), full_name
    per_rank = cfg.num_moe_experts // 2
    experts_read = {p.expert if fused else int(p.name.split(".experts.")[1].split(".")[0])
                    for p in reads if ".experts." in p.name}
    assert all((p.expert is not None) == fused for p in reads if ".experts." in p.name)
    assert experts_read == set(range(per_rank, 2 * per_rank))


def test_load_model_from_a_preset_or_a_directory(tmp_path):
    preset = ckpt.load_model("tiny-moe")
    ref = MoETransformer(PRESETS["tiny-moe"]).init_weights(seed=0)
    assert all(torch.equal(preset.state_dict()[k], v) for k, v in ref.state_dict().items())
    hf = transformers.AutoModelForCausalLM.from_config(FAMILIES["mixtral"]())
    hf.save_pretrained(tmp_path / "mixtral")
    loaded = ckpt.load_model(str(tmp_path / "mixtral"))
    want = ckpt.hf_to_megatron(hf.state_dict(), loaded.cfg, ckpt.MIXTRAL)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in want.items())
    with pytest.raises(ValueError, match="neither a preset.*tiny-moe"):
        ckpt.load_model(str(tmp_path / "nowhere"))


def test_dtype_override(family):
    _, _, path, model = family
    bf16 = ckpt.load_pretrained(path, dtype=torch.bfloat16)
    assert bf16.cfg.dtype == "bfloat16"
    assert all(v.dtype == torch.bfloat16 for v in bf16.state_dict().values())
    assert torch.equal(bf16.state_dict()["decoder.final_layernorm.weight"],
                       model.state_dict()["decoder.final_layernorm.weight"].bfloat16())
