"""The asyncio face of the engine: concurrent requests and sessions, pause/drain/resume around a
weight update, cancellation."""
import asyncio
import dataclasses

import pytest
import torch

from megatron_rollout.aio import AsyncEngine
from megatron_rollout.engine import EngineConfig, KVConfig, RolloutEngine, SamplingParams, SchedulerConfig
from megatron_rollout.model.config import preset
from megatron_rollout.model.transformer import MoETransformer

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)
PROMPTS = [[1, 5, 9, 33], [7, 7, 2], [40, 41, 42, 43, 44, 45], [3]]


@pytest.fixture(scope="module")
def model():
    return MoETransformer(preset("tiny-moe")).init_weights(0)


def engine_of(model) -> RolloutEngine:
    return RolloutEngine(model, EngineConfig(scheduler=SchedulerConfig(block_size=16), kv=KVConfig(num_blocks=64)))


def test_concurrent_requests_and_sessions_match_the_sync_engine(model):
    want = [o.token_ids for o in engine_of(model).generate(PROMPTS, GREEDY)]

    async def main():
        async with AsyncEngine(engine_of(model)) as aengine:
            got = await aengine.generate_many(PROMPTS, GREEDY)
            session = aengine.open_session()
            session.append(PROMPTS[0])
            first = await session.generate(GREEDY)
            session.append([11, 12])
            second = await session.generate(GREEDY)
            context = session.token_ids
            session.close()
            return got, first.result, second.result, context, aengine.steps

    got, first, second, context, steps = asyncio.run(main())
    assert [g.token_ids for g in got] == want
    assert first.token_ids == want[0]
    assert context == PROMPTS[0] + list(first.token_ids) + [11, 12] + list(second.token_ids)
    assert steps > 0


def test_pause_holds_every_step_and_a_weight_update_lands_between(model):
    engine = engine_of(model)
    new = {k: v + 0.01 for k, v in model.state_dict().items()}

    async def main():
        async with AsyncEngine(engine) as aengine:
            task = asyncio.create_task(aengine.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_new_tokens=40)))
            while aengine.steps < 3:
                await asyncio.sleep(0)
            await aengine.pause()
            held = aengine.steps
            await asyncio.sleep(0.05)  # the pump would have stepped many times by now
            assert aengine.steps == held and aengine.is_paused and not task.done()
            engine.update_weights(new.items(), 1)
            aengine.resume()
            return (await task).result, held

    out, held = asyncio.run(main())
    versions = out.weight_versions
    assert 0 in versions and versions[-1] == 1  # tokens before the pause on version 0, after it on 1
    assert versions == sorted(versions) and len(versions) == 40


def test_drain_finishes_what_was_submitted_and_holds_new_requests(model):
    async def main():
        async with AsyncEngine(engine_of(model)) as aengine:
            early = [asyncio.create_task(aengine.generate(p, GREEDY)) for p in PROMPTS]
            await asyncio.sleep(0)  # they are submitted
            await aengine.pause(drain=True)
            assert all(t.done() for t in early)
            late = asyncio.create_task(aengine.generate(PROMPTS[0], GREEDY))
            await asyncio.sleep(0.05)
            assert not late.done() and not aengine.engine.has_work()  # held before the engine
            aengine.resume()
            return await late, [t.result() for t in early]

    late, early = asyncio.run(main())
    assert late.result.token_ids == early[0].result.token_ids


def test_sleep_drains_then_holds_new_requests_until_everything_is_awake(model):
    engine = engine_of(model)
    want = [o.token_ids for o in engine_of(model).generate(PROMPTS, GREEDY)]

    async def main():
        async with AsyncEngine(engine) as aengine:
            early = [asyncio.create_task(aengine.generate(p, GREEDY)) for p in PROMPTS]
            await asyncio.sleep(0)  # they are submitted
            report = await aengine.sleep()
            assert all(t.done() for t in early) and report["asleep"] == ["graphs", "kv", "weights"]
            late = asyncio.create_task(aengine.generate(PROMPTS[0], GREEDY))
            await aengine.wake_up(tags=["weights"])
            await asyncio.sleep(0.05)
            assert not late.done() and not engine.has_work() and engine.asleep == {"kv", "graphs"}
            await aengine.wake_up()
            return await late, [t.result() for t in early]

    late, early = asyncio.run(main())
    assert [o.result.token_ids for o in early] == want and late.result.token_ids == want[0]


def test_a_cancelled_await_aborts_its_request(model):
    engine = engine_of(model)

    async def main():
        async with AsyncEngine(engine) as aengine:
            task = asyncio.create_task(aengine.generate(PROMPTS[1], SamplingParams(max_new_tokens=500)))
            while aengine.steps < 2:
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(20):
                await asyncio.sleep(0.001)
            return engine.has_work()

    assert asyncio.run(main()) is False


def test_requests_need_a_running_engine(model):
    async def main():
        await AsyncEngine(engine_of(model)).generate(PROMPTS[0], GREEDY)

    with pytest.raises(RuntimeError, match="not running"):
        asyncio.run(main())
    torch.manual_seed(0)


SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=5, seed=11)


def test_n_samples_and_forked_sessions_equal_separate_sessions(model):
    from megatron_rollout.engine.api import sample_seed

    prompt, reply, n = PROMPTS[2] * 3, [21, 22, 23], 4
    turn1 = SamplingParams(temperature=1.0, max_new_tokens=4, seed=99)
    want = []
    for i in range(n):  # n sessions, each with the derived seed of its sample
        session = engine_of(model).open_session()
        session.append(prompt)
        session.generate(SamplingParams(temperature=1.0, max_new_tokens=5, seed=sample_seed(11, i)))
        session.append(reply)
        session.generate(turn1)
        want.append(session.token_ids)

    async def main():
        engine = engine_of(model)
        async with AsyncEngine(engine) as aengine:
            many = await aengine.generate_many([prompt], dataclasses.replace(SAMPLED, n=n))
            prefilled = engine.stats.prefill_tokens
            session = aengine.open_session()
            session.append(prompt)
            first = await session.generate(dataclasses.replace(SAMPLED, n=n))
            sessions = [session, *session.forks()]
            for s in sessions:
                s.append(reply)
            await asyncio.gather(*(s.generate(turn1) for s in sessions))
            contexts = [s.token_ids for s in sessions]
            for s in sessions:
                s.close()
            return many, first, prefilled, contexts, engine

    many, first, prefilled, contexts, engine = asyncio.run(main())
    assert prefilled == len(prompt)  # n samples: the prompt once
    assert [r.token_ids for r in first.results] == [r.token_ids for r in many]
    assert contexts == want
    assert len({tuple(c) for c in contexts}) > 1
    engine.check_integrity()
    assert engine.pool.num_free == engine.pool.num_blocks


def test_a_cancelled_group_aborts_every_sample(model):
    engine = engine_of(model)

    async def main():
        async with AsyncEngine(engine) as aengine:
            task = asyncio.create_task(aengine.generate(PROMPTS[0], SamplingParams(max_new_tokens=40, n=3)))
            while len(engine.requests) < 3:
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            while engine.has_work():
                await asyncio.sleep(0.001)

    asyncio.run(main())
    engine.check_integrity()
    assert engine.pool.num_free == engine.pool.num_blocks
