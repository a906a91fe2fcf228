"""A lower bound on any schedule's makespan for a trace on the engine a cost model describes.

Two bounds, the makespan is at least their maximum:
- *chain*: the longest conversation alone on the engine: its tool waits, and each turn at batch 1
  (`simulator.turn_cost_s`: its prefill, then one decode step per further output token, each step
  with the host gap). Nothing can run a conversation faster than alone.
- *work*: the whole trace's marginal costs (every prefill token, pair and chunk, every decode row
  and its context) plus the fewest decode steps that can carry every decode row, each paying the
  decode base and the host gap: the longest conversation's decode tokens (its turns run one after
  another and a step decodes one token of a row, so each of them needs a forward of its own), or
  all rows at `max_decode_rows` a step, whichever is more. Serial execution on one device, one
  token per row and step, is assumed, as the cost model was measured so (`sim.levers` overlap and
  speculation break both assumptions, and this bound with them).

Unlike `benchmarks.bounds` (FLOPs at the peak rate, bytes at full bandwidth) this bound is in the
engine's own measured costs: the gap between it and the oracle's makespan is what scheduling
cannot recover, the gap above the oracle is what it can.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_rollout.sim.cost import CostModel, chunk_pairs
from megatron_rollout.sim.simulator import turn_cost_s
from megatron_rollout.trace.schema import ConversationId, TraceRequest, group_conversations


@dataclass(frozen=True)
class LowerBound:
    chain_s: float
    chain_conversation: ConversationId | None
    work_s: float

    @property
    def makespan_s(self) -> float:
        return max(self.chain_s, self.work_s)


def lower_bound(trace: Sequence[TraceRequest], cost: CostModel, max_decode_rows: int) -> LowerBound:
    chain, chain_key = 0.0, None
    work, rows, longest = 0.0, 0, 0
    for key, turns in group_conversations(trace).items():
        seconds, context, steps = 0.0, 0, 0
        for t in turns:
            past = max(context - 1, 0)  # the last sampled token is computed with the new input
            new = t.input_tokens + (1 if context else 0)
            seconds += t.wait_ms / 1e3 + turn_cost_s(cost, past, new, t.output_tokens)
            work += cost.prefill_row_s + cost.prefill_token_s * new + cost.prefill_pair_s * chunk_pairs(past, new)
            first = past + new
            work += (t.output_tokens - 1) * cost.decode_row_s \
                + cost.decode_context_s * sum(range(first + 1, first + t.output_tokens))
            rows += t.output_tokens - 1
            steps += t.output_tokens - 1
            context += t.input_tokens + t.output_tokens
        longest = max(longest, steps)
        if seconds > chain:
            chain, chain_key = seconds, key
    steps = max(longest, math.ceil(rows / max_decode_rows))
    work += steps * (cost.decode_base_s + cost.gap_s)
    return LowerBound(chain, chain_key, work)
