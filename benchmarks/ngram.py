"""`python -m benchmarks.ngram`: how often n-gram (prompt-lookup) drafts would be accepted, on text and on a trace.

Two measurements, both on the CPU:
- `text`: no model. A text is decoded as a model that reproduces it greedily would decode it: from
  its first half on, each iteration drafts k tokens by lookup over the text so far
  (`drafts.NgramIndex`), keeps the drafts that equal the text's next tokens, and emits one more.
  This is the acceptance rate of a model that writes the text, so it says how repetitive the text
  is in the way lookup catches. Texts: a source file of this repository, and the same file's
  first 2,000 bytes said three times (a context that repeats outright), byte-level as `tiny-moe`
  reads them; and the token ids `trace.make` draws for a conversation's inputs (uniformly random).
- `trace`: the engine. A trace from `trace.make` replayed on the `tiny-moe` preset (random weights,
  greedy), with `SpeculativeConfig("ngram", k)`: drafted and accepted tokens and decode iterations
  against the same replay without drafts. The inputs are random ids and the outputs a random
  model's, so this measures the random model's own repetition, not an agent's.

A table on stdout, JSON to `--out`.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_rollout.drafts import NgramIndex
from megatron_rollout.engine import EngineConfig, KVConfig, RolloutEngine, SchedulerConfig, SpeculativeConfig
from megatron_rollout.model.checkpoint import load_model
from megatron_rollout.tokenizer import ByteTokenizer
from megatron_rollout.trace.make import conversation_inputs, make_trace
from megatron_rollout.trace.replay import replay

SOURCE = Path(__file__).resolve().parents[1] / "megatron_rollout" / "engine" / "drafting.py"


def replay_text(tokens: list[int], start: int, k: int, n_min: int, n_max: int) -> dict:
    """Decode tokens[start:] as a model that writes `tokens` greedily would, drafting by lookup."""
    index, pos = NgramIndex(n_min, n_max), start
    drafted = accepted = iterations = 0
    while pos < len(tokens):
        index.sync(tokens[:pos])  # its last token is the pending one: the drafts guess tokens[pos:]
        draft = index.propose(min(k, len(tokens) - pos - 1))
        kept = next((i for i, t in enumerate(draft) if t != tokens[pos + i]), len(draft))
        drafted, accepted, iterations, pos = drafted + len(draft), accepted + kept, iterations + 1, pos + kept + 1
    return {"tokens": len(tokens) - start, "drafted": drafted, "accepted": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0, "decode_iterations": iterations}


def texts(seed: int, vocab_size: int) -> dict[str, list[int]]:
    source = SOURCE.read_text()
    trace = make_trace(conversations=1, seed=seed, scale=0.05, profile="prefill")
    ids = [t for turn in next(iter(conversation_inputs(trace, seed, vocab_size).values())) for t in turn]
    tok = ByteTokenizer()
    return {"source file": tok.encode(source), "a passage said 3 times": tok.encode(source[:2000] * 3),
            "trace input ids": ids}


def replay_trace(conversations: int, seed: int, scale: float, k: int, n_min: int, n_max: int) -> dict:
    model = load_model("tiny-moe")
    requests = make_trace(conversations=conversations, seed=seed, scale=scale, profile="decode")
    out = {}
    for name, spec in (("plain", None), (f"ngram-k{k}", SpeculativeConfig("ngram", k, n_min, n_max))):
        engine = RolloutEngine(model, EngineConfig(scheduler=SchedulerConfig(block_size=16),
                                                   kv=KVConfig(num_blocks=4096), speculative=spec))
        report, _ = replay(engine, requests, seed=seed, progress=False, vocab_size=model.cfg.vocab_size)
        s = engine.stats
        out[name] = {"decode_tokens": s.decode_tokens, "decode_iterations": s.decode_iterations,
                     "drafted": s.drafted_tokens, "accepted": s.accepted_tokens,
                     "acceptance_rate": s.acceptance_rate, "requests": len(requests)}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--scale", type=float, default=0.05, help="the trace's token counts (decode profile)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/ngram.json"))
    args = ap.parse_args(argv)
    lookup = (args.k, args.ngram_min, args.ngram_max)
    report = {"k": args.k, "ngram": [args.ngram_min, args.ngram_max],
              "text": {name: replay_text(tokens, len(tokens) // 2, *lookup)
                       for name, tokens in texts(args.seed, 260).items()},
              "trace": replay_trace(args.conversations, args.seed, args.scale, *lookup)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"n-gram drafts, k={args.k}, n in [{args.ngram_min}, {args.ngram_max}]")
    print(f"{'case':28} {'tokens':>7} {'drafted':>8} {'accepted':>8} {'accept':>7} {'iters':>6}")
    rows = [(f"text: {n}", r["tokens"], r) for n, r in report["text"].items()]
    rows += [(f"trace: {n}", r["decode_tokens"], r) for n, r in report["trace"].items()]
    for name, tokens, r in rows:
        print(f"{name:28} {tokens:7d} {r['drafted']:8d} {r['accepted']:8d} {r['acceptance_rate']:7.3f} "
              f"{r['decode_iterations']:6d}")
    return report


if __name__ == "__main__":
    main()
