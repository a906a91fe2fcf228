"""Every user example runs, as a user would run it, on CPU with small sizes, and prints real results.

Each example is a subprocess (`python examples/X.py`, `torchrun` for the sharded one, the RL main
job for two steps) with the repository root on PYTHONPATH, so the checkout's package is the one
imported.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 260  # tiny-moe's byte-level vocabulary


def run(args: list[str], timeout: float, **env_vars: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", **env_vars}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


def token_lists(text: str) -> list[list[int]]:
    return [[int(t) for t in m.split(",")] for m in re.findall(r"\[([0-9, ]+)\]", text)]


@pytest.mark.timeout(180)
def test_generate():
    out = run([sys.executable, "examples/generate.py", "--prompts", "3", "--max-new-tokens", "5"], 150)
    greedy = [token_lists(line)[0] for line in out.splitlines() if line.strip().startswith("greedy")]
    sampled = [token_lists(line)[0] for line in out.splitlines() if line.strip().startswith("sampled")]
    assert len(greedy) == len(sampled) == 3
    assert all(len(t) == 5 and all(0 <= i < VOCAB for i in t) for t in greedy + sampled)  # no stop token set
    logprob_sums = [float(x) for x in re.findall(r"sum logprob (-?[0-9.]+)", out)]
    assert len(logprob_sums) == 3 and all(s < 0 for s in logprob_sums)
    assert "(length, weight version 0)" in out


@pytest.mark.timeout(180)
def test_agent():
    out = run([sys.executable, "examples/agent.py", "--agents", "3", "--turns", "3", "--max-new-tokens", "4"], 150)
    lengths = [int(n) for n in re.findall(r"agent \d+: (\d+) tokens after 3 turns", out)]
    # Each context: its task line, 3 turns of 4 tokens, and 2 tool replies between them.
    task = len(b"Task 0: look something up.\n")
    assert len(lengths) == 3 and all(n > task + 3 * 4 for n in lengths)
    prefilled, context = map(int, re.search(r"prefilled (\d+) tokens for (\d+) tokens", out).groups())
    assert context == sum(lengths)
    assert prefilled < context  # later turns prefill only the tool's tokens, never the whole context again


@pytest.mark.timeout(240)
def test_megatron_embed():
    pytest.importorskip("megatron.core")
    out = run([sys.executable, "examples/megatron_embed.py"], 200)
    lines = [line for line in out.splitlines() if line.startswith("version 0:")]
    assert len(lines) == 2 and all("-> " in line and "version 1:" in line for line in lines)
    pairs = [token_lists(line) for line in lines]
    assert all(len(before) == len(after) == 6 for before, after in pairs)


@pytest.mark.timeout(300)
def test_sharded_two_ranks():
    from megatron_rollout.engine import EngineConfig, RolloutEngine, SamplingParams
    from megatron_rollout.model.checkpoint import load_model

    # The store rendezvous: this test is about the example; the shared-memory one is tested on its own.
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "examples/sharded.py", "--timeout", "120"], 270, MEGATRON_ROLLOUT_NO_NATIVE="1")
    assert "2 ranks, ATP 2 x ADP 1" in out
    rows = [token_lists(line) for line in out.splitlines() if re.match(r"\[[0-9, ]+\]: v0 ", line)]
    assert len(rows) == 4 and all(len(before) == len(after) == 6 for _, before, after in rows)
    # The sharded engine at version 0 generates what one process generates from the same weights.
    engine = RolloutEngine(load_model("tiny-moe"), EngineConfig())
    alone = engine.generate([prompt for prompt, _, _ in rows], SamplingParams(temperature=0, max_new_tokens=6))
    assert [r.token_ids for r in alone] == [before for _, before, _ in rows]


@pytest.mark.timeout(240)
def test_train_grpo_main_job_two_steps(tmp_path):
    import json

    import yaml

    config = yaml.safe_load((ROOT / "configs" / "grpo_tool_cpu.yaml").read_text())
    run([sys.executable, "examples/train_grpo.py", "--config", "configs/grpo_tool_cpu.yaml", "--steps", "2",
         "--out", str(tmp_path)], 200)
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["weight_version"] for s in steps] == [1, 2]  # the engine took the trainer's weights each step
    assert all(s["episodes"] == config["prompts_per_step"] * config["group_size"] for s in steps)
    assert all(s["engine_errors"] == 0 and 0 <= s["reward_mean"] <= 1 for s in steps)
    assert all(s["turns_max"] == config["max_turns"] for s in steps)  # the tool call, then the answer
