"""benchmarks.mla's argument parsing on CPU; the measurement itself is a GPU test (tiny DeepSeek)."""
from __future__ import annotations

import json

import pytest

from benchmarks import mla


def test_points_specs_and_tiles_parse():
    assert mla.parse_points("1x2048, 64x512") == [(1, 2048), (64, 512)]
    assert mla.parse_specs("4096;2048+2048;3x100+20") == [[(0, 4096)], [(2048, 2048)], [(100, 20)] * 3]
    assert mla.parse_tiles("16/32/4/2,64/32/8/3", mla.DECODE_TILE) == [
        {"decode_block_h": 16, "decode_block_n": 32, "decode_warps": 4, "decode_stages": 2},
        {"decode_block_h": 64, "decode_block_n": 32, "decode_warps": 8, "decode_stages": 3}]
    for bad in ("64", "0x100", "4x1", "ax3"):
        with pytest.raises(ValueError, match="decode point"):
            mla.parse_points(bad)
    for bad in ("1", "0x100", "x+", "2048+"):
        with pytest.raises(ValueError, match="prefill spec"):
            mla.parse_specs(bad)
    with pytest.raises(ValueError, match="tile '16/32'"):
        mla.parse_tiles("16/32", mla.DECODE_TILE)


def test_main_refuses_bad_arguments_before_needing_a_gpu():
    with pytest.raises(ValueError, match="decode point"):
        mla.main(["--decode", "64"])
    with pytest.raises(ValueError, match="tile"):
        mla.main(["--prefill-tiles", "16/64"])


@pytest.mark.gpu
def test_tiny_deepseek_run_compiles_nothing_while_timed(tmp_path):
    out = tmp_path / "mla.json"
    assert mla.main(["--model", "tiny-deepseek", "--decode", "1x64,4x128", "--prefill", "100;2x30+40",
                     "--prefill-buckets", "128", "--decode-tiles", "16/32/4/2,16/64/4/2", "--prefill-tiles",
                     "16/64/32/4/2", "--kernel-decode", "4x256", "--kernel-prefill", "2x(64+64)", "--kv-gb", "0.05",
                     "--iters", "3", "--rounds", "1", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["attention"] == "TritonMLA" and got["graph_safe"] and got["capture_error"] is None
    assert got["compiles_in_timed_regions"] == 0
    assert [d["rows"] for d in got["decode"]] == [1, 4] and all(d["graph_ms"] > 0 for d in got["decode"])
    assert got["prefill"][0]["mode"] == "piecewise"
    assert got["kernels"]["decode"]["tiles"]["16/64/4/2"]["rel_err_vs_first"] < 2e-2
