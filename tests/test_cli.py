"""The CLI: `generate` and `replay` print the documented JSON, `make-trace` writes a trace that
`replay` accepts under every schedule, `--timeline` writes a Chrome trace, bad arguments fail
with a message. Subprocesses (a torch import each) only where the entry point itself matters;
the rest calls `cli.main` in-process."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rollout import cli
from megatron_rollout.engine import EngineConfig, KVConfig, RolloutEngine, SamplingParams
from megatron_rollout.model.checkpoint import load_model
from megatron_rollout.trace.schema import load_trace
from tests.world import free_port

ROOT = Path(__file__).resolve().parents[1]
REPORT_FIELDS = {"requests", "output_tokens", "makespan_s", "p50_request_s", "p99_request_s", "p99_trajectory_s",
                 "mean_ttft_s", "mean_decode_wait_ms", "tokens_per_s"}


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}  # the same arithmetic as the in-process engine (conftest: 1 thread)
    return subprocess.run([sys.executable, "-m", "megatron_rollout.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


def test_generate_json_matches_the_engine():
    proc = run_cli("generate", "--model", "tiny-moe", "--prompt-ids", "1,2,3", "--prompt-ids", "4,5",
                   "--max-new-tokens", "4", "--json", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert set(report) == {"outputs"} and len(report["outputs"]) == 2
    engine = RolloutEngine(load_model("tiny-moe"), EngineConfig(kv=KVConfig(num_blocks=1024)))  # the CLI's defaults
    expected = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.0, max_new_tokens=4))
    for out, exp in zip(report["outputs"], expected):  # in prompt order
        assert set(out) == {"token_ids", "logprobs", "finish_reason", "weight_version"}
        assert out["token_ids"] == exp.token_ids and len(out["token_ids"]) == 4
        assert out["logprobs"] == pytest.approx(exp.logprobs, abs=1e-5)
        assert all(lp < 0 for lp in out["logprobs"])
        assert out["finish_reason"] == "length" and out["weight_version"] == 0
    engine.check_integrity()


def test_generate_reports_a_bad_prompt_and_serves_the_rest(capsys):
    assert cli.main(["generate", "--prompt-ids", "1,2", "--prompt-ids", "300", "--max-new-tokens", "2",
                     "--json", "--device", "cpu"]) == 0
    outputs = json.loads(capsys.readouterr().out)["outputs"]
    assert outputs[0]["finish_reason"] == "length" and len(outputs[0]["token_ids"]) == 2
    assert outputs[1]["finish_reason"] == "error" and "token id 300 is outside the vocabulary" in outputs[1]["error"]


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    assert cli.main(["make-trace", "--conversations", "3", "--scale", "0.01", "--seed", "0", "--out", str(path)]) == 0
    return path


def _check_report(report: dict, trace: Path, schedule: str) -> None:
    requests = load_trace(trace)
    assert REPORT_FIELDS <= set(report)
    assert report["schedule"] == schedule
    assert report["requests"] == len(requests) and report["failed"] == 0 and report["skipped"] == 0
    assert report["output_tokens"] == sum(r.output_tokens for r in requests)  # replay forces output lengths
    # input_tokens are the trace's; later turns also prefill the previous turn's last sampled token.
    assert report["input_tokens"] == sum(r.input_tokens for r in requests) and report["truncated"] == 0
    assert report["prefill_tokens"] == report["input_tokens"] + len(requests) - 3
    assert 0 < report["p50_request_s"] <= report["p99_request_s"] <= report["makespan_s"]
    assert 0 < report["p99_trajectory_s"] <= report["makespan_s"]
    assert 0 < report["mean_ttft_s"] < report["makespan_s"] and report["mean_decode_wait_ms"] >= 0
    assert report["tokens_per_s"] == pytest.approx(report["output_tokens"] / report["makespan_s"])


@pytest.mark.parametrize("schedule", ["off", "chunked"])
def test_replay_in_process(trace, capsys, schedule):
    assert len({r.conversation for r in load_trace(trace)}) == 3
    assert cli.main(["replay", "--trace", str(trace), "--schedule", schedule, "--json", "--no-progress",
                     "--device", "cpu"]) == 0
    _check_report(json.loads(capsys.readouterr().out), trace, schedule)


def test_replay_mux_with_timeline(trace, tmp_path):
    timeline = tmp_path / "timeline.json"
    proc = run_cli("replay", "--trace", str(trace), "--schedule", "mux", "--mux-span", "fixed:1", "--json",
                   "--no-progress", "--device", "cpu", "--timeline", str(timeline))
    assert proc.returncode == 0, proc.stderr
    assert "replay" not in proc.stderr  # --no-progress: no bar
    _check_report(json.loads(proc.stdout), trace, "mux")
    chrome = json.loads(timeline.read_text())
    spans = [e for e in chrome["traceEvents"] if e["ph"] == "X"]
    assert {e["cat"] for e in spans} == {"P", "D"}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 and e["pid"] == 0 for e in spans)
    assert any(e["name"].startswith("epoch ") for e in spans if e["cat"] == "P")
    assert {e["tid"] for e in spans if e["cat"] == "P"} == {0} and {e["tid"] for e in spans if e["cat"] == "D"} == {1}
    names = {e["args"]["name"] for e in chrome["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {"P", "D"}


def test_bad_arguments_exit_non_zero_with_a_message(capsys, tmp_path):
    for argv, message in [
        (["generate", "--prompt-ids", "1,x"], "comma-separated integers, got '1,x'"),
        (["generate", "--prompt-ids", "1", "--schedule", "fast"], "--schedule takes off, chunked, mux"),
        (["replay", "--schedule", "off"], "the following arguments are required: --trace"),
        (["launch"], "invalid choice: 'launch'"),
    ]:
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2
        assert message in capsys.readouterr().err
    assert cli.main(["replay", "--trace", str(tmp_path / "missing.jsonl"), "--device", "cpu"]) == 2
    assert "megatron-rollout replay: error:" in capsys.readouterr().err
    proc = run_cli("generate", "--prompt-ids", "1", "--mux-span", "fixed:0", "--device", "cpu")
    assert proc.returncode == 2 and proc.stdout == ""
    assert ("MuxConfig.span (--mux-span) must be 'load', 'fixed:K' with K > 0 or 'budget:US' with US > 0 "
            "(microseconds), got 'fixed:0'") in proc.stderr


@pytest.mark.parametrize("command", ["generate", "make-trace", "replay"])
def test_help_shows_every_option_with_its_default(command):
    sub = next(a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    text = " ".join(sub.format_help().split())  # argparse wraps lines
    options = [a for a in sub._actions if a.option_strings and a.dest != "help"]
    assert len(options) >= 6
    for action in options:
        assert action.help, f"{command} {action.option_strings[0]} has no help text"
        shown = f"{action.help} (default: {action.default})"
        assert (" ".join(shown.split()) in text) != action.required, (action.option_strings[0], text)


def test_make_trace_says_what_it_wrote(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    assert cli.main(["make-trace", "--conversations", "4", "--scale", "0.01", "--out", str(path)]) == 0
    requests = load_trace(path)
    assert capsys.readouterr().out == (
        f"wrote {path}: {len(requests)} requests in 4 conversations, {sum(r.input_tokens for r in requests)} input "
        f"and {sum(r.output_tokens for r in requests)} output tokens\n")
    assert len(requests) > 4


def test_torchrun_replay_bar_counts_every_replica_and_warns_nothing(trace):
    """Two replicas (ADP2) each replay part of the conversations; rank 0's bar counts them all, and a
    torchrun run prints no FutureWarning (torch 2.13 deprecated a collective the comm used)."""
    total = len(load_trace(trace))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()), "-m", "megatron_rollout.cli", "replay",
                           "--trace", str(trace), "--atp", "1", "--adp", "2", "--device", "cpu", "--json"],
                          capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    _check_report(json.loads(proc.stdout), trace, "chunked")
    assert f"| {total}/{total} [" in proc.stderr, proc.stderr  # the bar's last state: all of them
    assert "Warning" not in proc.stderr, proc.stderr
