"""The engine under asyncio: many coroutines await their requests while one task steps the engine.

An agentic rollout is one coroutine per episode (submit, await the tokens, call a tool, append
its reply, submit again). `AsyncEngine` owns the only caller of `engine.step()`: a pump task that
steps while there is work and resolves one future per request from the outputs each step returns,
yielding to the event loop between steps so tool coroutines progress, and sleeping briefly when
the engine is idle (every episode is in a tool call).

Pause and drain, for a weight update between rollouts or in the middle of one:
`await aengine.pause()` returns once the step in flight has ended and no further step will start;
requests stay where they are (their KV kept) and resume with the next step after `resume()`, their
later tokens tagged with the new weight version. `await aengine.pause(drain=True)` first lets every
request already submitted finish, holding back the ones submitted meanwhile (they start on
`resume()`). `async with aengine.paused(): engine.update_weights(...)` does both ends.

Memory handed back between rollouts: `await aengine.sleep(tags)` drains as `pause(drain=True)` does,
then sleeps the engine (`RolloutEngine.sleep`); requests submitted while it sleeps wait, and start
once `aengine.wake_up(tags)` has left every tag awake.

Left out: requests spread over threads (the engine is driven from the event loop's thread, as in a
trainer's process), streaming partial outputs, and per-request deadlines.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from megatron_rollout.engine.api import GenerationResult, RequestOutput, SamplingParams

log = logging.getLogger(__name__)


class AsyncSession:
    """A multi-turn context whose turns are awaited: `append` tokens, `await generate(params)`."""

    def __init__(self, owner: "AsyncEngine", session: Any = None) -> None:
        self._owner = owner
        self._session = session if session is not None else owner.engine.open_session()

    @property
    def token_ids(self) -> list[int]:
        return self._session.token_ids

    def append(self, token_ids: Sequence[int]) -> None:
        self._session.append(list(token_ids))

    async def generate(self, params: SamplingParams | None = None) -> RequestOutput:
        """The next turn, generated after everything appended so far (appended to the context too).
        With `params.n` > 1 the prompt is prefilled once for n samples (`RequestOutput.results`); this
        session continues sample 0, and `forks()` gives the sessions that continue the others."""
        await self._owner._admission()
        return await self._owner._await(self._session.submit(params))

    def forks(self) -> list["AsyncSession"]:
        """The sessions of samples 1..n-1 of this session's turns with n > 1, in sample order (see
        `engine.Session.forks`); close them too."""
        return [AsyncSession(self._owner, fork) for fork in self._session.forks()]

    def close(self) -> None:
        self._session.close()


class AsyncEngine:
    """`engine`: a `RolloutEngine`, or anything with its `step`, `has_work`, `open_session`, `add_request`
    and `abort` (e.g. a sharded rank's lockstep view). Use as `async with AsyncEngine(engine) as aengine:`."""

    def __init__(self, engine: Any, idle_sleep_s: float = 0.0005) -> None:
        if idle_sleep_s < 0:
            raise ValueError(f"idle_sleep_s must be >= 0, got {idle_sleep_s}")
        self.engine, self.idle_sleep_s = engine, idle_sleep_s
        self.steps = 0
        """Engine steps the pump has run."""
        self.prefill_tokens = 0
        """Prompt tokens the engine computed for the finished requests (continuations count new ones)."""
        self._futures: dict[int, asyncio.Future[RequestOutput]] = {}
        self._task: asyncio.Task | None = None
        self._failed: BaseException | None = None
        self._stopping = False
        self._running = asyncio.Event()  # set while steps may run
        self._running.set()
        self._idle = asyncio.Event()  # set while no step is in flight
        self._idle.set()
        self._open = asyncio.Event()  # set while new requests may be submitted
        self._open.set()

    async def __aenter__(self) -> "AsyncEngine":
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._pump(), name="megatron_rollout.pump")

    async def stop(self) -> None:
        """Stop the pump after its step in flight; requests still awaited fail (abort them first to end them)."""
        self._stopping = True
        self._running.set()
        if self._task is not None:
            await self._task
            self._task = None
        self._fail_all(RuntimeError("the AsyncEngine was stopped before this request finished"))

    # -- requests ----------------------------------------------------------------------------------
    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> RequestOutput:
        """One prompt's generation; its `RequestOutput` (tokens, logprobs, versions, finish reason)."""
        await self._admission()
        return await self._await(self.engine.add_request(list(prompt_ids), params))

    async def generate_many(self, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None
                            ) -> list[GenerationResult]:
        """Every prompt's results, in order (with `params.n` > 1: n per prompt, one after the other)."""
        outs = await asyncio.gather(*(self.generate(p, params) for p in prompts))
        return [r for o in outs for r in o.results]

    def open_session(self) -> AsyncSession:
        return AsyncSession(self)

    # -- pause, drain, resume ----------------------------------------------------------------------
    async def pause(self, drain: bool = False) -> None:
        """Return once no step is in flight and none will start until `resume()`. `drain`: first let
        every request submitted so far finish; requests submitted from now on wait for `resume()`."""
        self._open.clear()
        if drain:
            while self._futures and not self._stopping:
                await asyncio.wait(list(self._futures.values()))
        self._running.clear()
        await self._idle.wait()

    def resume(self) -> None:
        self._running.set()
        self._open.set()

    @property
    def is_paused(self) -> bool:
        return not self._running.is_set()

    @contextlib.asynccontextmanager
    async def paused(self, drain: bool = False) -> AsyncIterator[None]:
        """`async with aengine.paused(): engine.update_weights(...)`: no forward overlaps the body."""
        await self.pause(drain)
        try:
            yield
        finally:
            self.resume()

    # -- memory handed back between rollouts -------------------------------------------------------
    async def sleep(self, tags: str | Sequence[str] | None = None) -> dict:
        """Drain (every request submitted so far finishes, later ones wait), then `engine.sleep(tags)`;
        its report. The pump stays paused until `wake_up` leaves every tag awake."""
        await self.pause(drain=True)
        try:
            return self.engine.sleep(tags)
        except BaseException:
            if not self.engine.asleep:  # nothing sleeps: do not leave the requests held back
                self.resume()
            raise

    async def wake_up(self, tags: str | Sequence[str] | None = None) -> dict:
        """`engine.wake_up(tags)`; once nothing sleeps, steps and submissions resume. Its report."""
        report = self.engine.wake_up(tags)
        if not self.engine.asleep:
            self.resume()
        return report

    # -- internals ---------------------------------------------------------------------------------
    async def _admission(self) -> None:
        if self._failed is not None:
            raise RuntimeError(f"engine step failed: {self._failed!r}") from self._failed
        await self._open.wait()
        if self._task is None:
            raise RuntimeError("the AsyncEngine is not running: use `async with AsyncEngine(engine)` or start()")

    async def _await(self, rid: int) -> RequestOutput:
        fut = self._futures.get(rid)
        if fut is None:
            fut = self._futures[rid] = asyncio.get_running_loop().create_future()
        try:
            return await fut
        except asyncio.CancelledError:  # the awaiting coroutine was cancelled: end its request too
            if fut.cancelled() or not fut.done():  # (cancelling the task cancels the future it awaits)
                self.engine.abort(rid)
            raise
        finally:
            self._futures.pop(rid, None)

    def _fail_all(self, exc: BaseException) -> None:
        for fut in self._futures.values():
            if not fut.done():
                fut.set_exception(exc)

    async def _pump(self) -> None:
        try:
            while not self._stopping:
                await self._running.wait()
                if self._stopping:
                    break
                if not self._running.is_set():  # paused between the wake-up and now
                    continue
                if not self.engine.has_work():
                    await asyncio.sleep(self.idle_sleep_s)
                    continue
                self._idle.clear()
                try:
                    outs = self.engine.step()
                finally:
                    self._idle.set()
                self.steps += 1
                for out in outs:
                    self.prefill_tokens += out.prompt_tokens
                    fut = self._futures.get(out.request_id)
                    if fut is not None and not fut.done():  # None: submitted to the engine directly
                        fut.set_result(out)
                await asyncio.sleep(0)
        except BaseException as exc:
            self._failed = exc
            self._fail_all(RuntimeError(f"engine step failed: {exc!r}"))
            log.error("engine step failed: %r", exc)
            raise
