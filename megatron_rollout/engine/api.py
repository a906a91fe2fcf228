"""Records that cross the engine's boundary: what a caller asks for and what comes back."""
from __future__ import annotations

import enum
import functools
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass


class Schedule(enum.Enum):
    """How prefill (P) and decode (D) share a step (docs/design.md §9)."""

    OFF = "off"  # a whole prefill batch runs before decode resumes
    CHUNKED = "chunked"  # prefill chunks ride in decode steps under a token budget
    MUX = "mux"  # segmented prefill with a decode iteration between segments (turnstile)


class RequestError(ValueError):
    """A request was refused; the engine keeps serving the others."""


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop token was sampled (it is included in the output)
    LENGTH = "length"  # max_new_tokens reached, or the context is full
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # the request was refused (see `error`); other requests are unaffected


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """0 is greedy."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set whose probability reaches top_p."""
    max_new_tokens: int = 64
    """Upper bound on generated tokens."""
    stop_token_ids: tuple[int, ...] = ()
    """Sampling one of these finishes the request (the token is kept)."""
    ignore_stop: bool = False
    """Generate exactly max_new_tokens (trace replay forces output lengths this way)."""
    seed: int | None = None
    """Per-request seed: the same seed and weights give the same tokens. With `n` > 1, sample i
    draws from `sample_seed(seed, i)` (sample 0 from `seed` itself)."""
    n: int = 1
    """Samples of the prompt, prefilled once, drawn independently (`RequestOutput.results`)."""
    logprobs: int | None = None
    """k: per generated token, the k most likely tokens' and the sampled one's model logprobs."""
    prompt_logprobs: int | None = None
    """k: per prompt token, its model logprob given the tokens before it, and the k most likely's."""

    def __post_init__(self) -> None:
        # Checked here, at submission, so that one bad value is refused for its request alone
        # instead of raising inside a step that serves everyone co-batched with it.
        set_ = functools.partial(object.__setattr__, self)
        set_("temperature", _real("temperature", self.temperature))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        set_("top_k", _integer("top_k", self.top_k))
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 keeps all tokens), got {self.top_k}")
        set_("top_p", _real("top_p", self.top_p))
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        set_("max_new_tokens", _integer("max_new_tokens", self.max_new_tokens))
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, Iterable):
            raise ValueError(f"stop_token_ids must be a sequence of token ids, got {_describe(self.stop_token_ids)}")
        stops = tuple(_integer("stop_token_ids entry", t) for t in self.stop_token_ids)
        if any(t < 0 for t in stops):
            raise ValueError(f"stop_token_ids must be >= 0, got {min(stops)}")
        set_("stop_token_ids", stops)
        if not isinstance(self.ignore_stop, bool):
            raise ValueError(f"ignore_stop must be True or False, got {_describe(self.ignore_stop)}")
        if self.seed is not None:
            set_("seed", _integer("seed", self.seed))
            if not 0 <= self.seed < 2**64:
                raise ValueError(f"seed must be in [0, 2**64) (a torch.Generator seed), got {self.seed}")
        set_("n", _integer("n", self.n))
        if not 1 <= self.n <= MAX_SAMPLES:
            raise ValueError(f"n must be in [1, {MAX_SAMPLES}] (samples of one prompt), got {self.n}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None:
                set_(name, _integer(name, k))
                if not 0 <= k <= MAX_LOGPROBS:
                    raise ValueError(f"{name} must be None or in [0, {MAX_LOGPROBS}] (the most likely tokens "
                                     f"to report), got {k}")


MAX_SAMPLES, MAX_LOGPROBS = 1024, 64  # most samples of one request; most top tokens per position


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded `seed`: `seed` itself for sample 0, and a
    splitmix64 hash of (seed, index) for the others, so the samples of nearby seeds (seed, seed + 1:
    a GRPO loop's consecutive groups) never share a stream."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def _describe(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


def _integer(name: str, value: object) -> int:
    """An integer (numpy's too) as a Python int; bool, float (even 2.0) and str are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {_describe(value)}")
    return int(value)


def _real(name: str, value: object) -> float:
    """A finite real number as a Python float; bool, str, NaN and infinities are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {_describe(value)}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]
    """Generated tokens (prompt excluded)."""
    logprobs: list[float]
    """fp32 log-probability of each token under the distribution it was sampled from (raw
    logits at temperature 0 or 1; temperature/top-k/top-p applied otherwise)."""
    finish_reason: FinishReason
    weight_versions: list[int]
    """Weight version each token was sampled under."""
    error: str | None = None
    top_logprobs: list[dict[int, float]] | None = None
    """`logprobs=k`: per token, id -> model logprob of the k most likely (first) and the sampled one."""
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """`prompt_logprobs=k`: per prompt token (None first), id -> model logprob, its own then the k best."""

    @property
    def weight_version(self) -> int:
        """Version of the last token (-1 when nothing was generated)."""
        return self.weight_versions[-1] if self.weight_versions else -1


@dataclass(frozen=True)
class RequestTimes:
    """Wall-clock marks (time.perf_counter) of one request."""

    arrival: float
    first_token: float | None
    finish: float
    admitted: float | None = None
    """When its prefill was first planned (the scheduler admitted it); None where not recorded."""


@dataclass(frozen=True)
class RequestOutput:
    """A finished request, as `engine.step()` returns it."""

    request_id: int
    result: GenerationResult
    times: RequestTimes
    prompt_tokens: int
    """Tokens this request prefilled (for a session turn: the new tokens only), once for all n samples."""
    samples: tuple[GenerationResult, ...] = ()
    """With `SamplingParams.n` > 1: every sample's result, sample 0 first (`result` is sample 0)."""

    @property
    def results(self) -> tuple[GenerationResult, ...]:
        """The n samples' results (one: `(result,)`)."""
        return self.samples or (self.result,)
