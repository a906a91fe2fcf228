"""A multi-turn agent: several trajectories, each a session that alternates generation and a tool.

    python examples/agent.py --agents 4 --turns 3

A session keeps its tokens and KV blocks between turns, so after the tool answers only the tool's
tokens are prefilled (a continuation prefill), not the whole conversation again. The loop below
drives all agents through one engine: whenever one agent's turn finishes, its tool runs and its
next turn is submitted while the other agents keep decoding. With the `mux` schedule those
continuation prefills run in segments between decode iterations.

The model is the embedded tiny-moe with random weights, a byte-level vocabulary (ids 0-255 are
bytes), so its words are noise; the tool is a toy that counts the bytes it was sent.
"""
from __future__ import annotations

import argparse

from megatron_rollout.engine import EngineConfig, RolloutEngine, SamplingParams, Schedule
from megatron_rollout.engine.scheduler import SchedulerConfig
from megatron_rollout.model.checkpoint import load_model


def tool(call: list[int]) -> list[int]:
    """The environment: reads the model's call, answers with bytes (here: how many it received)."""
    return list(f"\n[tool] got {len(call)} bytes\n".encode())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=6)
    args = ap.parse_args()

    engine = RolloutEngine(load_model("tiny-moe"), EngineConfig(scheduler=SchedulerConfig(schedule=Schedule.MUX)))
    sessions = [engine.open_session() for _ in range(args.agents)]
    turns_left = {s.sid: args.turns for s in sessions}
    running = {}  # request id -> session
    for i, session in enumerate(sessions):
        session.append(list(f"Task {i}: look something up.\n".encode()))
        running[session.submit(SamplingParams(max_new_tokens=args.max_new_tokens, seed=i))] = session

    while running:
        for out in engine.step():  # whatever finished in this step, from any agent
            session = running.pop(out.request_id)
            turns_left[session.sid] -= 1
            if turns_left[session.sid] == 0:
                continue
            session.append(tool(out.result.token_ids))  # only these tokens are prefilled next turn
            seed = 100 * session.sid + turns_left[session.sid]
            running[session.submit(SamplingParams(max_new_tokens=args.max_new_tokens, seed=seed))] = session

    for session in sessions:
        print(f"agent {session.sid}: {len(session.token_ids)} tokens after {args.turns} turns")
    # Without sessions every turn would prefill its whole conversation again.
    print(f"prefilled {engine.stats.prefill_tokens} tokens for {sum(len(s.token_ids) for s in sessions)} "
          f"tokens of context; mean decode wait {engine.stats.mean_decode_wait_ms:.2f} ms")
    for session in sessions:
        session.close()  # frees its KV blocks


if __name__ == "__main__":
    main()
