import asyncio
import time

import pytest

from megatron_rollout.tokenizer import ByteTokenizer
from rl.envs import GuessDigitEnv, Rubric, SingleTurnEnv, digit_fraction, target_byte_fraction
from rl.envs.single_turn import TASKS

TOK = ByteTokenizer()


def ids(s: str) -> list[int]:
    return TOK.encode(s)


def test_digit_fraction_counts_bytes_not_specials():
    got = digit_fraction(["p"] * 3, ["12ab", "", "7"], [ids("12ab"), [TOK.eos_id], ids("7") + [TOK.eos_id]])
    assert got == [0.5, 0.0, 1.0]


def test_target_byte_fraction():
    got = target_byte_fraction(["p", "p"], ["aab", "xyz"], [ids("aab"), ids("xyz")], target=["a", "z"])
    assert got == pytest.approx([2 / 3, 1 / 3])
    assert target_byte_fraction(["p"], ["a"], [ids("a")]) == [None]


def test_rubric_weights_and_none():
    def half(prompts, completions, completion_ids, **kw):
        return [0.5] * len(prompts)

    rubric = Rubric([digit_fraction, target_byte_fraction, half], [0.5, 0.3, 0.2])
    # target present: 0.5 * 1.0 + 0.3 * 0.0 + 0.2 * 0.5; absent: the None term is left out
    assert rubric(["p"], ["11"], [ids("11")], target=["a"]) == pytest.approx([0.6])
    assert rubric(["p"], ["11"], [ids("11")]) == pytest.approx([0.6])
    assert rubric(["p"], ["aa"], [ids("aa")], target=["a"]) == pytest.approx([0.4])
    each = rubric.score_each(["p"], ["1a"], [ids("1a")], target=["a"])
    assert each == {"digit_fraction": [0.5], "target_byte_fraction": [0.5], "half": [0.5]}
    with pytest.raises(ValueError, match="weights"):
        Rubric([digit_fraction], [1.0, 2.0])


def test_single_turn_env_prompt_and_reward():
    task, rubric = TASKS["target_byte"]
    env = SingleTurnEnv(task, rubric, TOK)
    obs = asyncio.run(env.reset(5))
    letter = task(5).kwargs["target"]
    assert obs.token_ids == (TOK.bos_id, *ids(f"Repeat {letter}: "))
    res = asyncio.run(env.step(ids(letter * 3 + "-")))
    assert res.done and res.reward == pytest.approx(0.75) and res.observation_ids == ()


def test_guess_env_dialogue_and_reward():
    async def play(guesses):
        env = GuessDigitEnv(TOK, latency_s=0.0, max_turns=4)
        await env.reset(3)
        out = []
        for g in guesses:
            out.append(await env.step(ids(g)))
        return env.secret, out

    secret, _ = asyncio.run(play([]))
    low, high = str((secret - 1) % 10), str((secret + 1) % 10)
    _, steps = asyncio.run(play(["x", f"a{low}" if secret > 0 else high, str(secret)]))
    assert TOK.decode(list(steps[0].observation_ids)) == "\nno digit\n"
    assert TOK.decode(list(steps[1].observation_ids)) == ("\nhigher\n" if secret > 0 else "\nlower\n")
    assert [s.done for s in steps] == [False, False, True]
    assert steps[2].reward == pytest.approx(1 - 2 / 4)
    _, steps = asyncio.run(play(["x"] * 4))
    assert steps[-1].done and steps[-1].reward == 0.0


def test_guess_env_latency_overlaps_across_episodes():
    async def many():
        envs = [GuessDigitEnv(TOK, latency_s=0.1) for _ in range(20)]
        for i, e in enumerate(envs):
            await e.reset(i)
        t = time.perf_counter()
        await asyncio.gather(*(e.step(ids("x")) for e in envs))
        return time.perf_counter() - t

    elapsed = asyncio.run(many())
    assert 0.1 <= elapsed < 1.0  # 20 sequential tool calls would take 2 s
