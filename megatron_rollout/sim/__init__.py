"""The engine simulated on a trace (issue 33): a cost model fitted from the engine's step records
(`cost`), the engine's planner run on modelled state (`simulator`), orderings to try (`policy`:
the engine's priorities, `engine.priority`, a longest-remaining-chain oracle and RL-group
orderings), levers the engine does not have yet (`levers`: decode priority, P/D overlap,
speculative decoding) and a lower bound in the same costs (`bounds`). `check` checks a fit
against real replays; `SimResult.breakdown` says where a simulated makespan went."""
