"""The benchmark CLI end to end on CPU (tiny model, tiny trace): budget sweep, interleaved warm
repeats of off / chunked / mux / mux-epoch, medians, compile counts, ratios, table and plot."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from benchmarks import rollout, sim_replay
from benchmarks.agreement import SAMPLED_AGREEMENT
from megatron_rollout.engine.config import SpeculativeConfig
from megatron_rollout.model.config import PRESETS
from megatron_rollout.trace.make import make_trace
from megatron_rollout.trace.schema import load_trace
from megatron_rollout.trace.steps import from_columns


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    code = rollout.main(["--model", "tiny-moe", "--device", "cpu", "--repeats", "2", "--conversations", "3",
                         "--scale", "0.003", "--budgets", "32,64", "--out", str(out), "--no-progress",
                         "--schedules", "off,chunked,mux,chunked+most-turns"])
    assert code == 0
    return out, json.loads((out / "rollout.json").read_text())


def test_sweep_picks_each_schedules_best_budget(run):
    _, result = run
    sweep = result["sweep"]
    assert list(sweep) == ["32", "64"]
    for name in ("off", "chunked", "mux"):
        measured = {int(b): row[name]["report"]["makespan_s"] for b, row in sweep.items()}
        assert result["best_budget"][name] == min(measured, key=measured.get)
        assert result["schedules"][name]["budget"] == result["best_budget"][name]
    assert result["schedules"]["mux-epoch"]["budget"] == result["best_budget"]["mux"]
    assert result["schedules"]["mux-epoch"]["spec"] == "mux@fixed:1000000000"
    assert result["sweep_trace"]["conversations"] == 2  # half of the 3, rounded


def test_repeats_are_interleaved_warm_and_summarised(run):
    _, result = run
    assert list(result["schedules"]) == ["off", "chunked", "mux", "chunked+most-turns", "mux-epoch", "mux-load"]
    assert result["schedules"]["mux-load"]["spec"] == "mux@load"
    assert result["schedules"]["chunked+most-turns"]["budget"] == result["best_budget"]["chunked"]
    for s in result["schedules"].values():
        assert [r["repeat"] for r in s["repeats"]] == [0, 1]
        for r in s["repeats"]:
            assert r["finished"] and r["warm"], r
            # "hook" where Triton is installed (the interpreter tests), "none" where it is not
            assert r["compilations"]["total"] == 0 and r["compilations"]["triton_source"] in ("none", "hook")
            assert r["report"]["requests"] == result["trace"]["requests"] and r["report"]["failed"] == 0
            assert r["report"]["output_tokens"] == result["trace"]["output_tokens"]
            assert r["runner"] == "ModelRunner"
            assert r["engine_stats"]["steps"] > 0  # the engine's counters, reset in place, still count
        spans = [r["report"]["makespan_s"] for r in s["repeats"]]
        assert s["median"]["makespan_s"] == pytest.approx(float(np.median(spans)))
        assert s["min"]["makespan_s"] == min(spans) and s["max"]["makespan_s"] == max(spans)
        assert s["n"] == 2 and s["n_cold"] == 0 and s["compilations"] == 0
        # where the time went, summarised from each repeat's breakdown
        figures = [rollout.breakdown_figures(r["report"]["breakdown"]) for r in s["repeats"]]
        b = s["breakdown"]["median"]
        assert b["decode_step_stretch"] == pytest.approx(float(np.median([f["decode_step_stretch"] for f in figures])))
        if not s["spec"].startswith("chunked"):  # decode rows never share a forward with prefill there
            assert b["decode_step_stretch"] == pytest.approx(1.0)
        for f, r in zip(figures, s["repeats"]):
            assert f["busy_prefill"] + f["busy_decode"] + f["busy_mixed"] + f["idle"] == pytest.approx(1.0)
            assert f["critical_end_s"] == pytest.approx(r["report"]["makespan_s"])
            assert f["critical_decode_in_mixed_s"] <= f["critical_decode_s"] + 1e-9
            mixed = f["all_decode_in_mixed_s"]
            assert mixed > 0 if s["spec"].startswith("chunked") else mixed == 0
    ratios = result["ratios"]
    med = {n: s["median"]["makespan_s"] for n, s in result["schedules"].items()}
    assert ratios["mux_over_off"] == pytest.approx(med["mux"] / med["off"])
    assert ratios["mux_epoch_over_mux"] == pytest.approx(med["mux-epoch"] / med["mux"])
    assert ratios["mux_load_over_mux"] == pytest.approx(med["mux-load"] / med["mux"])
    assert ratios["mux_over_best_baseline"] == pytest.approx(med["mux"] / min(med["off"], med["chunked"]))
    assert "mux_over_off@32" in ratios and ratios["best_over_vllm"] is None
    # every timed replay keeps a digest of each turn's tokens: no schedule or priority changed one
    for s in result["schedules"].values():
        assert all(len(r["digests"]) == result["trace"]["requests"] for r in s["repeats"])
    alike = result["agreement"]["ours"]
    assert len(alike) == 12 and all(c["turns"] == c["of"] == result["trace"]["requests"] for c in alike), alike


def test_table_and_plot(run, capsys):
    out, result = run
    text = rollout.table(result)
    assert "makespan_s med [min-max]" in text and "compiles" in text and "mux-epoch" in text
    assert "sweep (short pass" in text
    assert "stretch" in text.splitlines()[1] and "where the time went" in text and "critical path" in text
    pytest.importorskip("matplotlib")
    from benchmarks.plot import main as plot_main

    assert plot_main([str(out / "rollout.json"), str(out / "plot.png")]) == 0
    assert (out / "plot.png").stat().st_size > 1000
    assert (out / "plot.stretch.png").stat().st_size > 1000
    for name in result["schedules"]:
        assert (out / f"plot.breakdown.{name}.png").stat().st_size > 1000


def test_the_oracle_order_is_simulated_beside_each_schedule(run):
    """The bench reports the oracle beside the peer and the lower bound: each timed schedule in
    arrival order and under the oracle, simulated on its own repeat 0's fit."""
    from benchmarks.report import rollout as rollout_table

    _, result = run
    oracle = result["oracle"]
    assert set(oracle) == set(result["schedules"])
    for name, o in oracle.items():
        assert o["fifo_sim_s"] > 0 and o["over_fifo"] == pytest.approx(o["oracle_sim_s"] / o["fifo_sim_s"]), name
    assert rollout.table(result).count("oracle order, simulated on") == len(oracle)
    assert "the oracle order over arrival order, simulated on each schedule's own fit: off " in rollout_table(result)
    with pytest.raises(ValueError, match="must include 'fifo'"):
        sim_replay.orderings(result, load_trace(run[0] / "trace.jsonl"), names=("oracle",))


def test_timed_replays_keep_their_step_records_and_the_trace(run):
    out, result = run
    assert result["moe"] == {"num_experts": 8, "top_k": 2} and result["num_blocks"] == 4096
    assert load_trace(out / "trace.jsonl") == make_trace(3, 0, 0.003, profile="current")
    text = (out / "rollout.json").read_text()
    for s in result["schedules"].values():
        for r in s["repeats"]:
            records = from_columns(r["steps"])
            assert len(records) == r["engine_stats"]["steps"] or s["spec"].startswith("mux")  # mux: + segments
            decode = sum(rec.decode_rows for rec in records)
            prefill = sum(rec.prefill_tokens for rec in records)
            assert (decode, prefill) == (r["engine_stats"]["decode_tokens"], r["engine_stats"]["prefill_tokens"])
            assert json.dumps(r["steps"], separators=(",", ":")) in text  # one line, not one value a line
            assert r["allocator"] == {}  # the CUDA caching allocator's counters: none on the CPU
            # the collections begun inside the makespan, and the engine's freezes of the heap
            assert r["gc"]["in_window"]["total_s"] <= r["gc"]["total_s"] and r["gc"]["freezes"] >= 1
    for r in result["sweep"]["32"].values():
        assert "steps" not in r


def tiny_run(out, *args: str) -> dict:
    """`benchmarks.rollout` on tiny-moe and the CPU, two conversations, one budget, no ablation: its JSON."""
    assert rollout.main(["--model", "tiny-moe", "--device", "cpu", "--conversations", "2", "--budgets", "64",
                         "--no-ablation", "--no-progress", "--out", str(out), *args]) == 0
    return json.loads((out / "rollout.json").read_text())


def test_deadline_stops_cleanly_and_keeps_what_it_measured(tmp_path):
    result = tiny_run(tmp_path, "--repeats", "3", "--scale", "0.002", "--schedules", "off", "--deadline-s", "0")
    assert "deadline" in result["stopped"]
    assert result["schedules"]["off"]["repeats"] == []


def test_profile_and_max_model_len_auto(tmp_path):
    """The prefill profile at this scale stays under tiny-moe's 8,192 positions: no raise needed;
    a fixed --max-model-len is passed through."""
    code = rollout.main(["--model", "tiny-moe", "--device", "cpu", "--repeats", "1", "--conversations", "2",
                         "--scale", "0.004", "--profile", "prefill", "--budgets", "64", "--schedules", "mux",
                         "--no-ablation", "--max-model-len", "4096", "--out", str(tmp_path), "--no-progress"])
    assert code == 0
    result = json.loads((tmp_path / "rollout.json").read_text())
    assert result["profile"] == "prefill" and result["max_model_len"] == 4096
    assert result["schedules"]["mux"]["repeats"][0]["finished"]
    assert set(result["warmup"]) == {"mux"}


_FAKE_VLLM = {
    "vllm/__init__.py": "__version__ = '0.26.0-standin'\n"
                        "class SamplingParams:\n    def __init__(self, **kw):\n        self.kw = kw\n"
                        "def TokensPrompt(prompt_token_ids):\n    return prompt_token_ids\n",
    "vllm/engine/__init__.py": "",
    "vllm/engine/arg_utils.py": "class AsyncEngineArgs:\n    __dataclass_fields__ = {'kv_cache_memory_bytes': None}\n"
                                "    def __init__(self, **kw):\n        self.kw = kw\n"
                                "        print('INFO engine args', sorted(kw.items()), flush=True)\n"
                                "class EngineArgs(AsyncEngineArgs):\n    pass\n",
    "vllm/sampling_params.py": "class RequestOutputKind:\n    DELTA = 1\n",
    "vllm/v1/__init__.py": "",
    "vllm/v1/engine/__init__.py": "",
    "vllm/v1/engine/async_llm.py": (
        "import asyncio, types\n"
        "class AsyncLLM:\n"
        "    @classmethod\n"
        "    def from_engine_args(cls, args):\n"
        "        e = cls(); e.budget = args.kw.get('max_num_batched_tokens') or 8192\n"
        "        e.vllm_config = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(\n"
        "            max_num_batched_tokens=e.budget, max_num_seqs=1024))\n"
        "        print('INFO Using FLASH_ATTN backend (stand-in)', flush=True)\n"
        "        return e\n"
        "    async def reset_prefix_cache(self):\n"
        "        return True\n"
        "    async def generate(self, prompt, sampling_params, request_id):\n"
        "        print('INFO sampling', request_id, sorted(sampling_params.kw.items()), flush=True)\n"
        "        n = sampling_params.kw['max_tokens']\n"
        "        await asyncio.sleep(0.002)\n"
        "        yield types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[5] * n)], finished=True)\n"
        "    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):\n"
        "        return rpc(method, args)\n"
        "    def shutdown(self):\n"
        "        pass\n"
        "def rpc(method, args):\n"
        "    import os\n"
        "    print('INFO collective_rpc', method.__name__, list(args[1:]),\n"
        "          os.environ.get('VLLM_ALLOW_INSECURE_SERIALIZATION'), flush=True)\n"
        "    return [7]\n"),
    "vllm/v1/engine/llm_engine.py": (
        "import os, time, types\n"
        "from vllm.v1.engine.async_llm import AsyncLLM, rpc\n"
        "class LLMEngine:\n"
        "    @classmethod\n"
        "    def from_engine_args(cls, args):\n"
        "        assert os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] == '0'\n"
        "        e = cls(); e.vllm_config = AsyncLLM.from_engine_args(args).vllm_config; e.live = []\n"
        "        return e\n"
        "    def reset_prefix_cache(self):\n"
        "        return True\n"
        "    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):\n"
        "        return rpc(method, args)\n"
        "    def add_request(self, request_id, prompt, params):\n"
        "        print('INFO sampling', request_id, sorted(params.kw.items()), flush=True)\n"
        "        self.live.append((request_id, params.kw['max_tokens']))\n"
        "    def step(self):\n"
        "        time.sleep(0.001); done, self.live = self.live, []\n"
        "        return [types.SimpleNamespace(request_id=r, outputs=[types.SimpleNamespace(token_ids=[5] * n)],\n"
        "                                      finished=True) for r, n in done]\n"),
}


def _stand_in_site(tmp_path):
    site = tmp_path / "site"
    for rel, text in _FAKE_VLLM.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    return site


def test_vllm_stage_runs_the_peer_in_its_own_process(tmp_path):
    """The peer's subprocess path end to end with a stand-in `vllm` package on --vllm-site (this
    checks our orchestration: trace file, environment, JSON merge, table; not vLLM). No schedule
    of ours runs and the peer keeps its dummy init, so no model is built and the Qwen3 preset's
    config.json is only written."""
    site = _stand_in_site(tmp_path)
    out = tmp_path / "out"
    code = rollout.main(["--model", "qwen3-30b-a3b-12l", "--device", "cpu", "--conversations", "2",
                         "--scale", "0.001", "--schedules", "", "--vllm", "--vllm-weights", "dummy",
                         "--vllm-site", str(site), "--vllm-budgets", "default,2048", "--vllm-passes", "2",
                         "--vllm-in-process", "best",
                         "--deadline-s", "200", "--out", str(out), "--no-progress"])
    assert code == 0
    result = json.loads((out / "rollout.json").read_text())
    peer = result["vllm"]
    assert peer.get("ran") and peer["exit"] == 0 and peer["vllm"] == "0.26.0-standin", peer
    assert peer["in_process"]["exit"] == 0 and "--in-process" in peer["in_process"]["command"]
    own_best = min(("default", "2048"), key=lambda k: peer["budgets"][k]["median"]["makespan_s"])
    assert set(peer["budgets"]) == {"default", "2048", f"{own_best}/in-process"}
    assert len(peer["budgets"][f"{own_best}/in-process"]["passes"]) == 2
    stale = {**result, "peer_weights": {"weights": "ours", "seed": 0}}  # as a run on our weights left it
    (out / "rollout.json").write_text(json.dumps(stale))
    code = rollout.main(["--model", "qwen3-30b-a3b-12l", "--device", "cpu", "--conversations", "2",
                         "--scale", "0.001", "--schedules", "", "--vllm", "--vllm-weights", "dummy",
                         "--vllm-site", str(site), "--vllm-budgets", "", "--vllm-in-process", "2048",
                         "--vllm-passes", "1", "--deadline-s", "200", "--resume", str(out), "--no-progress"])
    assert code == 0
    resumed = json.loads((out / "rollout.json").read_text())
    assert resumed["peer_weights"] == {"weights": "dummy"} and resumed["vllm"]["weights"] == "dummy"
    again = resumed["vllm"]
    assert set(again["budgets"]) == set(peer["budgets"]) | {"2048/in-process"}  # what was measured is kept
    assert again["budgets"]["default"] == peer["budgets"]["default"]
    assert len(again["budgets"]["2048/in-process"]["passes"]) == 1
    assert peer["budgets"]["default"]["chosen"]["max_num_batched_tokens"] == 8192
    assert len(peer["repeats"]) == 2 and peer["repeats"][0]["requests"] == result["trace"]["requests"]
    assert peer["repeats"][0]["output_tokens"] == result["trace"]["output_tokens"]
    assert any("FLASH_ATTN" in line for line in peer["log_lines"])
    assert (out / "trace.jsonl").exists() and "vllm" in rollout.table(result)
    with pytest.raises(SystemExit, match="its weight_std is 0.02, this run's is 0.2"):  # other weights: refused
        rollout.main(["--model", "qwen3-30b-a3b-12l", "--device", "cpu", "--conversations", "2", "--scale", "0.001",
                      "--schedules", "", "--vllm", "--vllm-site", str(site), "--weight-std", "0.2",
                      "--resume", str(out), "--no-progress"])
    with pytest.raises(SystemExit, match="ran at temperature 0, this run's is 1; give the same --temperature"):
        rollout.main(["--model", "qwen3-30b-a3b-12l", "--device", "cpu", "--conversations", "2", "--scale", "0.001",
                      "--schedules", "", "--vllm", "--vllm-site", str(site), "--temperature", "1",
                      "--resume", str(out), "--no-progress"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("in_process", [False, True])
def test_drawn_peer_weights_are_drawn_inside_the_peer_with_no_file(tmp_path, in_process):
    """`--vllm-weights drawn`: no weights file; the peer asks vLLM's worker to draw our seed's weights
    (`draw_into`, pickled to its core: insecure serialization on) once the engine is up."""
    site, out = _stand_in_site(tmp_path), tmp_path / "out"
    where = ["--vllm-budgets", "", "--vllm-in-process", "2048"] if in_process else ["--vllm-budgets", "2048"]
    code = rollout.main(["--model", "qwen3-30b-a3b-12l", "--device", "cpu", "--conversations", "2",
                         "--scale", "0.001", "--schedules", "", "--vllm", "--vllm-weights", "drawn", "--seed", "3",
                         "--weight-std", "0.05", "--vllm-site", str(site), *where, "--vllm-passes", "1",
                         "--vllm-warmups", "1", "--deadline-s", "200", "--out", str(out), "--no-progress"])
    assert code == 0
    result = json.loads((out / "rollout.json").read_text())
    peer, key = result["vllm"], "2048/in-process" if in_process else "2048"
    assert result["peer_weights"] == {"weights": "drawn", "seed": 3, "std": 0.05}
    assert peer["weights"] == "drawn 3:0.05" and not list(out.glob("*.safetensors"))
    entry = peer["budgets"][key]
    assert entry["drawn_weights"] == {"seed": 3, "std": 0.05, "hf_tensors": [7]} and entry["weights_load_s"] >= 0
    log_text = (out / ("vllm-in-process.log" if in_process else "vllm.log")).read_text()
    assert "INFO collective_rpc draw_into [3, 0.05] 1" in log_text, log_text[-2000:]
    assert "('load_format', 'dummy')" in log_text


def _peer_command_edited(monkeypatch, edit) -> None:
    """The benchmark's peer command line, then `edit(cmd)` of it."""
    real = rollout._peer_command

    def edited(*args, **kw):
        cmd, name = real(*args, **kw)
        return edit(cmd), name

    monkeypatch.setattr(rollout, "_peer_command", edited)


def _qwen_shaped(cmd: list[str]) -> list[str]:
    """The peer writes the Qwen3 preset's config.json (the peer process does not know the tests' tiny
    preset); the stand-in vLLM reads no weights, so nothing else in it depends on the model."""
    cmd[cmd.index("--model") + 1] = "qwen3-30b-a3b-12l"
    return cmd


@pytest.fixture
def tiny_qwen(monkeypatch) -> str:
    """tiny-moe in the one shape the peer builds (every layer MoE, no shared expert), as a preset."""
    from megatron_rollout.model.config import PRESETS

    monkeypatch.setitem(PRESETS, "tiny-qwen3-moe", PRESETS["tiny-moe"].replace(
        moe_layer_freq=(1, 1, 1), moe_shared_expert_intermediate_size=0))
    return "tiny-qwen3-moe"


@pytest.mark.parametrize("mode", ["own", "in-process"])
def test_interleaved_peer_runs_a_pass_after_each_round_of_ours(tmp_path, monkeypatch, mode, tiny_qwen):
    """`--vllm-interleave`: the peer (a real `benchmarks.vllm_peer --serve` process over the stand-in
    `vllm`) starts before our stages, on our weights, and one of its timed passes follows each round
    of our repeats."""
    _peer_command_edited(monkeypatch, _qwen_shaped)
    site, out = _stand_in_site(tmp_path), tmp_path / "out"
    code = rollout.main(["--model", tiny_qwen, "--device", "cpu", "--conversations", "2", "--scale", "0.002",
                         "--schedules", "off,chunked", "--repeats", "2", "--budgets", "64", "--vllm",
                         "--vllm-site", str(site), "--vllm-budgets", "2048", "--vllm-interleave", mode,
                         "--vllm-passes", "3", "--vllm-warmups", "1", "--vllm-block-size", "64", "--deadline-s",
                         "300", "--out", str(out), "--no-progress"])
    assert code == 0
    result = json.loads((out / "rollout.json").read_text())
    assert result["order"] == ["off#0", "chunked#0", "vllm#0", "off#1", "chunked#1", "vllm#1", "vllm#2"]
    assert "stopped" not in result and set(result["warmup"]) == {"off", "chunked"}  # the peer's start-up not counted
    peer = result["vllm"]
    key = "2048/in-process" if mode == "in-process" else "2048"
    assert peer["interleaved"] and peer["exit"] == 0 and "error" not in peer, peer
    assert peer["best_budget"] == key and len(peer["budgets"][key]["warmups"]) == 1
    passes = peer["budgets"][key]["passes"]
    assert len(passes) == 3 == len(peer["pass_wall_s"])
    assert all(p["requests"] == result["trace"]["requests"] and p["failed"] == 0 for p in passes)
    assert result["ratios"]["best_over_vllm"] is not None
    # the stand-in writes 7s: its passes agree with each other on every turn and with ours on none
    assert all(len(p["digests"]) == result["trace"]["requests"] for p in passes) and "digests" not in peer["median"]
    alike = result["agreement"]["vllm"][key]
    assert [c["turns"] for c in alike["with_its_first"]] == [result["trace"]["requests"]] * 2
    assert [c["turns"] for c in alike["with_ours"]] == [0] * 3
    assert peer["budgets"][key]["interleaved"]  # per setting: a resumed run's other settings are not
    name = "vllm-in-process" if mode == "in-process" else "vllm"
    log_text = (out / f"{name}.log").read_text()
    kv_bytes = int(40.0 * 2 ** 30)  # --kv-gb's default: both engines hold their KV at once
    assert f"('kv_cache_memory_bytes', {kv_bytes})" in log_text and "('gpu_memory_utilization', 0.45)" in log_text
    assert "('block_size', 64)" in log_text  # --vllm-block-size reaches its engine args
    weights = out / "peer-weights.safetensors"  # ours, written once for the peer, gone once it is done
    assert "('load_format', 'safetensors')" in log_text and peer["weights"] == str(weights)
    assert result["peer_weights"]["weights"] == "ours" and result["peer_weights"]["bytes"] > 0
    assert not weights.exists()
    from benchmarks import report

    assert "interleaved with ours: its best | - | 3 |" in report.rollout(result)


def test_interleaving_needs_one_budget_for_the_peer_and_repeats_of_ours(tmp_path, tiny_qwen):
    base = ["--model", tiny_qwen, "--device", "cpu", "--conversations", "2", "--scale", "0.002", "--budgets", "64",
            "--vllm-interleave", "own", "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match="one budget"):
        rollout.main(base + ["--schedules", "off", "--vllm", "--vllm-budgets", "default,best"])
    with pytest.raises(SystemExit, match="needs --vllm"):
        rollout.main(base + ["--schedules", "", "--vllm"])
    with pytest.raises(SystemExit, match="needs --vllm"):
        rollout.main(base + ["--schedules", "off", "--no-vllm"])


def test_the_interleaved_peer_runs_no_more_passes_than_asked(tmp_path, monkeypatch, tiny_qwen):
    _peer_command_edited(monkeypatch, _qwen_shaped)
    out = tmp_path / "out"
    assert rollout.main(["--model", tiny_qwen, "--device", "cpu", "--conversations", "2", "--scale", "0.002",
                         "--schedules", "off", "--repeats", "3", "--budgets", "64", "--vllm", "--vllm-site",
                         str(_stand_in_site(tmp_path)), "--vllm-budgets", "2048", "--vllm-interleave", "own",
                         "--vllm-passes", "1", "--vllm-warmups", "0", "--deadline-s", "300", "--out", str(out),
                         "--no-progress"]) == 0
    result = json.loads((out / "rollout.json").read_text())
    assert result["order"] == ["off#0", "vllm#0", "off#1", "off#2"]
    assert len(result["vllm"]["budgets"]["2048"]["passes"]) == 1


def test_a_peer_that_dies_leaves_our_replays_running(tmp_path, monkeypatch, tiny_qwen):
    """A peer that exits before answering: its error is kept, our repeats all run, nothing hangs."""
    _peer_command_edited(monkeypatch, lambda cmd: [cmd[0], "-c", "import sys; sys.exit(3)"])
    out = tmp_path / "out"
    code = rollout.main(["--model", tiny_qwen, "--device", "cpu", "--conversations", "2", "--scale", "0.002",
                         "--schedules", "off", "--repeats", "2", "--budgets", "64", "--vllm", "--vllm-budgets",
                         "2048", "--vllm-interleave", "own", "--deadline-s", "300", "--out", str(out), "--no-progress"])
    assert code == 0
    result = json.loads((out / "rollout.json").read_text())
    assert result["order"] == ["off#0", "off#1"]
    assert "exited (code 3)" in result["vllm"]["error"] and not result["vllm"].get("ran")
    assert result["ratios"]["best_over_vllm"] is None


def test_a_model_the_peer_cannot_build_fails_before_any_work_when_the_peer_is_asked_for(tmp_path, monkeypatch):
    """tiny-moe has a dense layer and a shared expert: `--vllm` is refused before a model is built (on
    a GPU, where the peer is on by default, it is left out instead and our schedules run)."""
    monkeypatch.setattr(rollout, "random_model", lambda *a: pytest.fail("a model was built"))
    with pytest.raises(SystemExit, match="every layer MoE.*--no-vllm"):
        rollout.main(["--model", "tiny-moe", "--device", "cpu", "--conversations", "2", "--scale", "0.002",
                      "--schedules", "off", "--budgets", "64", "--vllm", "--out", str(tmp_path)])
    assert "every layer MoE" in rollout._no_peer_shape(PRESETS["tiny-moe"])
    assert rollout._no_peer_shape(PRESETS["qwen3-30b-a3b-12l"]) is None


def test_ratios_are_medians_over_medians_against_the_peer():
    result = {"schedules": {n: {"median": {"makespan_s": m, "p99_request_s": p, "mean_ttft_s": t}}
                            for n, m, p, t in (("off", 10.0, 2.0, 0.1), ("chunked", 8.0, 4.0, 0.2),
                                               ("mux", 6.0, 1.0, 0.3), ("mux-epoch", 9.0, 1.5, 0.3))},
              "vllm": {"median": {"makespan_s": 5.0}}, "lower_bound": {"bound_s": 3.0},
              "sweep": {"4096": {"off": {"finished": True, "report": {"makespan_s": 4.0}},
                                 "mux": {"finished": True, "report": {"makespan_s": 3.0}}}}}
    r = rollout.ratios(result)
    assert r["mux_over_best_baseline"] == pytest.approx(6 / 8)
    assert r["mux_p99_request_over_best_baseline"] == pytest.approx(1 / 4)  # chunked is the best baseline
    assert r["mux_ttft_over_off"] == pytest.approx(3.0)
    assert r["mux_queue_over_off"] is None  # no admission marks in these medians
    result["schedules"]["off"]["median"].update(mean_queue_s=0.04, mean_prefill_s=0.06)
    result["schedules"]["mux"]["median"].update(mean_queue_s=0.08, mean_prefill_s=0.22)
    r = rollout.ratios(result)
    assert r["mux_queue_over_off"] == pytest.approx(2.0) and r["mux_prefill_over_off"] == pytest.approx(0.22 / 0.06)
    assert r["best_over_vllm"] == pytest.approx(6 / 5) and r["mux_over_vllm"] == pytest.approx(6 / 5)
    assert r["mux_epoch_over_mux"] == pytest.approx(1.5) and r["mux_over_lower_bound"] == pytest.approx(2.0)
    assert r["mux_over_off@4096"] == pytest.approx(0.75) and r["mux_over_chunked@4096"] is None
    assert r["best_drafts_over_plain"] is None  # nothing drafted
    result["schedules"]["mux~ngram:4"] = {"median": {"makespan_s": 4.5}}
    result["schedules"]["off~ngram:4/sync"] = {"median": {"makespan_s": 9.0}}  # its twin 'off/sync' not run
    result["schedules"]["mux@budget:24000~ngram:4"] = {"median": {"makespan_s": 3.0}}  # nor 'mux@budget:24000'
    r = rollout.ratios(result)
    assert r["mux~ngram:4_over_mux"] == pytest.approx(0.75)
    assert "off~ngram:4/sync_over_off/sync" not in r and r["off~ngram:4/sync_over_off"] == pytest.approx(0.9)
    assert r["mux@budget:24000~ngram:4_over_mux"] == pytest.approx(0.5)  # the plain schedule stands in
    assert r["best_drafts_over_plain"] == pytest.approx(0.5)


def test_sampled_runs_hold_drafting_to_costing_little():
    """Greedy, drafting must buy its 0.9; sampling on random weights, where nothing is drafted, it may
    cost at most 1.05 (the H200's 1.141 without its undrafted steps decoded ahead prints MISSED)."""
    result = {"profile": "prefill", "args": {"temperature": 0.0}, "ratios": {"best_drafts_over_plain": 1.037},
              "schedules": {}}
    assert rollout.targets_for(result)["best_drafts_over_plain"] == 0.9
    assert "(target <= 0.9) MISSED" in rollout.table(result)
    result["args"]["temperature"] = 1.0
    assert "(target <= 1.05) met" in rollout.table(result)
    result["ratios"]["best_drafts_over_plain"] = 1.141
    assert "(target <= 1.05) MISSED" in rollout.table(result)


def test_spec_suffix_tilde_asks_for_ngram_drafts():
    assert rollout.split_spec("mux~ngram:4").speculative == SpeculativeConfig("ngram", 4)
    assert rollout.split_spec("mux+most-turns~ngram:3:16/sync") == (
        "mux", None, "off", "most-turns", SpeculativeConfig("ngram", 3, tail_rows=16), 0, "held", None, None, None)
    assert rollout.split_spec("mux@budget:24000~ngram:4+7@2").speculative == SpeculativeConfig(
        "ngram", 4, tail_k=7, tail_k_rows=2)
    assert rollout.split_spec("mux~ngram:4:16+6").speculative == SpeculativeConfig("ngram", 4, tail_rows=16, tail_k=6)
    assert rollout.split_spec("mux@budget:24000~ngram:4+7@4^7/sync").speculative == SpeculativeConfig(
        "ngram", 4, tail_k=7, tail_k_rows=4, streak_k=7)
    assert rollout.split_spec("mux~ngram:4^6").speculative == SpeculativeConfig("ngram", 4, streak_k=6)
    for bad in ("mux~ngram", "mux~ngram:x", "mux~ngram:9", "mux~eagle:2", "mux~ngram:4+9", "mux~ngram:4+x@2",
                "mux~ngram:4+7@0", "mux~mtp:1+3", "mux~ngram:4^9", "mux~ngram:4^", "mux~mtp:1^3"):
        with pytest.raises((SystemExit, ValueError)):
            rollout.split_spec(bad)


def test_spec_suffix_sync_turns_decode_ahead_off():
    assert rollout.split_spec("mux@fixed:4/sync")[:5] == ("mux", "fixed:4", "off", None, None)
    assert rollout.split_spec("off") == ("off", None, None, None, None, 0, "held", None, None, None)
    assert rollout.split_spec("mux@fixed:4+most-turns/sync")[:5] == ("mux", "fixed:4", "off", "most-turns", None)
    with pytest.raises(SystemExit, match="the suffixes are '/sync'"):
        rollout.split_spec("off/fast")
    with pytest.raises(SystemExit, match="unknown priority 'oracle'"):
        rollout.split_spec("off+oracle")
    r = rollout.ratios({"schedules": {"off": {"median": {"makespan_s": 3.0}},
                                      "off/sync": {"median": {"makespan_s": 4.0}}}})
    assert r["off_over_off_sync"] == pytest.approx(0.75)


def test_spec_suffix_sms_holds_sms_back_from_mux_prefill():
    assert rollout.split_spec("mux/sms:24").decode_sms == 24
    assert rollout.split_spec("mux@budget:24000~ngram:4+7@4/sync/sms:16") == (
        "mux", "budget:24000", "off", None, SpeculativeConfig("ngram", 4, tail_k=7, tail_k_rows=4), 16, "held", None,
        None, None)
    assert rollout.split_spec("mux").decode_sms == 0
    assert rollout.split_spec("mux/split:24")[5:7] == (24, "split")
    assert rollout.split_spec("mux/sms:8").partition == "held"
    for bad in ("mux/sms:0", "mux/sms:", "mux/sms:x", "mux/sms:8/sms:16", "mux/sync/sync", "mux/sms:8/split:8",
                "mux/split:0"):
        with pytest.raises(SystemExit, match="the suffixes are"):
            rollout.split_spec(bad)
    for bad in ("chunked/sms:24", "off/split:16"):
        with pytest.raises(SystemExit, match="are for mux"):
            rollout.split_spec(bad)
    args = rollout.parser().parse_args(["--model", "tiny-moe"])
    engine = rollout.engine_config(args, 64, 512, rollout.split_spec("mux/sms:24"), 256)
    assert (engine.runner.decode_sms, engine.runner.partition) == (24, "held")
    split = rollout.engine_config(args, 64, 512, rollout.split_spec("mux/split:16"), 256)
    assert (split.runner.decode_sms, split.runner.partition) == (16, "split")
    r = rollout.ratios({"schedules": {"mux": {"median": {"makespan_s": 4.0}},
                                      "mux/sms:24": {"median": {"makespan_s": 3.0}},
                                      "mux/split:24": {"median": {"makespan_s": 2.0}}}})
    assert r["mux/sms:24_over_mux"] == pytest.approx(0.75) and r["mux/split:24_over_mux"] == pytest.approx(0.5)


def test_spec_suffix_pw_captures_piecewise_prefill_graphs_past_the_default():
    from megatron_rollout.engine import RunnerConfig

    default = RunnerConfig.prefill_graph_tokens
    got = rollout.split_spec("mux@budget:24000~ngram:4+7@4/pw:16384").prefill_graph_tokens
    assert got == (*default, 6144, 8192, 10240, 12288, 14336, 16384)
    assert rollout.split_spec("chunked/pw:5000").prefill_graph_tokens == (*default, 5000)
    assert rollout.split_spec("off/pw:2048").prefill_graph_tokens == default  # inside the default: nothing added
    assert rollout.split_spec("mux/split:24/pw:8192")[5:8] == (24, "split", (*default, 6144, 8192))
    for bad in ("mux/pw:0", "mux/pw:", "mux/pw:x", "mux/pw:8192/pw:4096"):
        with pytest.raises(SystemExit, match="the suffixes are"):
            rollout.split_spec(bad)
    args = rollout.parser().parse_args(["--model", "tiny-moe"])
    assert rollout.engine_config(args, 64, 512, rollout.split_spec("off/pw:8192"), 256).runner.prefill_graph_tokens \
        == (*default, 6144, 8192)
    assert rollout.engine_config(args, 64, 512, rollout.split_spec("off"), 256).runner.prefill_graph_tokens == default


@pytest.mark.parametrize("schedule,extra", [("off", []), ("chunked~ngram:4", ["--temperature", "1"])])
def test_decode_ahead_on_against_its_sync_twin_on_cpu(tmp_path, schedule, extra):
    """`--decode-ahead on` forces it on the portable runner (nothing to overlap there: this checks
    the plumbing and that both finish every request with the same output tokens); under n-gram
    drafts at temperature 1 the steps that draft nothing are decoded ahead."""
    # scale 0.01: turns long enough that most decode steps have every request in them (at 0.003 a
    # replay issued 3 forwards ahead, and whether any was taken depended on the tool waits' timing)
    code = rollout.main(["--model", "tiny-moe", "--device", "cpu", "--repeats", "1", "--conversations", "2",
                         "--scale", "0.01", "--budgets", "64", "--schedules", f"{schedule},{schedule}/sync",
                         "--no-ablation", "--decode-ahead", "on", *extra, "--out", str(tmp_path), "--no-progress"])
    assert code == 0
    result = json.loads((tmp_path / "rollout.json").read_text())
    ahead, sync = (result["schedules"][n]["repeats"][0] for n in (schedule, f"{schedule}/sync"))
    assert ahead["engine_stats"]["ahead_taken"] > 0 and sync["engine_stats"]["ahead_issued"] == 0
    assert ahead["report"]["output_tokens"] == sync["report"]["output_tokens"] == result["trace"]["output_tokens"]
    assert f"{schedule}_over_{schedule}_sync" in result["ratios"]


def test_sampled_replays_run_every_turn(tmp_path):
    """`--temperature 1` reaches the replay (the args record it; every turn is served at its forced
    length under both schedules). Per-turn seeds: tests/trace; the peer's: test_sampled_peer_*."""
    code = rollout.main(["--model", "tiny-moe", "--device", "cpu", "--repeats", "1", "--conversations", "2",
                         "--scale", "0.01", "--budgets", "64", "--schedules", "off,mux", "--no-ablation",
                         "--temperature", "1", "--out", str(tmp_path), "--no-progress"])
    assert code == 0
    result = json.loads((tmp_path / "rollout.json").read_text())
    assert result["args"]["temperature"] == 1.0 and result.get("vllm") is None
    for name in ("off", "mux"):
        assert result["schedules"][name]["repeats"][0]["report"]["output_tokens"] == result["trace"]["output_tokens"]
    assert result["agreement"]["sampled"]["temperature"] == 1.0
    line = next(ln for ln in rollout.table(result).splitlines() if "alike" in ln)
    assert line.startswith("at temperature 1, tokens alike on") and "vLLM" not in line  # no peer: nothing said of it


@pytest.mark.timeout(120)
def test_sampled_peer_gets_the_temperature_in_its_own_process_and_in_process(tmp_path):
    """`--temperature 1` with the peer on (the stand-in `vllm`, own process then in process): its
    command line carries the temperature, every turn's SamplingParams samples at 1 with a seed, and its
    JSON records the temperature."""
    site, out = _stand_in_site(tmp_path), tmp_path / "out"
    code = rollout.main(["--model", "qwen3-30b-a3b-12l", "--device", "cpu", "--conversations", "2",
                         "--scale", "0.001", "--schedules", "", "--vllm", "--vllm-weights", "dummy",
                         "--vllm-site", str(site), "--vllm-budgets", "2048", "--vllm-in-process", "2048",
                         "--vllm-passes", "1", "--vllm-warmups", "0", "--temperature", "1", "--vllm-turn-seeds",
                         "--deadline-s", "200", "--out", str(out), "--no-progress"])
    assert code == 0
    peer = json.loads((out / "rollout.json").read_text())["vllm"]
    assert peer.get("ran") and peer["temperature"] == 1.0, peer
    assert "--temperature 1.0 --turn-seeds" in peer["command"]
    assert "--temperature 1.0 --turn-seeds" in peer["in_process"]["command"]
    assert peer["budgets"]["2048"]["temperature"] == peer["budgets"]["2048/in-process"]["temperature"] == 1.0
    for name in ("vllm", "vllm-in-process"):
        turns = [ln for ln in (out / f"{name}.log").read_text().splitlines() if "INFO sampling" in ln]
        assert len(turns) == peer["budgets"]["2048"]["passes"][0]["requests"] > 0
        assert all("('temperature', 1.0)" in ln and "('seed', " in ln for ln in turns), turns


@pytest.mark.timeout(120)
def test_sampled_interleaved_peer_samples_and_its_disagreement_is_no_fault(tmp_path, monkeypatch, tiny_qwen):
    """`--vllm-interleave` at `--temperature 1`: the kept-up peer samples too, and the summary says
    that its tokens are not expected to match ours."""
    _peer_command_edited(monkeypatch, _qwen_shaped)
    out = tmp_path / "out"
    code = rollout.main(["--model", tiny_qwen, "--device", "cpu", "--conversations", "2", "--scale", "0.002",
                         "--schedules", "off", "--repeats", "1", "--budgets", "64", "--vllm", "--vllm-site",
                         str(_stand_in_site(tmp_path)), "--vllm-budgets", "2048", "--vllm-interleave", "own",
                         "--vllm-passes", "1", "--vllm-warmups", "0", "--temperature", "1", "--deadline-s", "300",
                         "--out", str(out), "--no-progress"])
    assert code == 0
    result = json.loads((out / "rollout.json").read_text())
    assert result["order"] == ["off#0", "vllm#0"] and result["vllm"]["budgets"]["2048"]["temperature"] == 1.0
    turns = [ln for ln in (out / "vllm.log").read_text().splitlines() if "INFO sampling" in ln]
    assert turns and all("('temperature', 1.0)" in ln and "('seed', " not in ln for ln in turns)  # unseeded: its best
    assert [c["turns"] for c in result["agreement"]["vllm"]["2048"]["with_ours"]] == [0]  # the stand-in writes 7s
    assert result["agreement"]["sampled"] == {"temperature": 1.0, "note": SAMPLED_AGREEMENT}
    line = next(ln for ln in rollout.table(result).splitlines() if "alike" in ln)
    assert line.startswith("at temperature 1, tokens alike") and line.endswith(f"({SAMPLED_AGREEMENT})")
    assert "greedy" not in line


@pytest.mark.timeout(30)
def test_peer_command_passes_a_sampled_temperature_only(tmp_path):
    """Each route to the peer (own process, in process, `--serve`) builds its command in `_peer_command`."""
    def command(*argv: str, in_process: bool = False) -> list[str]:
        args = rollout.parser().parse_args(["--model", "qwen3-30b-a3b-12l", *argv])
        return rollout._peer_command(args, tmp_path, tmp_path / "t.jsonl", 4096, ["2048"], 100.0, in_process)[0]

    assert "--temperature" not in command() and "--temperature" not in command("--temperature", "0")
    for in_process in (False, True):
        cmd = command("--temperature", "0.7", "--seed", "3", in_process=in_process)
        assert cmd[cmd.index("--temperature") + 1] == "0.7" and cmd[cmd.index("--seed") + 1] == "3"
        assert "--turn-seeds" not in cmd and "--turn-seeds" in command("--temperature", "1", "--vllm-turn-seeds")
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            rollout.parser().parse_args(["--temperature", bad])


def test_unknown_micro_parts_are_named_before_any_work(tmp_path):
    with pytest.raises(SystemExit, match=r"--micro-parts: unknown part\(s\) \['overlapp'\]"):
        rollout.main(["--model", "tiny-moe", "--device", "cpu", "--micro", "--micro-parts", "decode,overlapp",
                      "--out", str(tmp_path)])
    assert rollout._micro_parts("decode, overlap") == ("decode", "overlap")
    assert "overlap" in rollout.MICRO_PARTS


def test_host_profile_replays_a_timed_schedule_once_more_under_cprofile(tmp_path):
    result = tiny_run(tmp_path, "--repeats", "1", "--scale", "0.003", "--schedules", "off,mux~ngram:3",
                      "--host-profile", "mux~ngram:3")
    profile = result["host_profile"]
    assert list(profile) == ["mux~ngram:3"] and profile["mux~ngram:3"]["finished"]
    own = profile["mux~ngram:3"]["by_own"]
    assert 0 < len(own) <= rollout.PROFILE_TOP and all(a[2] >= b[2] for a, b in zip(own, own[1:]))
    cumulative = [row[0] for row in profile["mux~ngram:3"]["by_cumulative"]]
    assert cumulative[0].endswith("(replay)") and any(n.startswith("engine.py") and n.endswith("(_step)")
                                                      for n in cumulative)  # the replay alone, its steps inside
    assert len(result["schedules"]["mux~ngram:3"]["repeats"]) == 1  # the profiled replay is not a repeat
    with pytest.raises(SystemExit, match="not among the timed schedules"):  # refused before any replay
        tiny_run(tmp_path / "b", "--repeats", "1", "--scale", "0.003", "--schedules", "off", "--host-profile", "mux")
    assert not (tmp_path / "b" / "rollout.json").exists()


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_allocator_counts_see_a_fresh_device_allocation():
    import torch

    torch.cuda.empty_cache()  # frees whole free segments only: a live tensor keeps its segment's free part
    stats = torch.cuda.memory_stats()  # empty until the process's first allocation
    cached_free = stats.get("reserved_bytes.all.current", 0) - stats.get("allocated_bytes.all.current", 0)
    before = rollout.allocator_counts("cuda")
    block = torch.empty(cached_free + (1 << 28), dtype=torch.uint8, device="cuda")  # more than the cache holds
    after = rollout.allocator_counts("cuda")
    del block
    assert set(before) == set(rollout.ALLOCATOR_COUNTS)
    assert after["num_device_alloc"] >= before["num_device_alloc"] + 1 and after["num_ooms"] == before["num_ooms"]


def test_weight_std_sets_the_random_weights_and_refuses_what_is_not_a_positive_number():
    cfg = PRESETS["tiny-moe"]
    for std in (0.02, 0.2):
        model = rollout.random_model(cfg, torch.device("cpu"), seed=0, std=std)
        weights = torch.cat([p.flatten() for n, p in model.named_parameters() if not n.endswith("layernorm.weight")])
        assert abs(weights.std().item() - std) < 0.05 * std
        assert all(torch.all(p == 1) for n, p in model.named_parameters() if n.endswith("layernorm.weight"))
    for bad in ("0", "-1", "nan", "inf", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            rollout._positive_float(bad)
    assert rollout._positive_float("0.2") == 0.2


def test_spec_suffix_pdl_switches_launches_for_its_replay_alone(monkeypatch):
    from benchmarks.specs import pdl_launches
    from megatron_rollout.kernels import pdl

    assert rollout.split_spec("chunked/pdl").pdl is True and rollout.split_spec("chunked/nopdl").pdl is False
    assert rollout.split_spec("chunked").pdl is None
    assert rollout.split_spec("mux~ngram:4/sync/nopdl")[:3] == ("mux", None, "off")
    for bad in ("chunked/pdl/pdl", "chunked/pdl/nopdl"):
        with pytest.raises(SystemExit, match="'/nopdl'"):
            rollout.split_spec(bad)
    for before in (False, True):
        monkeypatch.setattr(pdl, "ENABLED", before)
        for spec, inside in (("chunked/pdl", True), ("chunked/nopdl", False), ("chunked", before)):
            with pdl_launches(rollout.split_spec(spec)):
                assert pdl.ENABLED is inside
            assert pdl.ENABLED is before
        with pytest.raises(RuntimeError), pdl_launches(rollout.split_spec("chunked/nopdl")):
            raise RuntimeError("a replay that failed")
        assert pdl.ENABLED is before  # back after a failure too
    r = rollout.ratios({"schedules": {"chunked": {"median": {"makespan_s": 4.0}},
                                      "chunked/pdl": {"median": {"makespan_s": 3.0}},
                                      "chunked/nopdl": {"median": {"makespan_s": 5.0}}}})
    assert r["chunked/pdl_over_chunked"] == pytest.approx(0.75)
    assert r["chunked/nopdl_over_chunked"] == pytest.approx(1.25)


def test_spec_suffix_bs_stores_kv_in_other_blocks_in_the_same_bytes():
    from benchmarks.specs import kernel_build

    assert rollout.split_spec("chunked/bs:64").block_size == 64 and rollout.split_spec("chunked").block_size is None
    for bad in ("chunked/bs:0", "chunked/bs:", "chunked/bs:x", "chunked/bs:16/bs:64"):
        with pytest.raises(SystemExit, match="'/bs:N'"):
            rollout.split_spec(bad)
    args = rollout.parser().parse_args(["--model", "tiny-moe", "--block-size", "16"])
    plain = rollout.engine_config(args, 640, 512, rollout.split_spec("chunked"), 256)
    wide = rollout.engine_config(args, 640, 512, rollout.split_spec("chunked/bs:64"), 256)
    assert (plain.scheduler.block_size, plain.kv.num_blocks) == (16, 640)
    assert (wide.scheduler.block_size, wide.kv.num_blocks) == (64, 160)  # as many KV bytes
    assert kernel_build("chunked~ngram:7/sync/bs:64/pdl") == "chunked/bs:64/pdl"
    assert kernel_build("mux+most-turns/sms:8") == "mux"
    r = rollout.ratios({"schedules": {"chunked": {"median": {"makespan_s": 4.0}},
                                      "chunked/bs:64": {"median": {"makespan_s": 3.0}}}})
    assert r["chunked/bs:64_over_chunked"] == pytest.approx(0.75)


@pytest.mark.timeout(300)
def test_other_kernel_builds_get_a_warm_up_after_a_sweep_and_each_replay_its_own_pdl(tmp_path, monkeypatch):
    """A '/bs:N' or '/pdl' spec builds other kernels: after the budget sweep of the bases it gets an
    untimed pass of its own at its base's best budget; every replay runs under its spec's PDL switch."""
    from megatron_rollout.kernels import pdl

    seen: dict[str, list[bool]] = {}
    inner = rollout._replay_in_engine

    def watched(run, trace, spec, *rest):
        seen.setdefault(spec, []).append(pdl.ENABLED)
        return inner(run, trace, spec, *rest)

    monkeypatch.setattr(rollout, "_replay_in_engine", watched)
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert rollout.main(["--model", "tiny-moe", "--device", "cpu", "--conversations", "2", "--scale", "0.002",
                         "--budgets", "32,64", "--repeats", "1", "--no-ablation", "--no-progress",
                         "--schedules", "chunked,chunked/bs:8/pdl", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "rollout.json").read_text())
    best = result["best_budget"]["chunked"]
    assert set(result["warmup"]) == {"chunked/bs:8/pdl"} and set(result["sweep"]) == {"32", "64"}
    assert result["schedules"]["chunked/bs:8/pdl"]["budget"] == best
    assert seen["chunked"] == [False] * 3 and seen["chunked/bs:8/pdl"] == [True] * 2  # 2 sweeps + 1 timed; warm + timed
    assert not pdl.ENABLED
