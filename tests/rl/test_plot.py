"""rl.plot: the summary the docs quote, from a run's metrics.jsonl."""
import json

import pytest

from rl.plot import load, summary


def _step(i, **kw):
    return {"step": i, "reward_mean": 0.1 * i, "reward_std": 0.0, "rollout_s": 1.0 + i, "sleep_s": 0.01,
            "train_s": 0.5, "wake_s": 0.02, "update_weights_s": 0.004 * (i + 1), "weights": "shared", **kw}


def test_summary_quotes_rewards_medians_and_memory(tmp_path):
    history = [_step(i, peak_gpu_mem_gib=2.0 + i, asleep_gib=1.0, rollout_peak_gib=2.0, train_peak_gib=1.5)
               for i in range(10)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in history) + "\n")
    text = summary(load(tmp_path))
    assert text.splitlines()[0] == "10 steps; reward first-5 0.200 -> last-5 0.700"
    assert "| rollout (s) | 5.500 | 10.000 |" in text
    assert "| weight sync (s) | 0.022 | 0.040 |" in text
    assert "| peak GPU memory (GiB) | 6.500 | 11.000 |" in text and "| engine asleep (GiB) | 1.000 | 1.000 |" in text
    assert text.endswith("engine weights: shared")
    cpu = summary([_step(i, peak_gpu_mem_gib=None) for i in range(3)])
    assert "GiB" not in cpu


def test_load_names_the_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="--out directory"):
        load(tmp_path)
