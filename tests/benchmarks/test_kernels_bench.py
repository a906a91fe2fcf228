"""`benchmarks.kernels` on CPU: it refuses clearly without CUDA, parses its decode points, and its output
writer gives one JSON object (stdout and file) and the table from a result of the shape it produces."""
from __future__ import annotations

import io
import json

import pytest
import torch

from benchmarks import kernels


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_exits_with_a_clear_message_without_cuda():
    with pytest.raises(SystemExit) as exc:
        kernels.main(["--json"])
    assert "needs a CUDA GPU" in str(exc.value.code)


def test_decode_points_parse_and_bad_ones_are_named():
    assert kernels.parse_points("1x2048, 64x2048") == [(1, 2048), (64, 2048)]
    assert kernels.parse_points("") == []
    with pytest.raises(ValueError, match="'64-2048' must be ROWSxCONTEXT"):
        kernels.parse_points("64-2048")


def _fake_result() -> dict:
    op = {"op": "rmsnorm", "rows": 64, "sets": 128, "min_bytes": 524288, "portable_eager_us": 40.0,
          "fused_eager_us": 8.0, "portable_graph_us": 14.5, "fused_graph_us": 2.5, "graph_speedup": 5.8,
          "fused_gb_s": 209.7, "portable_compiles": 0, "fused_compiles": 0, "fused_launched": True}
    step = {"rows": 64, "bucket": 64, "context": 2048, "graph_ms": 7.45, "eager_ms": 20.1, "roofline_ms": 4.37,
            "graph_over_roofline": 1.7, "bytes": 1e10}
    sort = {"tokens": 4096, "pairs": 32768, "experts": 128, "one_hot": {"us": 83.0, "min_us": 82.0, "max_us": 84.0},
            "argsort": {"us": 41.5, "min_us": 41.0, "max_us": 42.0}, "compiles": 0, "faster": "argsort"}
    fp8 = {"tokens": 4096, "large": True, "compiles": 0, "bf16_us": 2500.0,
           "fp8": [], "best": {"us": 3100.0, "tiles": {"block_m": 128}, "over_bf16": 1.24}}
    tiles = {"block_m": 16, "n_cap": 32, "k_cap": 64, "warps": 4, "stages": 3}
    bf16 = {"tokens": 1, "compiles": 0, "shapes": [{"tiles": tiles, "us": 21.5, "rel_err_vs_first": 0.0}],
            "best": {"tiles": tiles, "us": 21.5}}
    router = {"rows": 1, "experts": 128, "topk": 8, "compiles": 0, "fastest": "128/4/4/8",
              "variants": {"128/4/4": {"us": 13.5}, "128/4/4/8": {"us": 7.25}, "128/4/4 top-1": {"us": 11.2}}}
    return {"ops": [op], "destinations": [sort], "fp8_experts": [fp8], "bf16_experts": [bf16], "router_tiles": [router],
            "decode": {"portable": [step], "fused": [dict(step, graph_ms=6.9, graph_over_roofline=1.58)]},
            "compiles_in_timed_regions": 0, "wall_s": 61.0}


def test_interleaved_rounds_alternate_variants_and_keep_errors():
    """Every round runs every variant once, in order; a variant that raises is recorded and skipped."""
    calls = []

    def variant(name, value):
        def time_us():
            calls.append(name)
            if value is None:
                raise RuntimeError("capture failed")
            return value
        return time_us

    timed, compiles = kernels.interleaved_us({"a": variant("a", 2.0), "b": variant("b", None),
                                              "c": variant("c", 5.0)}, rounds=3)
    assert calls == ["a", "b", "c", "a", "c", "a", "c"]
    assert timed["a"] == {"us": 2.0, "min_us": 2.0, "max_us": 2.0, "n": 3} and timed["c"]["n"] == 3
    assert timed["b"]["error"] == "RuntimeError: capture failed" and timed["b"]["us"] == float("inf")
    assert compiles == 0


def test_emit_writes_one_json_object_and_a_table(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    path = tmp_path / "sub" / "kernels.json"
    kernels.emit(_fake_result(), True, str(path), out, err)
    printed = json.loads(out.getvalue())  # exactly one JSON document on stdout
    assert printed == json.loads(path.read_text())
    assert printed["ops"][0]["fused_graph_us"] == 2.5
    table = err.getvalue()
    assert "rmsnorm" in table and "14.5" in table and "7.450 -> 6.900" in table
    assert "compilations in timed regions: 0" in table
    assert "fp8 experts" in table and "3100.0" in table
    assert "expert sort" in table and "83.0" in table and "-> argsort" in table
    assert "bf16 experts" in table and "16/32/64/4/3 21.5" in table
    assert "router tiles" in table and "128/4/4/8 7.2" in table and "-> 128/4/4/8" in table


def test_every_op_case_builds_and_runs_both_implementations():
    """The op table is wired on CPU: every case builds its inputs and both implementations run on
    them (the fused ones fall back to the references off CUDA), with outputs of the same shapes."""
    from megatron_rollout.model.config import PRESETS

    cfg = PRESETS["tiny-moe"]
    cases = kernels.op_cases(cfg, 5, torch.Generator().manual_seed(0))
    assert {"rmsnorm", "add_rmsnorm", "qkv_norm_rope", "router_topk", "silu_mul"} <= set(cases)

    def tensors(out):
        return [t for t in (out if isinstance(out, tuple) else (out,)) if torch.is_tensor(t)]

    for name, case in cases.items():
        args = case["make"]()
        got, ref = tensors(case["fused"](*args)), tensors(case["portable"](*args))
        assert [g.shape for g in got] == [r.shape for r in ref] and got, name
        assert case["bytes"] > 0, name
    assert cases["silu_mul"]["make"]()[0].shape == (5 * cfg.moe_router_topk, 2 * cfg.moe_ffn_hidden_size)


def test_row_blocks_sets_each_ops_constants_and_restores_them():
    from megatron_rollout.kernels import fused

    before = (fused.NORM_BLOCK_ROWS, fused.BLOCK_MIN_ROWS, fused.QKV_BLOCK_TOKENS, fused.SILU_BLOCK_ROWS,
              fused.SILU_BLOCK_MIN_ROWS)
    with kernels.row_blocks("qkv_norm_rope", 2):
        assert (fused.QKV_BLOCK_TOKENS, fused.BLOCK_MIN_ROWS) == (2, 0)
        assert fused.NORM_BLOCK_ROWS == before[0]  # another op's constant is left alone
    with kernels.row_blocks("silu_mul", 8):
        assert (fused.SILU_BLOCK_ROWS, fused.SILU_BLOCK_MIN_ROWS) == (8, 0)
    try:
        with kernels.row_blocks("rmsnorm", 1):
            assert (fused.NORM_BLOCK_ROWS, fused.BLOCK_MIN_ROWS) == (1, 0)
            raise RuntimeError("a failed timing")
    except RuntimeError:
        pass
    assert (fused.NORM_BLOCK_ROWS, fused.BLOCK_MIN_ROWS, fused.QKV_BLOCK_TOKENS, fused.SILU_BLOCK_ROWS,
            fused.SILU_BLOCK_MIN_ROWS) == before


def test_the_table_shows_the_row_block_sweep():
    result = _fake_result()
    result["row_blocks"] = [{"op": "qkv_norm_rope", "tokens": 4096, "fastest": "1",
                             "variants": {"1": {"us": 40.5}, "4": {"us": 57.0}}}]
    table = kernels.format_table(result)
    assert "row blocks" in table and "4 57.0" in table and "-> 1" in table
