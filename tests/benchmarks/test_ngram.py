"""`benchmarks.ngram` on CPU: a periodic text is drafted right every time, a text that never repeats
proposes nothing, and the whole benchmark runs on a one-conversation trace."""
from __future__ import annotations

import pytest

from benchmarks.ngram import main, replay_text


def test_text_acceptance_is_one_on_a_period_and_nothing_where_nothing_repeats():
    periodic = replay_text([1, 2, 3, 4, 5] * 10, 10, k=4, n_min=2, n_max=4)
    assert periodic["acceptance_rate"] == 1.0 and periodic["decode_iterations"] == 40 // 5
    fresh = replay_text(list(range(50)), 10, k=4, n_min=2, n_max=4)
    assert fresh["drafted"] == 0 and fresh["decode_iterations"] == 40


@pytest.mark.timeout(300)
def test_the_benchmark_runs(tmp_path):
    report = main(["--conversations", "1", "--scale", "0.01", "--out", str(tmp_path / "ngram.json")])
    trace = report["trace"]
    assert trace["plain"]["decode_tokens"] == trace["ngram-k4"]["decode_tokens"] > 0
    assert report["text"]["a passage said 3 times"]["acceptance_rate"] > 0.5  # 0.70 measured (docs/benchmarks.md)
    assert (tmp_path / "ngram.json").exists()
