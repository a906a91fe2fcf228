"""`benchmarks.report`: the tables of the docs from the result JSON (CPU)."""
import json

import pytest

from benchmarks import report

RESULT = {
    "schedules": {
        "off": {"budget": 4096, "n": 3, "compilations": 0,
                "median": {"makespan_s": 4.66, "p50_request_s": 0.047, "p99_request_s": 0.28, "p99_trajectory_s": 4.58,
                           "mean_ttft_s": 0.0116, "mean_decode_wait_ms": 1.45, "tokens_per_s": 707.0},
                "min": {"makespan_s": 4.62}, "max": {"makespan_s": 4.68}},
        "mux": {"budget": 2048, "n": 0, "median": {"makespan_s": None}},
    },
    "vllm": {"vllm": "0.26.0", "best_budget": "default", "budgets": {"default": {
        "chosen": {"max_num_batched_tokens": 2048},
        "median": {"makespan_s": 5.97, "p50_request_s": 0.108, "tokens_per_s": 551.0},
        "passes": [{"makespan_s": 5.95}, {"makespan_s": 5.97}, {"makespan_s": 6.33}]}}},
    "lower_bound": {"bound_s": 3.27},
    "ratios": {"best_over_vllm": 0.758, "mux_over_vllm": None},
}


def test_rollout_table_rows():
    lines = report.rollout(RESULT).splitlines()
    assert lines[0].startswith("| schedule | budget | n | makespan s |")
    assert lines[2] == ("| off | 4096 | 3 | 4.66 [4.62-4.68] | 0.047 | 0.28 | 4.58 | 11.6 | 1.45 | 707 | 0 |")
    assert lines[3] == "| mux | 2048 | 0 | - | - | - | - | - | - | - | - |"  # no finished replay
    assert lines[4].startswith("| vLLM 0.26.0, its default (2048): its best | - | 3 | 5.97 [5.95-6.33] | 0.108 |")
    assert lines[-1] == "lower bound 3.27 s; our best over vLLM's best 0.758."


def test_a_page_is_regenerated_from_its_json_and_checked(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "ROOT", tmp_path)
    (tmp_path / "r.json").write_text(json.dumps(RESULT))
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n<!-- report rollout r.json -->\nold table\n<!-- end report -->\n\nafter\n")
    assert report.main(["--check", str(page)]) == 1
    assert "old table" in page.read_text()  # --check writes nothing
    assert report.main([str(page)]) == 0
    text = page.read_text()
    assert "old table" not in text and "| off | 4096 | 3 | 4.66 [4.62-4.68]" in text and text.endswith("\nafter\n")
    assert report.main(["--check", str(page)]) == 0  # idempotent


def test_unknown_kinds_and_missing_files_are_named():
    with pytest.raises(ValueError, match="unknown table kind 'plot'"):
        report.table("plot", "r.json")
    with pytest.raises(FileNotFoundError, match="result file nowhere.json not found"):
        report.table("rollout", "nowhere.json")


def test_a_host_table_sets_two_commits_invocations_side_by_side(tmp_path):
    """`host` reads a folder of `benchmarks.host` runs (`--compare`): per figure the median over the
    invocations of their medians, [min-max], before and after."""
    def run(ms, us):
        return {"drafting_step_ms": {"16": {"ngram:4": {"median": ms}}},
                "lookup_us": {"1000": {"loop": {"median": us}}},
                "sample_ms": {"4": {"t1": {"median": ms / 4}}},
                "verify_fill_ms": {"16x1300": {"keyed": {"median": ms / 2}}},
                "startup": {"turns": 2, "tokens": 900, "ms": {"median": 10 * ms}}}

    pairs = [((1.0, 10.0), (0.5, 2.0)), ((1.2, 12.0), (0.7, 3.0)), ((1.1, 11.0), (0.6, 9.0))]
    for i, (before, after) in enumerate(pairs):
        (tmp_path / f"host-before-{i}.json").write_text(json.dumps(run(*before)))
        (tmp_path / f"host-after-{i}.json").write_text(json.dumps(run(*after)))
    rows = report.table("host", tmp_path).splitlines()
    assert rows[2] == "| drafting step, ms | 16 rows | ngram:4 | 1.100 [1.000-1.200] | 0.600 [0.500-0.700] |"
    assert rows[3] == "| lookup, us | 1000 tokens | loop | 11.0 [10.0-12.0] | 3.0 [2.0-9.0] |"
    assert rows[4] == "| sample, ms | 4 rows | t1 | 0.275 [0.250-0.300] | 0.150 [0.125-0.175] |"
    assert rows[5] == "| verify fill, ms | 16x1300 rows x entries | keyed | 0.550 [0.500-0.600] | 0.300 [0.250-0.350] |"
    assert rows[6] == "| startup, ms | 900 tokens of 2 first turns | submit | 11.0 [10.0-12.0] | 6.0 [5.0-7.0] |"
    with pytest.raises(FileNotFoundError, match="folder nowhere not found"):
        report.table("host", "nowhere")


def test_the_docs_tables_match_their_json():
    pages = [report.ROOT / "docs" / name for name in ("benchmarks.md", "benchmarks-earlier.md", "kernels.md")]
    assert report.main(["--check", *map(str, pages)]) == 0
    assert all(report.MARK.search(page.read_text()) for page in pages)


def test_vllm_speculation_is_named_in_its_row():
    entry = {"chosen": {"max_num_batched_tokens": 16384}, "median": {"makespan_s": 13.6},
             "passes": [{"makespan_s": 13.4}, {"makespan_s": 13.7}]}
    result = {"vllm": {"vllm": "0.26.0", "best_budget": "16384~ngram:4",
                       "budgets": {"16384~ngram:4": entry, "16384~ngram:4/in-process": entry}}}
    rows = report.rollout(result).splitlines()[2:4]
    assert rows[0].startswith("| vLLM 0.26.0 at 16384, ngram:4 drafts: its best | - | 2 | 13.60 [13.40-13.70] |")
    assert rows[1].startswith("| vLLM 0.26.0 at 16384, core in process, ngram:4 drafts | - | 2 |")


def test_vllm_block_size_is_named_where_not_its_default():
    passes = [{"makespan_s": 13.4}, {"makespan_s": 13.7}]
    result = {"vllm": {"vllm": "0.26.0", "budgets": {
        "8192": {"chosen": {"max_num_batched_tokens": 8192, "block_size": 16}, "passes": passes},
        "16384": {"chosen": {"max_num_batched_tokens": 16384, "block_size": 64}, "passes": passes}}}}
    rows = report.rollout(result).splitlines()[2:4]
    assert rows[0].startswith("| vLLM 0.26.0 at 8192 | - |")
    assert rows[1].startswith("| vLLM 0.26.0 at 16384, KV blocks of 64 | - |")


def test_verify_table_puts_rows_alone_beside_runs():
    result = {"verify": {"12x(16384+5)": {
        "kv_bytes": 402_653_184, "compiles": 0, "alone_over_runs": 1.98, "rel_err_runs_vs_alone": 0.0027,
        "variants": {"max_run=1": {"ms": 0.3206, "rounds_ms": [0.3206, 0.3210], "gb_per_s": 1256.0},
                     "max_run=8": {"ms": 0.1617, "rounds_ms": [0.1616, 0.1617], "gb_per_s": 2490.2}}}}}
    lines = report.verify(result).splitlines()
    assert lines[0].startswith("| rows x (cached + queries) | history MB | rows alone us | runs us |")
    assert lines[2] == "| 12x(16384+5) | 403 | 320.6 [320.6-321.0] | 161.7 [161.6-161.7] | 2,490 | 1.98 | 2.7e-03 | 0 |"


def test_verify_table_names_the_fastest_setting_of_a_grid():
    variants = {"max_run=1": {"ms": 0.3206, "rounds_ms": [0.3206], "gb_per_s": 1256.0},
                "max_run=8": {"ms": 0.1617, "rounds_ms": [0.1617], "gb_per_s": 2490.2},
                "max_run=8 triton n=32 stages=2 warps=4 sm=2": {"ms": 0.1405, "rounds_ms": [0.1405],
                                                                "gb_per_s": 2866.0}}
    result = {"verify": {"12x(16384+5)": {"kv_bytes": 402_653_184, "compiles": 0, "alone_over_runs": 1.98,
                                          "rel_err_runs_vs_alone": 0.0027, "variants": variants}},
              "best_verify": {"12x(16384+5)": "max_run=8 triton n=32 stages=2 warps=4 sm=2"}}
    lines = report.verify(result).splitlines()
    assert "| fastest setting us | its setting | its GB/s |" in lines[0]
    assert lines[2].endswith("| 1.98 | 140.5 | n=32 stages=2 warps=4 sm=2 | 2,866 | 2.7e-03 | 0 |")


def test_drafts_accepted_are_set_beside_the_peer_s_and_name_its_weights():
    def repeat(made, kept):
        return {"engine_stats": {"drafted_tokens": made, "accepted_tokens": kept}}

    result = {"schedules": {"mux": {"repeats": [repeat(0, 0)]},
                            "mux~ngram:4": {"repeats": [repeat(100, 70), repeat(300, 230)]}},
              "vllm": {"weights": "/tmp/out/peer-weights.safetensors", "median": {"acceptance": 0.7512}}}
    assert report.acceptance_note(result) == "drafts accepted: mux~ngram:4 0.750, vLLM 0.751 (on ours)"
    result["vllm"]["weights"] = "dummy"
    assert report.acceptance_note(result).endswith("vLLM 0.751 (on its dummy init)")
    del result["vllm"]["median"]["acceptance"]  # a peer that counted nothing: no note, stored tables unchanged
    assert report.acceptance_note(result) is None
