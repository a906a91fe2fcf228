import json

import pytest

from megatron_rollout.trace.timeline import Timeline, merge
from megatron_rollout.types import Phase


def _load(tl, path):
    tl.write_chrome_trace(path)
    return json.loads(path.read_text())


def test_chrome_trace_has_spans_rows_and_names(tmp_path):
    tl = Timeline()
    tl.record(0, "P", "P seg 1", 10.0, 10.004, epoch=3, boundary=1)
    tl.record(0, Phase.D, "D iter", 10.004, 10.005, rows=8)
    tl.record(0, "P", "P seg 2", 10.005, 10.010, epoch=3, boundary=2)
    data = _load(tl, tmp_path / "tl.json")
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in spans] == ["P seg 1", "D iter", "P seg 2"]
    first, d, _ = spans
    assert first["ts"] == pytest.approx(0.0) and first["dur"] == pytest.approx(4000.0)  # microseconds
    assert d["ts"] == pytest.approx(4000.0) and d["dur"] == pytest.approx(1000.0)
    assert first["pid"] == d["pid"] == 0 and first["tid"] != d["tid"]
    assert first["args"] == {"epoch": 3, "boundary": 1} and d["cat"] == "D"
    meta = {(e["name"], e["tid"]): e["args"] for e in data["traceEvents"] if e["ph"] == "M"}
    assert meta[("process_name", 0)] == {"name": "rank 0"}
    assert meta[("thread_name", first["tid"])] == {"name": "P"}
    assert meta[("thread_name", d["tid"])] == {"name": "D"}


def test_merge_gathers_ranks_aligned_by_origin(tmp_path):
    ranks = []
    for rank, origin in ((0, 50.0), (1, 900.0)):  # two clocks, aligned after a barrier
        tl = Timeline(origin=origin)
        tl.record(rank, "D", "D iter", origin + 0.001, origin + 0.002)
        tl.record(rank, "P", "P seg", origin + 0.002, origin + 0.005)
        ranks.append(tl)
    merged = merge(ranks)
    assert len(merged) == 4 and len(ranks[0]) == 2
    data = _load(merged, tmp_path / "tl.json")
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert sorted((e["pid"], e["name"], round(e["ts"])) for e in spans) == [
        (0, "D iter", 0), (0, "P seg", 1000), (1, "D iter", 0), (1, "P seg", 1000)]
    names = {e["pid"]: e["args"]["name"] for e in data["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}


def test_empty_timeline_writes_valid_json(tmp_path):
    assert _load(Timeline(), tmp_path / "tl.json")["traceEvents"] == []


def test_record_rejects_bad_spans():
    tl = Timeline()
    with pytest.raises(ValueError, match="phase must be 'P' or 'D', got 'X'"):
        tl.record(0, "X", "s", 0.0, 1.0)
    with pytest.raises(ValueError, match="ends .* before it starts"):
        tl.record(0, "P", "s", 2.0, 1.0)
    with pytest.raises(ValueError, match="rank must be an integer >= 0"):
        tl.record(-1, "P", "s", 0.0, 1.0)
    assert len(tl) == 0
