"""The benchmark CLI end to end on CPU: tiny model, tiny trace, all three schedules in one run,
JSON written, table printed, plot drawn."""
from __future__ import annotations

import json

import pytest

from megatron_rollout.bench import rollout


def test_bench_runs_three_schedules_on_cpu(tmp_path, capsys):
    code = rollout.main(["--model", "tiny-moe", "--device", "cpu", "--conversations", "2", "--scale", "0.002",
                         "--max-batch-tokens", "64", "--out", str(tmp_path), "--no-progress"])
    assert code == 0
    result = json.loads((tmp_path / "rollout.json").read_text())
    assert list(result["schedules"]) == ["off", "chunked", "mux"]
    for name, s in result["schedules"].items():
        assert s["finished"], s
        report = s["report"]
        assert report["schedule"] == name
        assert report["requests"] == result["trace"]["requests"] and report["failed"] == 0
        assert report["output_tokens"] == result["trace"]["output_tokens"]
        assert s["runner"] == "ModelRunner"
    assert set(result["ratios"]) >= {"mux_over_off", "mux_over_chunked", "mux_decode_wait_ms"}
    out = capsys.readouterr().out
    assert "makespan_s" in out and "mux_over_off" in out
    pytest.importorskip("matplotlib")
    from megatron_rollout.bench.plot import main as plot_main

    assert plot_main([str(tmp_path / "rollout.json"), str(tmp_path / "plot.png")]) == 0
    assert (tmp_path / "plot.png").stat().st_size > 1000


def test_schedule_spec_with_policy_is_parsed(tmp_path):
    code = rollout.main(["--model", "tiny-moe", "--device", "cpu", "--conversations", "1", "--scale", "0.002",
                         "--schedules", "mux@fixed:2", "--out", str(tmp_path), "--no-progress"])
    assert code == 0
    result = json.loads((tmp_path / "rollout.json").read_text())
    assert result["schedules"]["mux@fixed:2"]["finished"]
