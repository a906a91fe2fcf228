"""Token sampling with log-probabilities.

The log-probability reported for a token is the fp32 log-probability under the distribution it
was drawn from: the raw logits' softmax at temperature 0 (greedy) and 1; the temperature-scaled,
top-k/top-p-filtered softmax otherwise. That is what an RL trainer's importance ratio needs.
A request with a seed draws from its own generator, so its tokens do not depend on which other
requests share the batch.

Rows are judged one by one: a row whose logits are not finite (NaN weights, a diverging trainer)
comes back as a `Sampled` with `error` set and no token, so its caller can fail that request alone;
argmax over NaN would silently give token 0 and `multinomial` would raise for the whole batch.
-inf entries are allowed (a masked token), as long as some entry is finite.

`PendingDraw` is a batch's draw split in two: the device work and one asynchronous copy to
pinned host memory are issued at once, the host reads them later; `sample` is both at once. Its
`tokens` stay on the device, where the next decode forward can take them as input before the
host has seen them (`engine.ahead`). Sampled rows draw by inverse CDF from one host uniform per
row (from the request's own generator), so no row's probabilities cross to the host.

Top logprobs (`SamplingParams.logprobs`) are the same rows' raw log-softmax (the model's, whatever
temperature, top-k or top-p the draw used: what a trainer's `token_logprobs` computes).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from megatron_rollout.engine.api import SamplingParams
from megatron_rollout.engine.request import Sampled
from megatron_rollout.kernels import draw as draw_kernel
from megatron_rollout.kernels.layout import to_device


def non_finite(row_max: float) -> Sampled:
    # A row's max is NaN if any entry is NaN (amax propagates NaN), +inf if any entry is +inf,
    # and -inf only when every entry is -inf: the three ways a softmax over it has no meaning.
    kind = "nan" if math.isnan(row_max) else ("inf" if row_max > 0 else "-inf everywhere")
    return Sampled(None, None, f"non-finite logits ({kind})")


def filtered_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [..., V] -> fp32 log-probabilities of the sampling distribution, row by row (-inf
    where filtered)."""
    x = logits.float()
    if params.temperature not in (0.0, 1.0):
        # Shift first: the max becomes 0, so a tiny temperature gives -inf for the rest, never inf - inf.
        x = (x - x.amax(-1, keepdim=True)) / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        # keep tokens whose preceding mass is below top_p (the first token is always kept)
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        x = x.scatter(-1, idx, sorted_x.masked_fill(drop, float("-inf")))
    return x.log_softmax(-1)


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> Sampled:
    """logits: [V]."""
    return sample(logits[None], [params], [generator])[0]


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[Sampled]:
    """logits: [rows, V]; one params and generator per row. Never raises for a row's values: a
    non-finite row gets `Sampled(None, None, error)` and the other rows are sampled as usual."""
    return PendingDraw(logits, params, generators).result(range(logits.shape[0]))


def by_law(params: Sequence[SamplingParams]) -> list[list[int]]:
    """The indices of `params` that sample from one law, in order of first appearance: greedy rows
    together, sampled ones by (temperature, top_k, top_p); rows of one group are filtered together."""
    groups: dict[tuple | None, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(None if p.temperature == 0.0 else (p.temperature, p.top_k, p.top_p), []).append(i)
    return list(groups.values())


def inverse_cdf(logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of `logp` [g, V] for uniforms `u` [g] in [0, 1): the first index whose
    cumulative probability passes u * total, never past the last token of positive probability."""
    cdf = logp.exp().cumsum(-1)
    total = cdf[:, -1:].contiguous()
    picked = torch.searchsorted(cdf, u[:, None] * total, right=True)
    last = torch.searchsorted(cdf, total, right=False)  # the first index reaching the total mass
    # A non-finite row's cumulative sums are NaN or inf and its index may be V: kept in range, so
    # the gather after it stays valid (its result is the row's error, not this token).
    return torch.minimum(picked, last).squeeze(-1).clamp_(0, logp.shape[-1] - 1)


def _uniforms(generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One uniform in [0, 1) per row, each from its row's generator (the default one for None), on the host."""
    return torch.cat([torch.rand(1, generator=g) for g in generators])


def one_launch(logits: torch.Tensor, temperature: float, generators: Sequence[torch.Generator | None]
               ) -> draw_kernel.Drawn:
    """A batch of one law that `kernels.draw` serves (`draw_kernel.applies`), drawn in one launch at
    the uniforms of the rows' own generators (none for greedy)."""
    u = None if temperature == 0.0 else to_device(_uniforms(generators), logits.device)
    return draw_kernel.draw(logits, u)


def _draw(rows: torch.Tensor, params: SamplingParams, generators: Sequence[torch.Generator | None]
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and logprobs of `rows` [g, V] that share `params`, one generator per row."""
    if params.temperature == 0.0:
        logp = rows.float().log_softmax(-1)
        token = logp.argmax(-1)
    else:
        logp = filtered_logprobs(rows, params)
        token = inverse_cdf(logp, to_device(_uniforms(generators), rows.device))
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


class PendingDraw:
    """The draws of every row of `logits` [rows, V], issued now on the logits' device, read by `result`.

    Greedy rows take the argmax, with the raw softmax's logprob. A sampled row draws by inverse CDF
    from its filtered distribution with one uniform from its own generator, drawn on the host: a
    seeded request's stream does not depend on the device, nor on the rows beside it. Rows that
    share sampling params are filtered together. A batch of one law, greedy or temperature 1
    without filters, on the GPU is drawn by one kernel launch (`kernels.draw`: the same rule, its
    sums in another order; greedy takes the raw logits' first maximum). A non-finite row gets some
    in-range token (its result is the error, judged on the host from the row's max). A whole
    batch's results come back in one copy, and `tokens` ([rows] int64, meaningless for a
    non-finite row) stays on the device, where the next decode forward can read it before the host
    has (`engine.ahead`).
    """

    def __init__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None]) -> None:
        self.rows = logits.shape[0]
        groups = by_law(params)
        law = params[0] if len(groups) == 1 else None
        if law is not None and draw_kernel.applies(law.temperature, law.top_k, law.top_p, logits):
            # the usual batch, one law: one launch (`kernels.draw`) writes what goes to the host
            drawn = one_launch(logits, law.temperature, generators)
            self.tokens, parts = drawn.tokens, [drawn.packed]
        else:
            parts = self._eager(logits, params, generators, groups)
        self._want = [p.logprobs for p in params]
        self._k = max((k for k in self._want if k is not None), default=None)
        if self._k is not None:  # [rows, k] top tokens and values, [rows] the sampled token's: one copy with the rest
            raw = logits.float().log_softmax(-1)
            top = raw.topk(min(self._k, raw.shape[-1]), dim=-1)
            self._k = top.values.shape[-1]
            parts += [top.indices.float().flatten(), top.values.flatten(), raw.gather(-1, self.tokens[:, None])[:, 0]]
        packed = torch.cat(parts) if len(parts) > 1 else parts[0]
        self._ready: torch.cuda.Event | None = None
        self._host = packed
        if packed.is_cuda:
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()

    def _eager(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None], groups: list[list[int]]) -> list[torch.Tensor]:
        """Sets `tokens`; the row maxes, tokens and logprobs to copy, drawn by torch ops law by law."""
        row_max = logits.amax(-1).float() if self.rows else logits.new_zeros(0, dtype=torch.float32)
        if len(groups) == 1:  # no row index to build or move
            self.tokens, logprobs = _draw(logits, params[groups[0][0]], generators)
        else:
            self.tokens = torch.zeros(self.rows, dtype=torch.long, device=logits.device)
            logprobs = torch.zeros(self.rows, dtype=torch.float32, device=logits.device)
            for members in groups:
                index = to_device(torch.tensor(members, dtype=torch.long), logits.device)
                self.tokens[index], logprobs[index] = _draw(logits[index], params[members[0]],
                                                            [generators[i] for i in members])
        return [row_max, self.tokens.float(), logprobs]

    def result(self, rows: Iterable[int]) -> list[Sampled]:
        """The draws of `rows` (indices into the logits), waiting for the copy if it is in flight."""
        if self._ready is not None:
            self._ready.synchronize()
        host, n = self._host.tolist(), self.rows
        out = []
        for i in rows:  # a token id below 2**24 is exact in fp32
            m = host[i]
            out.append(Sampled(int(host[n + i]), host[2 * n + i], top=self._top(host, i)) if math.isfinite(m)
                       else non_finite(m))
        return out

    def _top(self, host: list[float], i: int) -> dict[int, float] | None:
        """Row i's top logprobs from the host copy (laid out by `__init__`), or None if not asked for."""
        want = self._want[i]
        if want is None:
            return None
        n, k = self.rows, self._k
        ids, values = 3 * n + i * k, 3 * n + n * k + i * k
        top = {int(host[ids + j]): host[values + j] for j in range(min(want, k))}
        top.setdefault(int(host[n + i]), host[3 * n + 2 * n * k + i])
        return top
