"""A decode step's draw in one launch: greedy or temperature-1 tokens, their logprobs and each row's max.

Why: `engine.sampler.PendingDraw` draws a batch with a dozen small eager kernels (the fp32 copy,
the log-softmax, the argmax or the exp, scan and two searches of the inverse CDF, the gathers, the
concatenation of what goes to the host); on an H100 that was 0.23-0.25 ms a greedy step and
0.44-0.47 ms a temperature-1 step of one to four rows (`benchmarks.host --sample`), most of it the
host issuing them, between every two decode forwards. One program per row reads the row twice:

1. the row's max, the sum of exp(x - max) (online, block by block), the first index of the max;
2. (sampled rows) the blocks' running cumulative sums of exp(x - max) against the row's target
   u * sum, the first index past it; where rounding leaves none past it, the last index of
   positive probability.

The token's logprob is x[token] - max - log(sum): the raw softmax's, which is the distribution's at
temperature 0 and 1 (the two laws it serves; `applies`). Each row writes its max (NaN when any
entry is NaN), its token and its logprob into `packed` [3 * rows], laid out as `PendingDraw`
copies them to the host, and its token into `tokens` [rows] (int64, for the next forward).

The same rule as `sampler.inverse_cdf`, summed in another order: a target within fp32 rounding of a
cumulative boundary may pick the neighbouring token. Greedy takes the first index of the raw
logits' max (torch's argmax picks the first maximum of the log-softmax).

Left out: other temperatures, top-k and top-p (the eager path draws those), and splitting a row
over several programs (a row of 151,936 bf16 logits is two passes over 300 KB).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_rollout.kernels.fused import interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs draw with the eager path
    triton = None

BLOCK = 4096
"""Vocabulary entries a program reads per iteration."""
LAUNCHES = {"draw": 0}
"""Launches of the kernel (host-side count): lets a test see that the kernel, not the eager path, ran."""


class Drawn(NamedTuple):
    """A batch's draw, on the logits' device."""

    tokens: torch.Tensor
    """[rows] int64: what the next forward reads."""
    packed: torch.Tensor
    """[3 * rows] fp32: the row maxes, the tokens, their logprobs: what the host copies back."""


def applies(temperature: float, top_k: int | None, top_p: float, logits: torch.Tensor) -> bool:
    """Whether the kernel draws this law from these logits: greedy or temperature 1, unfiltered,
    [rows, V] bf16 or fp32 with unit stride along V, on CUDA (or interpreting), Triton present."""
    return (triton is not None and temperature in (0.0, 1.0) and not top_k and top_p >= 1.0
            and logits.dim() == 2 and logits.shape[0] > 0 and logits.stride(-1) == 1
            and logits.dtype in (torch.bfloat16, torch.float32) and (logits.is_cuda or interpreting()))


def draw(logits: torch.Tensor, u: torch.Tensor | None) -> Drawn:
    """The draw of `logits` [rows, V]: the argmax where `u` is None, else the inverse-CDF draw at the
    uniforms `u` [rows] (fp32, on the logits' device). Callers check `applies` first."""
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    packed = torch.empty(3 * rows, dtype=torch.float32, device=logits.device)
    LAUNCHES["draw"] += 1  # greedy reads no uniform: `packed` stands in for the pointer
    _draw_kernel[(rows,)](logits, logits.stride(0), packed if u is None else u, packed, tokens, rows,
                          VOCAB=vocab, BLOCK=BLOCK, GREEDY=u is None, num_warps=8)
    return Drawn(tokens, packed)


if triton is not None:
    @triton.jit(do_not_specialize=["rows"])
    def _draw_kernel(logits, stride, u, packed, tokens, rows, VOCAB: tl.constexpr, BLOCK: tl.constexpr,
                     GREEDY: tl.constexpr):
        row = tl.program_id(0)
        base = logits + row.to(tl.int64) * stride
        offs = tl.arange(0, BLOCK)
        big = float("inf")
        # pass 1: max (NaN entries aside, flagged), sum of exp(x - max), first index of the max
        m = -big
        s = 0.0
        nan = 0
        first = 0
        for start in range(0, VOCAB, BLOCK):
            idx = start + offs
            x = tl.load(base + idx, mask=idx < VOCAB, other=-big).to(tl.float32)
            nan = tl.maximum(nan, tl.max((x != x).to(tl.int32), 0))
            x = tl.where(x == x, x, -big)
            top = tl.max(x, 0)
            first = tl.where(top > m, start + tl.argmax(x, 0, tie_break_left=True), first)
            new = tl.maximum(m, top)
            scale = tl.where(new == -big, 0.0, tl.exp(m - new))
            s = s * scale + tl.sum(tl.where(x == -big, 0.0, tl.exp(x - new)), 0)
            m = new
        token = first
        if not GREEDY:
            # pass 2: the first index whose running sum passes u * s, else the last of positive mass
            target = tl.load(u + row) * s
            run = 0.0
            hit = VOCAB
            last = -1
            for start in range(0, VOCAB, BLOCK):
                idx = start + offs
                x = tl.load(base + idx, mask=idx < VOCAB, other=-big).to(tl.float32)
                p = tl.where(x == -big, 0.0, tl.exp(x - m))
                p = tl.where(p == p, p, 0.0)
                cdf = tl.cumsum(p, 0) + run
                hit = tl.minimum(hit, tl.min(tl.where((cdf > target) & (p > 0), idx, VOCAB), 0))
                last = tl.maximum(last, tl.max(tl.where(p > 0, idx, -1), 0))
                run += tl.sum(p, 0)
            token = tl.where(hit < VOCAB, hit, tl.maximum(last, 0))
        token = tl.minimum(tl.maximum(token, 0), VOCAB - 1)
        picked = tl.load(base + token).to(tl.float32)
        tl.store(packed + row, tl.where(nan > 0, float("nan"), m))
        tl.store(packed + rows + row, token.to(tl.float32))
        tl.store(packed + 2 * rows + row, picked - m - tl.log(s))
        tl.store(tokens + row, token.to(tl.int64))
