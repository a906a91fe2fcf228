"""benchmarks.attention's parsing and bookkeeping on CPU; the measurement itself is a GPU test."""
from __future__ import annotations

import pytest
import torch

from benchmarks import attention


def test_parse_shape_and_pairs():
    assert attention.parse_shape("8x(2048+512)") == [(2048, 512)] * 8
    assert attention.pairs([(0, 4)]) == 10  # causal: 1 + 2 + 3 + 4
    assert attention.pairs([(3, 2)]) == 2 * 3 + 3  # each new token sees the 3 cached ones
    for bad in ("8(2048+512)", "0x(1+1)", "2x(5+0)", "x(1+2)"):
        with pytest.raises(ValueError, match="shape"):
            attention.parse_shape(bad)


def test_settings_grid():
    grid = attention.triton_settings([64, 128], [2, 3], [8])
    assert len(grid) == 4 and {"prefill_block_n": 128, "prefill_stages": 3, "prefill_warps": 8} in grid
    dec = attention.triton_settings([64], [2, 3], [4], "decode", [8, 16])
    assert len(dec) == 4 and {"decode_block_n": 64, "decode_stages": 3, "decode_warps": 4,
                              "decode_programs_per_sm": 16} in dec
    ver = attention.triton_settings([32, 64], [3], [8], "verify", [2])
    assert ver == [{"verify_block_n": b, "verify_stages": 3, "verify_warps": 8, "verify_programs_per_sm": 2}
                   for b in (32, 64)]


def test_main_refuses_bad_shapes_before_needing_a_gpu():
    with pytest.raises(ValueError, match="shape"):
        attention.main(["--prefill", "4x4096"])
    with pytest.raises(ValueError, match="shape"):
        attention.main(["--verify", "3x(40+)"])


@pytest.mark.gpu
def test_sweep_runs_and_compiles_nothing_while_timed(tmp_path):
    out = tmp_path / "a.json"
    assert attention.main(["--prefill", "2x(100+70)", "--decode", "3x(40+1)", "--block-n", "64", "--stages", "2,3",
                           "--warps", "4", "--decode-block-n", "64", "--decode-stages", "2", "--decode-warps", "4",
                           "--decode-programs", "8,16", "--verify", "3x(300+5)", "--verify-block-n", "32",
                           "--verify-stages", "2", "--verify-warps", "4,8", "--iters", "2", "--rounds", "1",
                           "--out", str(out)]) == 0
    import json

    got = json.loads(out.read_text())
    assert got["compiles_in_timed_regions"] == 0
    pre = got["shapes"]["2x(100+70)"]["variants"]
    assert len([n for n in pre if n.startswith("triton ")]) == 2
    assert all(v["rel_err_vs_first"] < 2e-2 for v in pre.values())
    dec = got["shapes"]["3x(40+1)"]["variants"]
    assert len([n for n in dec if n.startswith("triton ")]) == 2 and got["best"]["3x(40+1)"].startswith("triton ")
    ver = got["verify"]["3x(300+5)"]
    assert set(ver["variants"]) == {"max_run=1", "max_run=8", "max_run=8 triton n=32 stages=2 warps=4 sm=4",
                                    "max_run=8 triton n=32 stages=2 warps=8 sm=4"}
    assert all(v["rel_err_vs_alone"] < 2e-2 for v in ver["variants"].values()) and not ver["errors"]
    assert got["best_verify"]["3x(300+5)"] in ver["variants"]
    assert torch.cuda.is_available()


def test_variants_are_built_once_untimed_then_timed_in_interleaved_rounds(monkeypatch):
    """`_timed`'s bookkeeping on CPU (the timers themselves are CUDA's): a variant that fails to
    build or to run is recorded and left out; the others are timed round by round, in turn."""
    order: list[str] = []

    class Batch:
        def __init__(self, name, fails=False):
            self.name, self.fails = name, fails

        def attend(self, layer, q, k, v):
            if self.fails:
                raise RuntimeError("no such tile")
            return q * 2

    def fake_graph_us(calls, iters):
        calls[0]()
        order.append(calls[0].__defaults__[0].name)
        return 1e6 * len(order)  # us: each call one second more than the last

    monkeypatch.setattr(attention, "graph_us", fake_graph_us)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    case = type("Case", (), {"q": torch.ones(2), "k": None, "v": None})()

    def broken():
        raise ValueError("bad setting")

    builders = {"a": lambda: Batch("a"), "b": lambda: Batch("b", fails=True), "c": broken, "d": lambda: Batch("d")}
    outputs, samples, compiles, errors = attention._timed(case, builders, iters=1, rounds=2, graphed=True)
    assert order == ["a", "d", "a", "d"] and samples == {"a": [1.0, 3.0], "d": [2.0, 4.0]}
    assert set(outputs) == {"a", "d"} and torch.equal(outputs["a"], torch.full((2,), 2.0))
    assert errors == {"b": "RuntimeError: no such tile", "c": "ValueError: bad setting"}
    assert compiles == {"a": 0, "d": 0}
