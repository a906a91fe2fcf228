"""`benchmarks.mtp` on CPU: the copying model's drafts are all accepted and halve the decode
iterations; greedy tokens equal plain decoding's on both models; nothing compiles inside the timed
calls; the table names every setting."""
from __future__ import annotations

import pytest

from benchmarks.mtp import run, table


@pytest.mark.timeout(300)
def test_cpu_run_measures_both_models():
    report = run("tiny", "cpu", rows=2, prompt_len=5, new_tokens=9, max_k=1, repeats=2, temperature=0.0)
    assert report["runner"] == "ModelRunner"  # auto on CPU: the portable runner, for both sides
    copying, random = report["models"]["copying"], report["models"]["random"]
    assert copying["mtp-k1"]["acceptance_rate"] == 1.0
    assert copying["mtp-k1"]["decode_iterations"] * 2 <= copying["off"]["decode_iterations"] + 2
    assert random["mtp-k1"]["acceptance_rate"] < 1.0
    assert all(f["greedy_tokens_equal_plain"] for m in report["models"].values() for f in m.values())
    assert all(f["tokens_per_s"] > 0 for m in report["models"].values() for f in m.values())
    # the same engine per setting, warmed up: nothing compiled or captured inside the timed calls
    assert all(f["compilations_timed"] == 0 and f["graphs_captured_timed"] == 0
               for m in report["models"].values() for f in m.values())
    assert "copying  mtp-k1" in table(report)
