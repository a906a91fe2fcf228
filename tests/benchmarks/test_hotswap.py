"""The hot-swap benchmark runs end to end on CPU with tiny-moe and reports what it promises."""
import json

import pytest
import torch

from benchmarks import hotswap
from megatron_rollout.model.config import preset
from megatron_rollout.model.sharding import full_shapes


def test_hotswap_smoke_json(capsys):
    hotswap.main(["--model", "tiny-moe", "--device", "cpu", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert {"model", "device", "model_bytes", "copy_bandwidth_gbps", "modes", "graphs", "verified"} <= set(out)
    assert out["model"] == "tiny-moe" and out["device"] == "cpu" and out["verified"] is True
    assert out["model_bytes"] == 4 * sum(torch.Size(s).numel() for s in full_shapes(preset("tiny-moe")).values())
    assert set(out["modes"]) == {"copy", "bind", "reshard"}
    for mode in out["modes"].values():
        assert len(mode["times_s"]) == 3 and mode["median_s"] == sorted(mode["times_s"])[1] > 0
        assert mode["weight_gbps"] == pytest.approx(out["model_bytes"] / mode["median_s"] / 1e9)
    assert 0 < out["modes"]["reshard"]["joined_bytes_fraction"] < 1
    assert out["graphs"]["same_after_copy"] is True  # no graphs on CPU: the check holds trivially
    assert out["weight_version"] == 3 * 4  # (warm-up + 3 repeats) x 3 modes, every one a new version


def test_half_layer_source_lends_only_equal_shapes():
    cfg = preset("tiny-moe")  # layer 0 dense, layers 1-2 MoE: layer 2 borrows nothing from layer 0's MLP
    lend = hotswap.lenders(cfg)
    assert lend["decoder.layers.2.input_layernorm.weight"] == "decoder.layers.0.input_layernorm.weight"
    assert lend["decoder.layers.2.mlp.router.weight"] is None and lend["decoder.layers.1.mlp.router.weight"] is None
    state = hotswap.half_layer_state(cfg, torch.device("cpu"), seed=0)
    assert state["decoder.layers.2.input_layernorm.weight"] is state["decoder.layers.0.input_layernorm.weight"]
    assert set(state) == set(full_shapes(cfg))


def test_tp2_split_round_trips_through_join():
    from megatron_rollout.weights.megatron_layout import join_tp

    full = torch.arange(8 * 4.0).reshape(8, 4)
    for name in ("decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.self_attention.linear_proj.weight",
                 "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"):
        parts = hotswap.tp2_split(name, full)
        assert torch.equal(join_tp(name, parts), full)
        assert len(parts) == (1 if ".experts." in name else 2)
    gate_up = hotswap.tp2_split("decoder.layers.0.mlp.linear_fc1.weight", full)
    assert torch.equal(gate_up[0], torch.cat([full[0:2], full[4:6]]))  # [gate_0; up_0]
