"""Benchmarks of the rollout on one GPU: ceilings, micro-benchmarks, trace replays, peers.

`python -m benchmarks.rollout` is the single entry point (see its module docstring);
`benchmarks.plot` draws a PNG from its JSON and `benchmarks.report` the tables of
docs/benchmarks.md and docs/kernels.md. Results are data in `benchmarks/results/` (its README
indexes them); `benchmarks/device/` holds the scripts that ran them. `benchmarks.bounds` is pure
arithmetic and runs anywhere; the rest needs CUDA except the trace replays, which also run on CPU
for tests. Not installed with the package: run from the repository root.
"""
