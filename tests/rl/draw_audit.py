"""Audit of the sampler's draws as the GRPO loop issues them.

The loop's own rollout (`rl.loop`: its episodes, per-request seeds `sample_seed * 1000 + turn`,
the engine and schedule of its config) runs for a few steps at fixed weights while every draw is
recorded: the distribution it was drawn from, the token, and the request's seed. Each draw becomes
a randomized probability integral transform (PIT) value

    v = F(token - 1) + w * p(token),    F the CDF of the draw's distribution in a fixed vocabulary order,
                                        w uniform from a generator of the audit's own,

which is uniform on [0, 1) when the token follows its distribution, and independent of every other
draw's v when the draws are independent. The audit then tests (chi-square against the uniform
grid) the marginal of all v, and the joint law of pairs of draws that the RL loop couples:
consecutive tokens of one request, the turns of one episode, members of one GRPO group, the same
episode slot in consecutive steps, and rows of one batch. Two vocabulary orders are used: the
sampler's index order (where an inverse-CDF draw's v tracks its uniform) and a random permutation.

`draw_functions` names the implementations audited: the engine's eager draw (`ours`), its
one-launch kernel (`kernel`, `kernels.draw`: on CUDA, or on CPU in Triton's interpreter), the
per-row `torch.multinomial` draw it replaced, and deliberately broken ones that the audit must reject.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import types
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from megatron_rollout.engine import sampler
from megatron_rollout.engine.api import SamplingParams, sample_seed
from megatron_rollout.kernels import draw as draw_kernel
from rl.loop import GRPOConfig, GRPORun, _episodes
from rl.rollout import rollout

DrawFn = Callable[[torch.Tensor, object, Sequence[torch.Generator | None]], tuple[torch.Tensor, torch.Tensor]]
OURS: DrawFn = sampler._draw


def _multinomial(rows, params, generators):
    """The draw before inverse CDF: one `torch.multinomial` per row from its own generator."""
    logp = sampler.filtered_logprobs(rows, params)
    token = torch.cat([torch.multinomial(lp.exp(), 1, generator=g) for lp, g in zip(logp, generators)])
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


def _kernel(rows: torch.Tensor, params: SamplingParams, generators: Sequence[torch.Generator | None]
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's one-launch draw (`sampler.one_launch`), on CUDA when there is one (else
    on CPU, in Triton's interpreter). `PendingDraw` takes it for a batch of one law, greedy or
    temperature 1 unfiltered: the law the loop samples (`temperature: 1.0` in its configs, `sharpen`
    scaling the logits, not the temperature). Its logprob is the raw softmax's, which at those two
    laws is the drawn distribution's, as `_draw` returns it."""
    device = torch.device("cuda") if torch.cuda.is_available() else rows.device
    logits = rows.to(device)
    if not draw_kernel.applies(params.temperature, params.top_k, params.top_p, logits):
        raise ValueError(f"the draw kernel does not draw temperature {params.temperature}, top_k {params.top_k}, "
                         f"top_p {params.top_p} from {tuple(logits.shape)} {logits.dtype} rows on {device}: it draws "
                         "greedy or temperature 1 unfiltered, on CUDA or under TRITON_INTERPRET=1")
    drawn = sampler.one_launch(logits, params.temperature, generators)  # as `PendingDraw` calls it
    return drawn.tokens.to(rows.device), drawn.packed[2 * rows.shape[0]:].to(rows.device)


def _shared_uniform(rows, params, generators):
    """Broken: one uniform for every row of a batch (rows, group members, episodes correlated)."""
    logp = sampler.filtered_logprobs(rows, params)
    u = torch.rand(1, generator=generators[0]).expand(rows.shape[0])
    token = sampler.inverse_cdf(logp, u.contiguous())
    for g in generators[1:]:
        torch.rand(1, generator=g)  # keep every stream's position as ours would
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


def _biased(rows, params, generators):
    """Broken: uniforms bent towards 0, so low token ids are drawn too often."""
    logp = sampler.filtered_logprobs(rows, params)
    u = torch.cat([torch.rand(1, generator=g) for g in generators]) ** 1.25
    token = sampler.inverse_cdf(logp, u)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


def _turn_seeded(rows, params, generators):
    """Broken: the uniform depends on the turn and position only (every episode and step alike)."""
    logp = sampler.filtered_logprobs(rows, params)
    us = []
    for g in generators:
        torch.rand(1, generator=g)  # keep every stream's position as ours would
        us.append(torch.rand(1, generator=torch.Generator().manual_seed(g.initial_seed() % 1000)))
    token = sampler.inverse_cdf(logp, torch.cat(us))
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


draw_functions: dict[str, DrawFn] = {"ours": OURS, "kernel": _kernel, "multinomial": _multinomial,
                                     "shared_uniform": _shared_uniform, "biased": _biased, "turn_seeded": _turn_seeded}


@dataclasses.dataclass
class Draw:
    seed: int  # the request's generator seed: sample_seed * 1000 + turn (a shared turn 0: `api.sample_seed`)
    index: int  # how many draws this generator made before
    call: int  # which batch (one `_draw` call) it was drawn in
    row: int  # its row in that batch
    logp: np.ndarray  # [V] float64: the distribution it was drawn from
    token: int


@contextlib.contextmanager
def recording(draw: DrawFn, into: list[Draw]) -> Iterator[None]:
    """Replace the engine's per-group draw by `draw`, recording every draw it makes. The engine's
    one-launch path (`kernels.draw`, which `PendingDraw` takes instead of `_draw` on CUDA or under
    TRITON_INTERPRET=1) is off meanwhile, so every batch reaches `draw`: what is audited is what drew."""
    counts: dict[int, int] = defaultdict(int)
    calls = [0]

    def recorded(rows, params, generators):
        token, logprob = draw(rows, params, generators)
        logp = sampler.filtered_logprobs(rows, params).double().numpy()
        for i, g in enumerate(generators):
            seed = g.initial_seed()
            into.append(Draw(seed, counts[seed], calls[0], i, logp[i], int(token[i])))
            counts[seed] += 1
        calls[0] += 1
        return token, logprob

    original = sampler._draw, sampler.draw_kernel  # the sampler's name for the kernel module, not the module
    sampler._draw = recorded
    sampler.draw_kernel = types.SimpleNamespace(applies=lambda *args: False, draw=draw_kernel.draw)
    try:
        yield
    finally:
        sampler._draw, sampler.draw_kernel = original


@dataclasses.dataclass(frozen=True)
class Slot:
    step: int
    group: int
    member: int
    turn: int


def run_loop_draws(cfg: GRPOConfig, draw: DrawFn, steps: int, sharpen: float = 1.0) -> tuple[list[Draw], dict]:
    """Every draw of `steps` rollouts of the GRPO loop at its initial weights (output layer scaled by
    `sharpen`, to audit peaked distributions too), and each generator seed's episode slot."""
    run = GRPORun(cfg)
    try:
        if sharpen != 1.0:
            named = dict(run.policy.named_parameters())
            head = named["output_layer.weight"]
            with torch.no_grad():
                head.mul_(sharpen)
            run.engine.update_weights(run.trainer.named_weights(), 1)
        slots: dict[int, Slot] = {}
        draws: list[Draw] = []
        for step in range(steps):
            episodes = _episodes(cfg, run.tok, step, 0, 1)
            for k, ep in enumerate(episodes):
                member = k % cfg.group_size
                for turn in range(cfg.max_turns):
                    seed = ep.sample_seed * 1000 + turn
                    if turn == 0 and run.rollout_cfg.share_prompt:  # the group's one request, n = group size
                        seed = sample_seed(episodes[k - member].sample_seed * 1000, member)
                    slots[seed % 2**64] = Slot(step, ep.group_id, member, turn)
            run.engine.wake_up(tags=["kv"])
            with recording(draw, draws):
                rollout(run.engine, episodes, run.rollout_cfg)
            run.engine.sleep(tags=["kv"])
        return draws, slots
    finally:
        run.close()


def pit(draws: list[Draw], order: np.ndarray | None, rng: np.random.Generator) -> np.ndarray:
    """Randomized PIT value of every draw, the vocabulary taken in `order` (None: index order)."""
    out = np.empty(len(draws))
    for i, d in enumerate(draws):
        p = np.exp(d.logp)
        if order is not None:
            p, tok = p[order], int(np.flatnonzero(order == d.token)[0])
        else:
            tok = d.token
        out[i] = p[:tok].sum() + rng.random() * p[tok]
    return np.clip(out / p.sum(), 0.0, np.nextafter(1.0, 0.0))


def chi2_pvalue(stat: float, df: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def uniform_p(v: np.ndarray, bins: int = 20) -> float:
    counts = np.bincount((v * bins).astype(int), minlength=bins)
    expected = len(v) / bins
    return chi2_pvalue(float(((counts - expected) ** 2 / expected).sum()), bins - 1)


def pairs_p(a: np.ndarray, b: np.ndarray, bins: int = 5) -> float:
    """Joint uniformity of (a, b) on a bins x bins grid: fails on dependence (and on a bad marginal)."""
    cell = (a * bins).astype(int) * bins + (b * bins).astype(int)
    counts = np.bincount(cell, minlength=bins * bins)
    expected = len(a) / bins**2
    return chi2_pvalue(float(((counts - expected) ** 2 / expected).sum()), bins * bins - 1)


def pair_sets(draws: list[Draw], slots: dict[int, Slot]) -> dict[str, list[tuple[int, int]]]:
    """Index pairs of draws the RL loop couples, by kind."""
    by_key = {(slots[d.seed], d.index): i for i, d in enumerate(draws) if d.seed in slots}
    out: dict[str, list[tuple[int, int]]] = {"within_request": [], "across_turns": [], "within_group": [],
                                             "across_steps": [], "within_batch": []}
    for (slot, index), i in by_key.items():
        nxt = by_key.get((slot, index + 1))
        if nxt is not None:
            out["within_request"].append((i, nxt))
        if slot.turn == 0 and index == 0:
            other = by_key.get((dataclasses.replace(slot, turn=1), 0))
            if other is not None:
                out["across_turns"].append((i, other))
        if slot.member % 2 == 0:
            other = by_key.get((dataclasses.replace(slot, member=slot.member + 1), index))
            if other is not None:
                out["within_group"].append((i, other))
        if slot.step % 2 == 0:
            other = by_key.get((dataclasses.replace(slot, step=slot.step + 1), index))
            if other is not None:
                out["across_steps"].append((i, other))
    rows: dict[int, list[int]] = defaultdict(list)
    for i, d in enumerate(draws):
        rows[d.call].append(i)
    for members in rows.values():
        out["within_batch"] += list(zip(members[0::2], members[1::2]))
    return out


def audit(draws: list[Draw], slots: dict[int, Slot], seed: int = 0) -> dict[str, float]:
    """p-values: the marginal and every pair kind, in index order and under a random vocabulary order."""
    rng = np.random.default_rng(seed)
    vocab = len(draws[0].logp)
    results: dict[str, float] = {}
    pairs = pair_sets(draws, slots)
    for name, order in (("index", None), ("permuted", rng.permutation(vocab))):
        v = pit(draws, order, rng)
        results[f"{name}/marginal"] = uniform_p(v)
        for kind, idx in pairs.items():
            if len(idx) >= 250:  # at least 10 a cell
                a, b = np.array(idx).T
                results[f"{name}/{kind}"] = pairs_p(v[a], v[b])
    return results


def smallest(results: dict[str, float]) -> tuple[str, float]:
    name = min(results, key=results.get)
    return name, results[name]


def significant(results: dict[str, float], alpha: float) -> list[str]:
    return sorted(k for k, p in results.items() if p < alpha or math.isnan(p))
