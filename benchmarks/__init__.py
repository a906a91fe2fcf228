"""Benchmarks of the rollout on one GPU: ceilings, micro-benchmarks, trace replays, peers.

`python -m benchmarks.rollout` is the single entry point (see its module docstring);
`benchmarks.plot` draws docs/benchmarks.png from its JSON. `benchmarks.bounds` is pure arithmetic and runs
anywhere; the rest needs CUDA except the trace replays, which also run on CPU for tests.
"""
