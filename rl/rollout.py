"""Run many environment episodes concurrently against one engine; return trajectories.

Why asyncio: an agentic episode alternates generation with tool calls that take wall time. One
coroutine per episode (reset -> append -> generate -> env.step -> append -> ...) over the engine's
asyncio face (`megatron_rollout.aio.AsyncEngine`, whose pump is the only caller of `engine.step()`)
lets the engine keep decoding the other episodes while some wait on tools, which is the workload
the engine's P/D multiplexing targets.

Left out: retries of failed tool calls, per-episode deadlines, streaming partial outputs, and
rollouts spread over threads (the engine is driven from one thread, as in the trainer's process).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_rollout.aio import AsyncEngine, AsyncSession
from megatron_rollout.engine import RequestError
from megatron_rollout.engine.api import FinishReason, GenerationResult, SamplingParams
from rl.envs.base import Env, Observation
from rl.fields import check_types
from rl.trajectory import NOT_GENERATED, Trajectory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutConfig:
    sampling: SamplingParams
    """Sampling of every turn (its `seed` is replaced per request when the episode has one)."""
    max_turns: int = 1
    """Generation turns per episode; an episode not done by then is marked truncated."""
    turn_max_new_tokens: tuple[int, ...] = ()
    """Per-turn generation budgets (turn t gets entry min(t, len - 1)), e.g. a short tool call then
    a longer answer; empty: every turn gets `sampling.max_new_tokens`."""
    idle_sleep_s: float = 0.0005
    """How long the pump sleeps when the engine has no work (every episode is in a tool call)."""
    share_prompt: bool = True
    """Sample a group's turn 0 as one request with n = group size (its prompt prefilled once), where
    its episodes share their first observation; False: every episode submits its own."""

    def __post_init__(self) -> None:
        check_types(self)
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if any(n < 1 for n in self.turn_max_new_tokens):
            raise ValueError(f"turn_max_new_tokens must be >= 1 each, got {list(self.turn_max_new_tokens)}")
        if self.idle_sleep_s < 0:
            raise ValueError(f"idle_sleep_s must be >= 0, got {self.idle_sleep_s}")


@dataclass(frozen=True)
class Episode:
    env: Env
    """A fresh environment instance (one per episode)."""
    seed: int
    """Passed to `env.reset`; episodes of one GRPO group share it."""
    group_id: int
    sample_seed: int | None = None
    """Base of the per-request sampling seeds (turn t uses sample_seed * 1000 + t; a shared turn 0
    uses the group's first episode's, see `RolloutConfig.share_prompt`); None leaves sampling to the
    engine's own generator."""


@dataclass(frozen=True)
class RolloutStats:
    makespan_s: float
    """Wall time from the first reset to the last episode's end."""
    generated_tokens: int
    prefill_tokens: int
    """Tokens the engine prefilled (prompts and observations; continuation turns count new tokens only)."""
    tokens_per_s: float
    """Generated tokens per second of makespan."""
    engine_steps: int
    num_trajectories: int
    num_turns: int
    truncated: int
    engine_errors: int
    """Episodes the engine ended (a refused submission, e.g. the KV pool is too small; an ERROR/ABORT finish)."""


@dataclass(frozen=True)
class RolloutResult:
    trajectories: list[Trajectory]
    """In the order of the episodes given."""
    stats: RolloutStats


def _turn_params(cfg: RolloutConfig, ep: Episode, turn: int) -> SamplingParams:
    params = cfg.sampling
    if cfg.turn_max_new_tokens:
        budget = cfg.turn_max_new_tokens[min(turn, len(cfg.turn_max_new_tokens) - 1)]
        params = dataclasses.replace(params, max_new_tokens=budget)
    if ep.sample_seed is not None:
        params = dataclasses.replace(params, seed=ep.sample_seed * 1000 + turn)
    return params


async def _run_group(aengine: AsyncEngine, eps: list[Episode], cfg: RolloutConfig) -> list[Trajectory]:
    """A GRPO group's episodes. Where they share their first observation (one reset seed), turn 0 is
    one request with n = len(eps): the prompt is prefilled once and sample i (seed
    `sample_seed(first episode's turn-0 seed, i)`) opens episode i, which goes on in a session of its
    own (`AsyncSession.forks`)."""
    resets = await asyncio.gather(*(ep.env.reset(ep.seed) for ep in eps))
    prompt = list(resets[0].token_ids)

    async def alone() -> list[Trajectory]:
        return list(await asyncio.gather(*(_run_episode(aengine, ep, cfg, o) for ep, o in zip(eps, resets))))

    if not cfg.share_prompt or len(eps) == 1 or any(list(o.token_ids) != prompt for o in resets):
        return await alone()
    session = aengine.open_session()
    session.append(prompt)
    try:
        first = await session.generate(dataclasses.replace(_turn_params(cfg, eps[0], 0), n=len(eps)))
    except RequestError as exc:  # e.g. n samples' KV at once does not fit: one request per episode
        log.info("group %d: one request per episode (%s)", eps[0].group_id, exc)
        session.close()
        return await alone()
    sessions: list[AsyncSession | None] = [session, *session.forks()]
    sessions += [None] * (len(eps) - len(sessions))  # none forked: the request ended before its draw
    return list(await asyncio.gather(*(_run_episode(aengine, ep, cfg, o, s, r)
                                       for ep, o, s, r in zip(eps, resets, sessions, first.results))))


async def _run_episode(aengine: AsyncEngine, ep: Episode, cfg: RolloutConfig, obs: Observation,
                       session: AsyncSession | None = None, opening: GenerationResult | None = None) -> Trajectory:
    """One episode from its first observation; `session` holds it already with `opening`, its
    turn 0 (drawn with its group's), where given."""
    n = len(obs.token_ids)
    tokens, mask, logprobs, versions = list(obs.token_ids), [0] * n, [0.0] * n, [NOT_GENERATED] * n
    reward, turns, done, failed, error = 0.0, 0, False, False, None
    if session is None:
        session = aengine.open_session()
        session.append(list(obs.token_ids))
    try:
        while not done and turns < cfg.max_turns:
            try:
                res = opening if opening is not None and turns == 0 else \
                    (await session.generate(_turn_params(cfg, ep, turns))).result
            except RequestError as exc:  # e.g. the context no longer fits: end this episode only
                log.warning("episode seed=%d group=%d ends at turn %d: %s", ep.seed, ep.group_id, turns, exc)
                error = f"refused at turn {turns}: {exc}"
                break
            if len(res.logprobs) != len(res.token_ids) or len(res.weight_versions) != len(res.token_ids):
                raise RuntimeError(f"episode seed={ep.seed} group={ep.group_id}: {len(res.token_ids)} tokens but "
                                   f"{len(res.logprobs)} logprobs and {len(res.weight_versions)} versions")
            turns += 1
            tokens += res.token_ids
            mask += [1] * len(res.token_ids)
            logprobs += res.logprobs
            versions += res.weight_versions
            if res.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                log.warning("episode seed=%d group=%d ends at turn %d: request %s (%s)", ep.seed, ep.group_id,
                            turns, res.finish_reason.value, res.error)
                failed, error = True, f"{res.finish_reason.value} at turn {turns}: {res.error}"
                break
            step = await ep.env.step(res.token_ids)
            reward += step.reward
            done = step.done
            if not done and turns < cfg.max_turns and step.observation_ids:
                session.append(list(step.observation_ids))
                tokens += step.observation_ids
                mask += [0] * len(step.observation_ids)
                logprobs += [0.0] * len(step.observation_ids)
                versions += [NOT_GENERATED] * len(step.observation_ids)
        if not failed and list(session.token_ids) != tokens:
            raise RuntimeError(f"session context ({len(session.token_ids)} tokens) disagrees with the trajectory "
                               f"({len(tokens)} tokens) for episode seed={ep.seed} group={ep.group_id}")
    finally:
        session.close()
    return Trajectory(tuple(tokens), tuple(mask), tuple(logprobs), tuple(versions), reward, ep.group_id,
                      num_turns=turns, truncated=not done, error=error)


def _groups(episodes: Sequence[Episode]) -> list[list[int]]:
    """Indices of the episodes of each group (one group id and reset seed), in first-seen order."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, ep in enumerate(episodes):
        groups.setdefault((ep.group_id, ep.seed), []).append(i)
    return list(groups.values())


async def rollout_async(engine: Any, episodes: Sequence[Episode], cfg: RolloutConfig) -> RolloutResult:
    """Run every episode to its end; the engine must be idle (no foreign requests) on entry."""
    start = time.perf_counter()
    async with AsyncEngine(engine, cfg.idle_sleep_s) as aengine:
        try:
            groups = _groups(episodes)
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(_run_group(aengine, [episodes[i] for i in g], cfg)) for g in groups]
        except BaseExceptionGroup as eg:
            raise eg.exceptions[0] from eg
    makespan = time.perf_counter() - start
    by_index = {i: t for g, task in zip(groups, tasks) for i, t in zip(g, task.result())}
    trajectories = [by_index[i] for i in range(len(episodes))]
    generated = sum(t.num_generated for t in trajectories)
    stats = RolloutStats(makespan_s=makespan, generated_tokens=generated, prefill_tokens=aengine.prefill_tokens,
                         tokens_per_s=generated / makespan if makespan > 0 else 0.0, engine_steps=aengine.steps,
                         num_trajectories=len(trajectories), num_turns=sum(t.num_turns for t in trajectories),
                         truncated=sum(t.truncated for t in trajectories),
                         engine_errors=sum(t.error is not None for t in trajectories))
    return RolloutResult(trajectories, stats)


def rollout(engine: Any, episodes: Sequence[Episode], cfg: RolloutConfig) -> RolloutResult:
    """Synchronous wrapper: runs `rollout_async` in a fresh event loop."""
    return asyncio.run(rollout_async(engine, episodes, cfg))
