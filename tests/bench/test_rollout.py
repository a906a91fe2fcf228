"""The benchmark CLI end to end on CPU (tiny model, tiny trace): budget sweep, interleaved warm
repeats of off / chunked / mux / mux-epoch, medians, compile counts, ratios, table and plot."""
from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_rollout.bench import rollout


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    code = rollout.main(["--model", "tiny-moe", "--device", "cpu", "--repeats", "2", "--conversations", "3",
                         "--scale", "0.003", "--budgets", "32,64", "--out", str(out), "--no-progress"])
    assert code == 0
    return out, json.loads((out / "rollout.json").read_text())


def test_sweep_picks_each_schedules_best_budget(run):
    _, result = run
    sweep = result["sweep"]
    assert list(sweep) == ["32", "64"]
    for name in ("off", "chunked", "mux"):
        measured = {int(b): row[name]["report"]["makespan_s"] for b, row in sweep.items()}
        assert result["best_budget"][name] == min(measured, key=measured.get)
        assert result["schedules"][name]["budget"] == result["best_budget"][name]
    assert result["schedules"]["mux-epoch"]["budget"] == result["best_budget"]["mux"]
    assert result["schedules"]["mux-epoch"]["spec"] == "mux@fixed:1000000000"
    assert result["sweep_trace"]["conversations"] == 2  # half of the 3, rounded


def test_repeats_are_interleaved_warm_and_summarised(run):
    _, result = run
    assert list(result["schedules"]) == ["off", "chunked", "mux", "mux-epoch"]
    for name, s in result["schedules"].items():
        assert [r["repeat"] for r in s["repeats"]] == [0, 1]
        for r in s["repeats"]:
            assert r["finished"] and r["warm"], r
            assert r["compilations"]["total"] == 0 and r["compilations"]["triton_source"] == "none"
            assert r["report"]["requests"] == result["trace"]["requests"] and r["report"]["failed"] == 0
            assert r["report"]["output_tokens"] == result["trace"]["output_tokens"]
            assert r["runner"] == "ModelRunner"
            assert r["engine_stats"]["steps"] > 0  # the engine's counters, reset in place, still count
        spans = [r["report"]["makespan_s"] for r in s["repeats"]]
        assert s["median"]["makespan_s"] == pytest.approx(float(np.median(spans)))
        assert s["min"]["makespan_s"] == min(spans) and s["max"]["makespan_s"] == max(spans)
        assert s["n"] == 2 and s["n_cold"] == 0 and s["compilations"] == 0
    ratios = result["ratios"]
    med = {n: s["median"]["makespan_s"] for n, s in result["schedules"].items()}
    assert ratios["mux_over_off"] == pytest.approx(med["mux"] / med["off"])
    assert ratios["mux_epoch_over_mux"] == pytest.approx(med["mux-epoch"] / med["mux"])
    assert ratios["mux_over_best_baseline"] == pytest.approx(med["mux"] / min(med["off"], med["chunked"]))
    assert "mux_over_off@32" in ratios and ratios["best_over_vllm"] is None


def test_table_and_plot(run, capsys):
    out, result = run
    text = rollout.table(result)
    assert "makespan_s med [min-max]" in text and "compiles" in text and "mux-epoch" in text
    assert "sweep (short pass" in text
    pytest.importorskip("matplotlib")
    from megatron_rollout.bench.plot import main as plot_main

    assert plot_main([str(out / "rollout.json"), str(out / "plot.png")]) == 0
    assert (out / "plot.png").stat().st_size > 1000


def test_deadline_stops_cleanly_and_keeps_what_it_measured(tmp_path):
    code = rollout.main(["--model", "tiny-moe", "--device", "cpu", "--repeats", "3", "--conversations", "2",
                         "--scale", "0.002", "--budgets", "64", "--schedules", "off", "--no-ablation",
                         "--deadline-s", "0", "--out", str(tmp_path), "--no-progress"])
    assert code == 0
    result = json.loads((tmp_path / "rollout.json").read_text())
    assert "deadline" in result["stopped"]
    assert result["schedules"]["off"]["repeats"] == []


def test_profile_and_max_model_len_auto(tmp_path):
    """The prefill profile at this scale stays under tiny-moe's 8,192 positions: no raise needed;
    a fixed --max-model-len is passed through."""
    code = rollout.main(["--model", "tiny-moe", "--device", "cpu", "--repeats", "1", "--conversations", "2",
                         "--scale", "0.004", "--profile", "prefill", "--budgets", "64", "--schedules", "mux",
                         "--no-ablation", "--max-model-len", "4096", "--out", str(tmp_path), "--no-progress"])
    assert code == 0
    result = json.loads((tmp_path / "rollout.json").read_text())
    assert result["profile"] == "prefill" and result["max_model_len"] == 4096
    assert result["schedules"]["mux"]["repeats"][0]["finished"]
    assert set(result["warmup"]) == {"mux"}
