"""The rendezvous benchmark's CLI on 2 processes, a few rounds: one JSON object with both paths'
figures, positive, and the native path faster than the store path."""
from __future__ import annotations

import json

import pytest

from benchmarks import rendezvous as bench
from megatron_rollout.comm import shm_rendezvous as shm


def test_cli_prints_one_json_object(capsys):
    try:
        shm.load_extension()
    except shm.NativeUnavailable as exc:
        pytest.skip(f"native rendezvous not buildable here: {exc}")
    assert bench.main(["--ranks", "2", "--rounds", "300", "--store-rounds", "30", "--warmup", "20", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert (res["ranks"], res["rounds"], res["store_rounds"], res["warmup"]) == (2, 300, 30, 20)
    for key in ("store_us", "store_p10_us", "store_p90_us", "native_us", "native_p10_us", "native_p90_us"):
        assert isinstance(res[key], float) and res[key] > 0, (key, res)
    assert res["store_p10_us"] <= res["store_us"] <= res["store_p90_us"]
    assert res["native_p10_us"] <= res["native_us"] <= res["native_p90_us"]
    assert res["native_us"] < res["store_us"] and res["speedup"] == pytest.approx(res["store_us"] / res["native_us"])


def test_cli_rejects_bad_counts(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--ranks", "0"])
    assert "--ranks must be at least 1, got 0" in capsys.readouterr().err
