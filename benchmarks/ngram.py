"""`python -m benchmarks.ngram`: how often n-gram (prompt-lookup) drafts would be accepted, on text and on a trace.

Three measurements, all on the CPU:
- `text`: no model. A text is decoded as a model that reproduces it greedily would decode it: from
  its first half on, each iteration drafts k tokens by lookup over the text so far
  (`drafts.NgramIndex`), keeps the drafts that equal the text's next tokens, and emits one more.
  This is the acceptance rate of a model that writes the text, so it says how repetitive the text
  is in the way lookup catches. Texts: a source file of this repository, and the same file's
  first 2,000 bytes said three times (a context that repeats outright), byte-level as `tiny-moe`
  reads them; and the token ids `trace.make` draws for a conversation's inputs (uniformly random).
- `group`: no model. The samples of an RL group as `SpeculativeConfig.group` drafts them: 8 texts
  share the first 1,000 bytes of `PASSAGE` (the prompt) and each holds its own copy of the next
  2,000 (the answer) with a share of its bytes replaced at random (`GROUP_EDITS`). The last sample
  decodes its answer as `text` does, after the others wrote theirs: from its own context alone
  (`own`), and with the others' (`group`). How much real samples of a policy agree is not measured
  here; this gives the iterations a laggard needs at each rate of agreement, and the lookups' host
  time per iteration.
- `rules`: no model. The `text` replay under two lookup rules: ours (the latest earlier occurrence
  of the longest matching suffix, copied on periodically past the context's end) and vLLM's
  `NgramProposer`'s (the earliest occurrence of the longest matching suffix, nothing past the
  context's end; re-implemented here from what it does, `earliest_draft`), on the texts above and
  on the greedy outputs of `tiny-moe` with random weights (`model_outputs`), which loop as the
  benchmark's random models do.
- `trace`: the engine. A trace from `trace.make` replayed on the `tiny-moe` preset (random weights,
  greedy), with `SpeculativeConfig("ngram", k)`: drafted and accepted tokens and decode iterations
  against the same replay without drafts. The inputs are random ids and the outputs a random
  model's, so this measures the random model's own repetition, not an agent's.

A table on stdout, JSON to `--out`.
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from megatron_rollout.drafts import Family, NgramIndex
from megatron_rollout.engine import EngineConfig, KVConfig, RolloutEngine, SchedulerConfig, SpeculativeConfig
from megatron_rollout.engine.api import SamplingParams
from megatron_rollout.model.checkpoint import load_model
from megatron_rollout.tokenizer import ByteTokenizer
from megatron_rollout.trace.make import conversation_inputs, make_trace
from megatron_rollout.trace.replay import replay

SOURCE = Path(__file__).resolve().parents[1] / "megatron_rollout" / "engine" / "drafting.py"
PASSAGE = Path(__file__).resolve().parent / "group_passage.txt"
"""The `group` case's text: the first 3,000 bytes of `engine/drafting.py` as of commit c013449, kept
apart so that its figures do not move when that file is edited."""
GROUP_EDITS = (0.0, 0.01, 0.05, 0.2)
"""Shares of an answer's tokens in which the samples of the `group` case differ."""


def earliest_draft(context: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """vLLM's prompt-lookup rule, for comparison: the longest n in [n_min, n_max] whose last n tokens
    occurred earlier, their earliest such occurrence, and up to k tokens after it (none past the
    context's end)."""
    ids = np.asarray(context)
    for n in range(min(n_max, len(ids) - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # those ending before the suffix's end
        hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if hits.size:
            return ids[hits[0] + n:hits[0] + n + k].tolist()
    return []


def replay_text(tokens: list[int], start: int, k: int, n_min: int, n_max: int,
                siblings: Sequence[list[int]] = (), rule: str = "latest") -> dict:
    """Decode tokens[start:] as a model that writes `tokens` greedily would, drafting by lookup; with
    `siblings` (other samples' whole texts), as `SpeculativeConfig.group` drafts (`drafts.Family`);
    `rule` "earliest": by `earliest_draft` instead of `NgramIndex`. `host_us`: the lookups' time per
    iteration on this machine."""
    if rule not in ("latest", "earliest"):
        raise ValueError(f"rule must be 'latest' (ours) or 'earliest' (vLLM's), got {rule!r}")
    context, index, group = list(tokens[:start]), NgramIndex(n_min, n_max), Family()
    group.join(0, context, index)
    for key, text in enumerate(siblings, start=1):
        sibling = NgramIndex(n_min, n_max)
        sibling.sync(text)
        group.join(key, text, sibling)
    drafted = accepted = iterations = copied = 0
    spent = 0.0
    while len(context) < len(tokens):
        pos = len(context)
        t0 = time.perf_counter()
        budget = min(k, len(tokens) - pos - 1)  # the context's last token is the pending one: drafts guess tokens[pos:]
        if rule == "earliest":
            draft, from_sibling = earliest_draft(context, budget, n_min, n_max), False
        else:
            index.sync(context)
            draft, from_sibling = group.propose(0, budget) if siblings else (index.propose(budget), False)
        spent += time.perf_counter() - t0
        kept = next((i for i, t in enumerate(draft) if t != tokens[pos + i]), len(draft))
        drafted, accepted, iterations = drafted + len(draft), accepted + kept, iterations + 1
        copied += len(draft) if from_sibling else 0
        context += tokens[pos:pos + kept + 1]
    return {"tokens": len(tokens) - start, "drafted": drafted, "accepted": accepted, "copied": copied,
            "acceptance_rate": accepted / drafted if drafted else 0.0, "decode_iterations": iterations,
            "host_us": 1e6 * spent / iterations if iterations else 0.0}


def group_texts(tokens: list[int], prompt: int, answer: int, samples: int, edit: float, seed: int
                ) -> list[list[int]]:
    """`samples` texts of one group: the shared `prompt` tokens of `tokens`, then each its own copy of
    the next `answer` tokens with every token replaced, with probability `edit`, by one drawn from
    the text's own tokens. A stand-in for samples that agree on all but a share `edit` of their
    tokens; how often real RL samples agree is not measured here."""
    rng = np.random.default_rng(seed)
    shared, body = tokens[:prompt], np.asarray(tokens[prompt:prompt + answer])
    alphabet = np.unique(np.asarray(tokens))
    out = []
    for _ in range(samples):
        edited = np.where(rng.random(len(body)) < edit, rng.choice(alphabet, len(body)), body)
        out.append(shared + edited.tolist())
    return out


def replay_group(tokens: list[int], edit: float, k: int, n_min: int, n_max: int, samples: int = 8,
                 prompt: int = 1000, answer: int = 2000, seed: int = 0) -> dict:
    """The group's last sample decoding its answer after the others wrote theirs, drafting from its
    own context alone (`own`) and from the others' too (`group`)."""
    texts = group_texts(tokens, prompt, answer, samples, edit, seed)
    last, others = texts[-1], texts[:-1]
    return {"own": replay_text(last, prompt, k, n_min, n_max),
            "group": replay_text(last, prompt, k, n_min, n_max, siblings=others)}


def texts(seed: int, vocab_size: int) -> dict[str, list[int]]:
    source = SOURCE.read_text()
    trace = make_trace(conversations=1, seed=seed, scale=0.05, profile="prefill")
    ids = [t for turn in next(iter(conversation_inputs(trace, seed, vocab_size).values())) for t in turn]
    tok = ByteTokenizer()
    return {"source file": tok.encode(source), "a passage said 3 times": tok.encode(source[:2000] * 3),
            "trace input ids": ids}


def model_outputs(seed: int, prompts: int = 4, prompt_len: int = 400, new: int = 1000) -> list[tuple[list[int], int]]:
    """(prompt + greedy output, prompt length) of `tiny-moe` with random weights on random prompts."""
    model = load_model("tiny-moe")
    engine = RolloutEngine(model, EngineConfig(scheduler=SchedulerConfig(block_size=16), kv=KVConfig(num_blocks=4096)))
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, model.cfg.vocab_size, prompt_len).tolist() for _ in range(prompts)]
    outs = engine.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=new, ignore_stop=True))
    return [(p + o.token_ids, prompt_len) for p, o in zip(ids, outs)]


def rule_cases(seed: int) -> dict[str, list[tuple[list[int], int]]]:
    """The `rules` cases, each (tokens, where decoding starts) parts: the texts from their second
    half, and the model's outputs from each prompt's end."""
    cases = {name: [(tokens, len(tokens) // 2)] for name, tokens in texts(seed, 260).items()}
    cases["tiny-moe greedy outputs"] = model_outputs(seed)
    return cases


def replay_rules(cases: dict[str, list[tuple[list[int], int]]], k: int, n_min: int, n_max: int) -> dict:
    """Each case's parts replayed and summed, under both lookup rules."""
    out: dict = {}
    for rule in ("latest", "earliest"):
        for name, parts in cases.items():
            runs = [replay_text(tokens, start, k, n_min, n_max, rule=rule) for tokens, start in parts]
            total = {key: sum(r[key] for r in runs) for key in ("tokens", "drafted", "accepted", "decode_iterations")}
            total["acceptance_rate"] = total["accepted"] / total["drafted"] if total["drafted"] else 0.0
            out.setdefault(rule, {})[name] = total
    return out


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


def plot_group(report: dict, path: Path) -> None:
    """The `group` case: the laggard's decode iterations by share of edited tokens, own against group
    drafts, each bar labelled with its acceptance rate. Needs matplotlib (the `plot` extra)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    edits = list(report["group"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for j, variant in enumerate(("own", "group")):
        rows = [report["group"][e][variant] for e in edits]
        bars = ax.bar([i + 0.4 * j for i in range(len(edits))], [r["decode_iterations"] for r in rows], 0.4,
                      label=f"{variant} drafts")
        for bar, r in zip(bars, rows):
            ax.annotate(f"{r['acceptance_rate']:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
    ax.set_xticks([i + 0.2 for i in range(len(edits))], [f"{float(e):.0%}" for e in edits])
    ax.set_xlabel("share of the answer's tokens in which the samples differ")
    ax.set_ylabel("laggard's decode iterations")
    ax.set_title(f"{report['group'][edits[0]]['own']['tokens']}-token answer, k={report['k']}, 8 samples "
                 f"(labels: acceptance)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--scale", type=float, default=0.05, help="the trace's token counts (decode profile)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/ngram.json"))
    ap.add_argument("--rules", action=argparse.BooleanOptionalAction, default=True,
                    help="the text replay under both lookup rules (ours and vLLM's)")
    ap.add_argument("--plot", type=Path, default=None, help="draw the group case here (PNG; needs matplotlib)")
    args = ap.parse_args(argv)
    lookup = (args.k, args.ngram_min, args.ngram_max)
    report = {"k": args.k, "ngram": [args.ngram_min, args.ngram_max],
              "text": {name: replay_text(tokens, len(tokens) // 2, *lookup)
                       for name, tokens in texts(args.seed, 260).items()},
              "group": {str(e): replay_group(ByteTokenizer().encode(PASSAGE.read_text()), e, *lookup, seed=args.seed)
                        for e in GROUP_EDITS},
              "rules": replay_rules(rule_cases(args.seed), *lookup) if args.rules else {},
              "trace": replay_trace(args.conversations, args.seed, args.scale, *lookup)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    if args.plot is not None:
        plot_group(report, args.plot)
    print(f"n-gram drafts, k={args.k}, n in [{args.ngram_min}, {args.ngram_max}]")
    print(f"{'case':40} {'tokens':>7} {'drafted':>8} {'accepted':>8} {'accept':>7} {'iters':>6} {'host us':>8}")
    rows = [(f"text: {n}", r["tokens"], r) for n, r in report["text"].items()]
    rows += [(f"group, edits {e}: {n}", r["tokens"], r) for e, g in report["group"].items() for n, r in g.items()]
    rows += [(f"{rule} rule: {n}", r["tokens"], r) for rule, cases in report["rules"].items() for n, r in cases.items()]
    rows += [(f"trace: {n}", r["decode_tokens"], r) for n, r in report["trace"].items()]
    for name, tokens, r in rows:
        host = f"{r['host_us']:8.1f}" if "host_us" in r else f"{'-':>8}"
        print(f"{name:40} {tokens:7d} {r['drafted']:8d} {r['accepted']:8d} {r['acceptance_rate']:7.3f} "
              f"{r['decode_iterations']:6d} {host}")
    return report


if __name__ == "__main__":
    main()
