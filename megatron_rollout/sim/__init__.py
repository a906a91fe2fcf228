"""The engine simulated on a trace (issue 33): a cost model fitted from the engine's step records
(`cost`), the engine's planner run on modelled state (`simulator`), orderings to try (`policy`:
the engine's priorities, `engine.priority`, and a longest-remaining-chain oracle) and a lower
bound in the same costs (`bounds`). `calibrate` checks a fit against real replays."""
