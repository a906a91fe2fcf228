"""The sleep/wake benchmark runs end to end on CPU with tiny-moe and reports what it promises."""
import json

import pytest

from benchmarks import sleep_wake


@pytest.mark.timeout(120)
def test_sleep_wake_smoke_json(tmp_path, capsys):
    sleep_wake.main(["--model", "tiny-moe", "--device", "cpu", "--cycles", "2", "--rows", "3", "--prompt-len", "12",
                     "--new-tokens", "5", "--tags", "all", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "sleep_wake.json").read_text())
    assert result == json.loads(capsys.readouterr().out)
    assert result["ok"] is True and [r["stable_memory"] for r in result["runs"]] == ["off"]  # CPU: one path
    out = result["runs"][0]
    assert result["seconds"] == {"off": {"sleep_s": [c["sleep_s"] for c in out["cycles"]],
                                         "wake_s": [c["wake_s"] for c in out["cycles"]]}}
    assert out["model"] == "tiny-moe" and out["ok"] is True and len(out["cycles"]) == 2 and not out["kv_stable"]
    assert out["kv_blocks"] == 3 * 2  # 17 positions a row, 16 a block
    for cycle in out["cycles"]:
        assert cycle["tokens_match"] and cycle["max_logprob_diff"] == 0.0 and cycle["freed_gib"] is None
        assert cycle["sleep"]["asleep"] == ["graphs", "kv", "weights"] and cycle["wake"]["asleep"] == []
        assert cycle["paths"] == {"kv": "reallocate", "weights": "offload"} and cycle["graph_captures"] is None
        assert cycle["sleep"]["tags"]["weights"]["tensor_bytes"] == out["model_bytes"]
        assert cycle["wake"]["tags"]["kv"]["tensor_bytes"] == pytest.approx(out["kv_gib"] * 2 ** 30)


@pytest.mark.timeout(120)
def test_sleep_wake_sleeps_the_tags_asked(tmp_path, capsys):
    sleep_wake.main(["--model", "tiny-moe", "--device", "cpu", "--cycles", "1", "--rows", "2", "--prompt-len", "12",
                     "--new-tokens", "3", "--tags", "kv", "--stable-memory", "off"])
    cycle = json.loads(capsys.readouterr().out)["runs"][0]["cycles"][0]
    assert cycle["sleep"]["asleep"] == ["graphs", "kv"] and cycle["paths"] == {"kv": "reallocate"}
    assert cycle["tokens_match"]
