import asyncio
import time

import pytest

from megatron_rollout.tokenizer import ByteTokenizer
from rl.envs import GuessDigitEnv, Rubric, SingleTurnEnv, digit_fraction, target_byte_fraction
from rl.envs.lookup import LookupEnv, code_match
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
        envs = [GuessDigitEnv(TOK, latency_s=0.5) for _ in range(20)]
        for i, e in enumerate(envs):
            await e.reset(i)
        t = time.perf_counter()
        await asyncio.gather(*(e.step(ids("x")) for e in envs))
        return time.perf_counter() - t

    elapsed = asyncio.run(many())
    assert 0.5 <= elapsed < 5.0  # 20 sequential tool calls would take 10 s; a loaded machine adds far less than 4.5


def test_lookup_env_call_reply_and_reward():
    async def play(call, answer, seed=11):
        env = LookupEnv(TOK, latency_s=0.0)
        await env.reset(seed)
        return env.code, await env.step(call), await env.step(answer)

    code, reply, final = asyncio.run(play(ids("hi"), ids("")))
    assert len(code) == 1 and code.isdigit()
    assert TOK.decode(list(reply.observation_ids)) == f"\ncode {code}" and not reply.done and reply.reward == 0
    assert final.done and final.reward == 0.0  # empty answer
    wrong, cousin = str((int(code) + 1) % 10), chr(ord(code) + 10)  # "7" -> "A": same residue class
    _, _, final = asyncio.run(play(ids("x"), ids(code * 2 + cousin + wrong) + [TOK.eos_id]))
    assert final.reward == pytest.approx((1 + 1 + 0.5 + 0) / 4)  # specials are not graded
    _, reply, _ = asyncio.run(play([TOK.eos_id], ids(code)))  # an empty call gets no code
    assert TOK.decode(list(reply.observation_ids)) == "\nno call"
    assert code_match(ids("4848"), "48") == 1.0 and code_match(ids("8484"), "48") == 0.0
    assert code_match(ids(">B"), "48") == 0.5  # ">" = "4" + 10, "B" = "8" + 10: the residue classes


def test_lookup_env_cannot_be_gamed_without_the_reply():
    """A policy that ignores the tool's reply scores at most ~0.1 (one digit always), a uniform one ~0.05;
    copying scores 1."""
    async def codes(n):
        out = []
        for seed in range(n):
            env = LookupEnv(TOK, latency_s=0.0)
            await env.reset(seed)
            out.append(env.code)
        return out

    all_codes = asyncio.run(codes(2000))
    best_blind = max(sum(code_match(ids(d * 8), c) for c in all_codes) / len(all_codes) for d in "0123456789")
    assert 0.08 < best_blind < 0.12
    assert sum(code_match(ids(c * 8), c) for c in all_codes) / len(all_codes) == 1.0
    assert len(set(all_codes)) == 10
    uniform = sum(code_match([b], c) for b in range(256) for c in all_codes[:200]) / (256 * 200)
    assert 0.045 < uniform < 0.06


def test_lookup_env_waits_for_the_tool():
    async def one():
        env = LookupEnv(TOK, latency_s=0.05)
        await env.reset(0)
        t = time.perf_counter()
        await env.step(ids("q"))
        return time.perf_counter() - t

    assert asyncio.run(one()) >= 0.05
