"""Device execution: a batch of sequence spans -> a forward over paged KV.

`base` holds the runner contract (`Runner`, `SpanInput`) and the portable `ModelRunner`; `cuda`
the CUDA runner (decode graphs, phase streams) and `make_runner`; `piecewise` the prefill graphs
the CUDA runner replays; `config` the runner's frozen config. Nothing here decides what runs:
the engine does, and hands the runner rows.
"""
