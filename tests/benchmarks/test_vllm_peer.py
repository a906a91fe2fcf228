"""The vLLM peer's own logic on CPU, without vLLM: a small fake async engine stands in for
`AsyncLLM`. These tests check OUR closed-loop driver only (turn ordering, tool waits, history
growth, failure handling, the report's figures) and the config.json it writes; that vLLM itself
runs is checked on the GPU machine by `benchmarks.vllm_check`. Also: the peer's token ids are the ids
our replay appends (one function, `trace.make.input_ids`)."""
from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass

import pytest

from benchmarks.vllm_peer import closed_loop, hf_config, median_report, report
from megatron_rollout.model.config import PRESETS
from megatron_rollout.trace.make import conversation_inputs, input_ids, make_trace
from megatron_rollout.trace.schema import TraceRequest


@dataclass
class _Delta:
    token_ids: list[int]


@dataclass
class _Out:
    outputs: list[_Delta]
    finished: bool


class FakeAsyncLLM:
    """Generates `n` tokens in two deltas after a short sleep; token i of a request is
    1000 + len(prompt) + i, so the test can tell which prompt produced which ids."""

    def __init__(self, fail: set[str] = frozenset(), step_s: float = 0.002) -> None:
        self.calls: list[tuple[str, list[int], float]] = []
        self.fail, self.step_s = fail, step_s

    async def generate(self, prompt, sampling_params, request_id):
        self.calls.append((request_id, list(prompt), time.perf_counter()))
        if request_id in self.fail:
            raise RuntimeError("refused")
        n = sampling_params
        tokens = [1000 + len(prompt) + i for i in range(n)]
        half = max(1, n // 2)
        await asyncio.sleep(self.step_s)
        yield _Out([_Delta(tokens[:half])], finished=half >= n)
        if half < n:
            await asyncio.sleep(self.step_s)
            yield _Out([_Delta(tokens[half:])], finished=True)


TRACE = [TraceRequest("a", 0, 3, 2, 0.0), TraceRequest("a", 1, 2, 3, 30.0), TraceRequest("a", 2, 1, 1, 10.0),
         TraceRequest("b", 0, 4, 1, 0.0), TraceRequest("b", 1, 2, 2, 0.0)]


def _run(engine, trace=TRACE):
    inputs = conversation_inputs(trace, seed=5, vocab_size=100)
    start, records = asyncio.run(closed_loop(engine, trace, inputs, make_prompt=lambda ids: ids,
                                             make_params=lambda n, *_: n, tag="t"))
    return inputs, start, records


def test_history_grows_by_new_ids_and_generated_ids():
    engine = FakeAsyncLLM()
    inputs, _, records = _run(engine)
    prompts = {rid: prompt for rid, prompt, _ in engine.calls}
    for key, turns in (("a", 3), ("b", 2)):
        history: list[int] = []
        for k in range(turns):
            history += inputs[key][k]
            assert prompts[f"t-{key}-{k}"] == history
            n = next(t.output_tokens for t in TRACE if t.conversation == key and t.turn == k)
            history += [1000 + len(history) - 0 + i for i in range(n)]  # what the fake generated
    assert sorted((r.conversation, r.turn) for r in records) == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)]
    assert [r.output_tokens for r in records if r.conversation == "a"] == [2, 3, 1]


def test_turns_are_sent_after_the_previous_finished_plus_the_wait():
    engine = FakeAsyncLLM()
    _, start, records = _run(engine)
    by = {(r.conversation, r.turn): r for r in records}
    sent = {rid: t for rid, _, t in engine.calls}
    assert sent["t-a-0"] - start < 0.05 and sent["t-b-0"] - start < 0.05  # both start at once
    assert sent["t-a-1"] >= by[("a", 0)].finish + 0.030
    assert sent["t-a-2"] >= by[("a", 1)].finish + 0.010
    assert sent["t-b-1"] >= by[("b", 0)].finish
    for r in records:
        assert r.first_token is not None and r.arrival <= r.first_token <= r.finish


def test_a_failed_turn_ends_its_conversation_and_the_report_counts_it():
    engine = FakeAsyncLLM(fail={"t-a-1"})
    _, start, records = _run(engine)
    assert [rid for rid, _, _ in engine.calls if rid.startswith("t-a")] == ["t-a-0", "t-a-1"]
    rep = report(start, records, total_requests=len(TRACE))
    assert (rep["requests"], rep["failed"], rep["skipped"]) == (3, 1, 1)
    assert rep["output_tokens"] == 2 + 1 + 2
    assert rep["mean_decode_wait_ms"] is None
    assert rep["makespan_s"] == pytest.approx(max(r.finish for r in records) - start)
    assert rep["tokens_per_s"] == pytest.approx(5 / rep["makespan_s"])


def test_median_report_takes_each_figure_s_median():
    reps = [{"makespan_s": 3.0, "mean_decode_wait_ms": None, "schedule": "vllm"},
            {"makespan_s": 1.0, "mean_decode_wait_ms": None, "schedule": "vllm"},
            {"makespan_s": 2.0, "mean_decode_wait_ms": None, "schedule": "vllm"}]
    assert median_report(reps) == {"makespan_s": 2.0, "mean_decode_wait_ms": None, "schedule": "vllm"}


def test_hf_config_has_the_preset_shape():
    cfg = PRESETS["qwen3-30b-a3b-12l"]
    c = hf_config(cfg, 65_536)
    assert c["architectures"] == ["Qwen3MoeForCausalLM"] and c["num_hidden_layers"] == 12
    assert (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (2048, 32, 4, 128)
    assert (c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]) == (128, 8, 768)
    assert c["norm_topk_prob"] is True and c["vocab_size"] == 151_936
    assert c["max_position_embeddings"] == 65_536
    with pytest.raises(ValueError, match="every layer MoE"):
        hf_config(PRESETS["tiny-moe"], 4096)


def test_the_peer_reads_our_weights_as_the_function_our_model_computes(tmp_path):
    """`save_weights` under the peer's own config.json is our model for a Hugging Face reader: the
    logits transformers computes from that directory are ours (fp32, a Qwen3-MoE shape in small)."""
    import torch
    import transformers

    from benchmarks.vllm_peer import save_weights, write_model_dir
    from megatron_rollout.model.checkpoint import config_from_hf
    from megatron_rollout.model.transformer import MoETransformer

    cfg = config_from_hf(transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=2,
        moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6,
        max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 50000.0}))
    model = MoETransformer(cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # larger than the 0.02 init, so routing and logits are far from flat
        for p in model.parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen) if p.dim() == 1 else
                    0.3 * torch.randn(p.shape, generator=gen))
    weights = save_weights(model, cfg, tmp_path / "w" / "peer-weights.safetensors")
    model_dir = write_model_dir(tmp_path / "m", cfg, 512, weights)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    ids = torch.randint(0, 96, (1, 11), generator=gen)
    with torch.no_grad():
        ours, ref = model(ids), theirs(ids).logits
    assert ref.abs().max() > 1.0
    assert (ours - ref).abs().max().item() < 1e-4
    write_model_dir(tmp_path / "m", cfg, 512)  # the dummy init again: no weights file left behind
    assert not (tmp_path / "m" / "model.safetensors").exists()
    with pytest.raises(SystemExit, match="no such file"):
        write_model_dir(tmp_path / "m", cfg, 512, tmp_path / "absent.safetensors")


def _small_qwen3():
    import transformers

    from megatron_rollout.model.checkpoint import config_from_hf

    return config_from_hf(transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=2,
        moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6,
        max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 50000.0}))


def test_drawn_weights_are_the_file_s_weights_loaded_in_place(tmp_path):
    """`draw_into`, as vLLM's worker runs it, hands `reload_weights` the tensors the safetensors file
    of `--vllm-weights ours` holds for the same seed, name for name and value for value."""
    import torch
    from safetensors.torch import load_file

    from benchmarks.rollout import random_model
    from benchmarks.vllm_peer import draw_into, drawn_weights, save_weights

    cfg, cpu = _small_qwen3(), torch.device("cpu")
    written = load_file(save_weights(random_model(cfg, cpu, seed=3, std=0.05), cfg, tmp_path / "w.safetensors"))
    loaded: dict = {}

    class Runner:
        def reload_weights(self, weights_iterator):
            for name, t in weights_iterator:
                assert name not in loaded, name
                loaded[name] = t.clone()

    worker = type("Worker", (), {"model_runner": Runner()})()
    assert draw_into(worker, cfg, 3, 0.05, device=cpu) == len(written)
    assert loaded.keys() == written.keys()
    assert all(torch.equal(loaded[k], written[k]) for k in written)
    other: dict = {}
    worker.model_runner.reload_weights = lambda weights_iterator: other.update(weights_iterator)
    draw_into(worker, cfg, 4, 0.05, device=cpu)
    assert not torch.equal(other["model.embed_tokens.weight"], written["model.embed_tokens.weight"])
    assert drawn_weights("0:0.02") == (0, 0.02)
    for bad in ("0", "x:0.02", "-1:0.02", "0:0", "0:nan", "0:inf"):
        with pytest.raises(SystemExit, match="SEED:STD"):
            drawn_weights(bad)


class _ReplaySession:
    def __init__(self, engine, sid):
        self.engine, self.sid = engine, sid

    def append(self, ids):
        self.engine.appended.setdefault(self.sid, []).append(list(ids))

    def submit(self, params):
        return self.engine.submit(self.sid, params)

    def close(self):
        pass


class _ReplayEngine:
    """What `trace.replay` drives, recording what each session appended (`appended`) and each
    request's sampling parameters (`params`); every request finishes at its length in one step."""

    def __init__(self):
        self.sessions, self.pending, self.ids = 0, [], 0
        self.appended: dict[int, list[list[int]]] = {}
        self.params: dict[int, object] = {}
        self.stats = type("S", (), {"mean_decode_wait_ms": 0.0})()

    def open_session(self):
        self.sessions += 1
        return _ReplaySession(self, self.sessions - 1)

    def submit(self, sid, params):
        self.ids += 1
        self.params[self.ids] = params
        self.pending.append((self.ids, params.max_new_tokens, time.perf_counter()))
        return self.ids

    def has_work(self):
        return bool(self.pending)

    def step(self):
        from megatron_rollout.engine.api import FinishReason, GenerationResult, RequestOutput
        from megatron_rollout.engine.request import RequestTimes

        outs = []
        for rid, n, t in self.pending:
            now = time.perf_counter()
            times = RequestTimes(arrival=t, first_token=now, finish=now)
            outs.append(RequestOutput(rid, GenerationResult([0] * n, [0.0] * n, FinishReason.LENGTH, []),
                                      times, 1))
        self.pending = []
        return outs


def _our_replay(trace, **kw) -> tuple[_ReplayEngine, dict]:
    """`trace.replay` of `trace` on `_ReplayEngine`: the engine and the replay's details."""
    from megatron_rollout.trace.replay import replay

    engine, details = _ReplayEngine(), {}
    try:
        replay(engine, trace, progress=False, vocab_size=97, details=details, **kw)
    except TypeError as exc:  # the engine's record types changed shape: say so rather than pass
        pytest.fail(f"fake engine no longer matches the engine API: {exc}")
    return engine, details


def test_peer_ids_are_the_ids_our_replay_appends():
    """Replay a trace on a fake engine that records what each session appended: the same ids as
    `conversation_inputs` gives the peer."""
    trace = make_trace(conversations=3, seed=1, scale=0.002)
    engine, _ = _our_replay(trace, seed=4)
    expected = conversation_inputs(trace, seed=4, vocab_size=97)
    assert list(engine.appended.values()) == list(expected.values())
    assert input_ids(4, 0, 0, 5, 97) == expected[0][0][:5]


def _fake_vllm(monkeypatch, calls: list):
    """A stand-in `vllm` package with the names the peer imports (AsyncLLM, AsyncEngineArgs,
    SamplingParams, TokensPrompt, RequestOutputKind), to test the peer's orchestration."""
    import sys
    import types

    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
        return m

    class AsyncEngineArgs:
        def __init__(self, **kw):
            self.kw = kw

    class EngineArgs(AsyncEngineArgs):
        pass

    class SamplingParams:
        def __init__(self, **kw):
            self.kw = kw

    class AsyncLLM:
        @classmethod
        def from_engine_args(cls, args, stat_loggers=None):
            calls.append(("start", args.kw.get("max_num_batched_tokens")))
            engine = cls()
            engine.loggers = [factory(None, 0) for factory in stat_loggers or []]
            engine.budget = args.kw.get("max_num_batched_tokens") or 2048
            engine.vllm_config = types.SimpleNamespace(
                scheduler_config=types.SimpleNamespace(max_num_batched_tokens=engine.budget, max_num_seqs=1024),
                cache_config=types.SimpleNamespace(block_size=16, enable_prefix_caching=True))
            return engine

        async def reset_prefix_cache(self):
            calls.append(("reset", self.budget))
            return True

        async def generate(self, prompt, sampling_params, request_id):
            calls.append(("params", request_id, sampling_params.kw))
            n = sampling_params.kw["max_tokens"]
            assert sampling_params.kw["min_tokens"] == n and sampling_params.kw["ignore_eos"]
            await asyncio.sleep(0.001 if self.budget == 4096 else 0.012)
            for stat_logger in self.loggers:  # one step that drafted 3 tokens and kept 2 of them
                spec = types.SimpleNamespace(num_drafts=1, num_draft_tokens=3, num_accepted_tokens=2)
                stat_logger.record(types.SimpleNamespace(spec_decoding_stats=spec), None)
            yield _Out([_Delta([7] * n)], finished=True)

        def shutdown(self):
            calls.append(("shutdown", self.budget))

    class LLMEngine:
        """The in-process engine: finishes every request one `step()` after it was added, in one delta.
        As vLLM 0.26's `LLMEngine` (unlike its `AsyncLLM`), it calls its stat loggers only with stats on
        (`disable_log_stats` False): each step that finishes requests drafted 3 tokens and kept 2 per request."""

        @classmethod
        def from_engine_args(cls, args, stat_loggers=None):
            assert isinstance(args, EngineArgs)
            calls.append(("start-in-process", args.kw.get("max_num_batched_tokens"),
                          os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")))
            engine = AsyncLLM.from_engine_args(args)
            calls.pop()
            stepped = cls()
            stepped.vllm_config, stepped.added = engine.vllm_config, []
            stepped.loggers = ([] if args.kw.get("disable_log_stats", False)
                               else [factory(None, 0) for factory in stat_loggers or []])
            return stepped

        def reset_prefix_cache(self):
            calls.append(("reset", "in-process"))

        def add_request(self, request_id, prompt, params):
            calls.append(("params", request_id, params.kw))
            self.added.append((request_id, params.kw["max_tokens"]))

        def step(self):
            time.sleep(0.002)
            done, self.added = self.added, []
            for stat_logger in self.loggers:
                spec = types.SimpleNamespace(num_drafts=len(done), num_draft_tokens=3 * len(done),
                                             num_accepted_tokens=2 * len(done))
                stat_logger.record(types.SimpleNamespace(spec_decoding_stats=spec), None)
            return [types.SimpleNamespace(request_id=rid, outputs=[_Delta([7] * n)], finished=True) for rid, n in done]

    module("vllm", __version__="0.26.0-fake", SamplingParams=SamplingParams,
           TokensPrompt=lambda **kw: kw["prompt_token_ids"])
    module("vllm.engine")
    module("vllm.engine.arg_utils", AsyncEngineArgs=AsyncEngineArgs, EngineArgs=EngineArgs)
    module("vllm.sampling_params", RequestOutputKind=types.SimpleNamespace(DELTA="delta"))
    module("vllm.v1")
    module("vllm.v1.engine")
    module("vllm.v1.engine.async_llm", AsyncLLM=AsyncLLM)
    module("vllm.v1.engine.llm_engine", LLMEngine=LLMEngine)


def test_peer_main_warms_up_resets_and_keeps_the_best_budget(monkeypatch, tmp_path):
    import json

    from benchmarks import vllm_peer
    from megatron_rollout.trace.schema import write_trace

    calls: list = []
    _fake_vllm(monkeypatch, calls)
    trace = make_trace(conversations=2, seed=0, scale=0.002, wait_scale=0.0)
    write_trace(tmp_path / "t.jsonl", trace)
    code = vllm_peer.main(["--trace", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "v.json"),
                           "--budgets", "default,4096", "--passes", "2", "--model-dir", str(tmp_path / "m")])
    assert code == 0
    result = json.loads((tmp_path / "v.json").read_text())
    assert [c for c in calls if c[0] == "start"] == [("start", None), ("start", 4096)]
    assert sum(1 for c in calls if c[0] == "reset") == 2 * 4  # before each of 2 warm-up and 2 timed passes
    for key in ("default", "4096"):
        entry = result["budgets"][key]
        assert len(entry["passes"]) == 2 and len(entry["warmups"]) == 2
        assert entry["passes"][0]["requests"] == len(trace)
        assert entry["passes"][0]["output_tokens"] == sum(t.output_tokens for t in trace)
    assert result["budgets"]["default"]["chosen"]["max_num_batched_tokens"] == 2048
    assert result["ran"] and result["best_budget"] == "4096"  # the fake is faster there
    assert result["median"]["makespan_s"] == result["budgets"]["4096"]["median"]["makespan_s"]
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 12


def test_peer_in_process_steps_vllm_s_engine_in_this_process(monkeypatch, tmp_path):
    import json

    from benchmarks import vllm_peer
    from megatron_rollout.trace.schema import write_trace

    calls: list = []
    _fake_vllm(monkeypatch, calls)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    trace = make_trace(conversations=3, seed=2, scale=0.002, wait_scale=0.0)
    write_trace(tmp_path / "t.jsonl", trace)
    code = vllm_peer.main(["--trace", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "v.json"), "--in-process",
                           "--budgets", "8192", "--passes", "2", "--warmups", "1", "--model-dir", str(tmp_path / "m")])
    assert code == 0
    assert [c for c in calls if c[0] == "start-in-process"] == [("start-in-process", 8192, "0")]
    assert sum(1 for c in calls if c[0] == "reset") == 3
    result = json.loads((tmp_path / "v.json").read_text())
    entry = result["budgets"]["8192/in-process"]
    assert entry["in_process"] and len(entry["passes"]) == 2 and len(entry["warmups"]) == 1
    assert entry["passes"][0]["requests"] == len(trace) and entry["passes"][0]["failed"] == 0
    assert entry["passes"][0]["output_tokens"] == sum(t.output_tokens for t in trace)
    assert result["best_budget"] == "8192/in-process"


class SteppedFake:
    """`LLMEngine`'s shape for `closed_loop_stepped`: a request yields its tokens over two steps
    (1000 + prompt length + i, as `FakeAsyncLLM`), `refuse` ids raise on add."""

    def __init__(self, refuse: frozenset[str] = frozenset()) -> None:
        self.calls: list[tuple[str, list[int], float]] = []
        self.live: dict[str, list[int]] = {}
        self.refuse = refuse

    def add_request(self, request_id, prompt, params):
        self.calls.append((request_id, list(prompt), time.perf_counter()))
        if request_id in self.refuse:
            raise ValueError("prompt too long")
        self.live[request_id] = [1000 + len(prompt) + i for i in range(params)]

    def step(self):
        time.sleep(0.002)
        outs = []
        for rid, left in list(self.live.items()):
            half = max(1, len(left) // 2)
            outs.append(_StepOut(rid, [_Delta(left[:half])], finished=half >= len(left)))
            self.live[rid] = left[half:]
            if not self.live[rid]:
                del self.live[rid]
        return outs


@dataclass
class _StepOut:
    request_id: str
    outputs: list[_Delta]
    finished: bool


def test_stepped_loop_keeps_the_async_loop_s_rules():
    """The in-process driver: same prompts (history grows by new and generated ids), turns sent
    after the previous one finished plus its wait, a refused turn ends its conversation."""
    from benchmarks.vllm_peer import closed_loop_stepped

    inputs = conversation_inputs(TRACE, seed=5, vocab_size=100)
    engine = SteppedFake(refuse=frozenset({"t-b-1"}))
    start, records = closed_loop_stepped(engine, TRACE, inputs, make_prompt=lambda ids: ids,
                                         make_params=lambda n, *_: n, tag="t")
    prompts = {rid: prompt for rid, prompt, _ in engine.calls}
    history: list[int] = []
    for k in range(3):
        history += inputs["a"][k]
        assert prompts[f"t-a-{k}"] == history
        n = next(t.output_tokens for t in TRACE if t.conversation == "a" and t.turn == k)
        history += [1000 + len(history) + i for i in range(n)]
    by = {(r.conversation, r.turn): r for r in records}
    sent = {rid: t for rid, _, t in engine.calls}
    assert sent["t-a-1"] >= by[("a", 0)].finish + 0.030 and sent["t-a-2"] >= by[("a", 1)].finish + 0.010
    assert by[("b", 1)].error and "too long" in by[("b", 1)].error
    rep = report(start, records, total_requests=len(TRACE))
    assert (rep["requests"], rep["failed"], rep["skipped"]) == (4, 1, 0)
    assert [r.output_tokens for r in records if r.conversation == "a"] == [2, 3, 1]
    assert all(r.first_token is not None and r.arrival <= r.first_token <= r.finish for r in records if not r.error)


@pytest.mark.parametrize("in_process", [False, True])
def test_peer_speculation_reaches_vllm_s_engine_args_and_keys_the_budget(monkeypatch, tmp_path, in_process):
    """Both modes draft as asked and count their drafts: the in-process engine only with its stats on,
    which the own-process one turns on by itself once given a stat logger."""
    import json

    from benchmarks import vllm_peer
    from megatron_rollout.trace.schema import write_trace

    calls: list = []
    _fake_vllm(monkeypatch, calls)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    seen: list = []
    real = vllm_peer._engine_args
    monkeypatch.setattr(vllm_peer, "_engine_args", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    trace = make_trace(conversations=2, seed=0, scale=0.002, wait_scale=0.0)
    write_trace(tmp_path / "t.jsonl", trace)
    code = vllm_peer.main(["--trace", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "v.json"), "--budgets",
                           "4096", "--passes", "2", "--warmups", "1", "--speculative", "ngram:3",
                           "--model-dir", str(tmp_path / "m")] + (["--in-process"] if in_process else []))
    assert code == 0
    assert seen[0].kw["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3,
                                                "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    result = json.loads((tmp_path / "v.json").read_text())
    key = "4096~ngram:3" + ("/in-process" if in_process else "")
    assert list(result["budgets"]) == [key]
    # vLLM's counts, per pass: the stand-in drafts 3 tokens once per request and keeps 2 (the
    # warm-up's counts are not carried into the first timed pass)
    for rep in result["budgets"][key]["passes"]:
        assert (rep["drafts"], rep["drafted_tokens"], rep["accepted_tokens"]) == (len(trace), 3 * len(trace),
                                                                                 2 * len(trace))
        assert rep["acceptance"] == pytest.approx(2 / 3)
    assert seen[0].kw["load_format"] == "dummy" and result["weights"] == "dummy"


@pytest.mark.parametrize("bad", ["ngram", "ngram:0", "eagle:2", "ngram:x"])
def test_peer_refuses_a_speculation_it_cannot_run_before_starting_vllm(bad, tmp_path):
    from benchmarks import vllm_peer

    with pytest.raises(SystemExit, match="ngram:K"):
        vllm_peer.main(["--trace", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "v.json"),
                        "--speculative", bad])


@pytest.mark.parametrize("in_process", [False, True])
def test_serve_answers_ready_then_one_report_per_pass_command(monkeypatch, tmp_path, in_process):
    """`--serve`: warm-ups, `ready`, one timed pass per `pass` line, an unknown command answered
    as an error (ending the session), every answer a JSON line on the reply channel."""
    import io
    import json

    from benchmarks import vllm_peer
    from megatron_rollout.trace.schema import write_trace

    calls: list = []
    _fake_vllm(monkeypatch, calls)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    trace = make_trace(conversations=2, seed=1, scale=0.002, wait_scale=0.0)
    write_trace(tmp_path / "t.jsonl", trace)
    monkeypatch.setattr("sys.stdin", io.StringIO("pass\npass\nbogus\npass\n"))
    read, write = os.pipe()
    argv = ["--trace", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "v.json"), "--budgets", "4096",
            "--warmups", "1", "--serve", "--reply-fd", str(write), "--model-dir", str(tmp_path / "m")]
    assert vllm_peer.main(argv + (["--in-process"] if in_process else [])) == 0
    with os.fdopen(read) as replies:
        answers = [json.loads(line) for line in replies]
    assert [a["event"] for a in answers] == ["ready", "pass", "pass", "error"]
    assert "bogus" in answers[-1]["reason"] and len(answers[0]["warmups"]) == 1
    result = json.loads((tmp_path / "v.json").read_text())
    entry = result["budgets"]["4096/in-process" if in_process else "4096"]
    assert [p["makespan_s"] for p in entry["passes"]] == [a["report"]["makespan_s"] for a in answers[1:3]]
    assert sum(1 for c in calls if c[0] == "reset") == 3  # one warm-up, two timed passes


def test_serve_refuses_more_than_one_budget(tmp_path):
    from benchmarks import vllm_peer

    with pytest.raises(SystemExit, match="one budget"):
        vllm_peer.main(["--trace", "t.jsonl", "--out", str(tmp_path / "v.json"), "--budgets", "default,4096",
                        "--serve", "--reply-fd", "1", "--model-dir", str(tmp_path / "m")])


def _peer_params(monkeypatch, tmp_path, trace, *extra: str) -> tuple[dict, dict[tuple[str, str, int], dict]]:
    """`vllm_peer.main` over `trace` on the stand-in vLLM (one budget, a warm-up and two timed passes,
    `--seed 4`): its JSON, and the keywords of every turn's `SamplingParams` keyed (pass, conversation, turn)."""
    import json

    from benchmarks import vllm_peer
    from megatron_rollout.trace.schema import write_trace

    calls: list = []
    _fake_vllm(monkeypatch, calls)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    write_trace(tmp_path / "t.jsonl", trace)
    assert vllm_peer.main(["--trace", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "v.json"), "--budgets",
                           "4096", "--passes", "2", "--warmups", "1", "--seed", "4", "--model-dir",
                           str(tmp_path / "m"), *extra]) == 0
    params = {}
    for _, rid, kw in (c for c in calls if c[0] == "params"):
        tag, key, turn = rid.rsplit("-", 2)  # '{tag}-{conversation}-{turn}', the tag 'b4096-p1' or 'i4096-p1'
        params[(tag.rpartition("-")[2], key, int(turn))] = kw
    return json.loads((tmp_path / "v.json").read_text()), params


@pytest.mark.timeout(60)
@pytest.mark.parametrize("in_process", [False, True])
def test_sampled_turns_are_seeded_as_our_replay_seeds_them(monkeypatch, tmp_path, in_process):
    """`--temperature 1`: every turn sampled at 1 with a seed of its own, the same in every pass, and
    the seed our replay samples that turn with (the same trace, `--seed`), in both closed loops."""
    trace = make_trace(conversations=3, seed=1, scale=0.002, wait_scale=0.0)
    result, params = _peer_params(monkeypatch, tmp_path, trace, "--temperature", "1", "--turn-seeds",
                                  *(["--in-process"] if in_process else []))
    assert len(params) == 3 * len(trace)  # the warm-up and two timed passes
    assert all(kw["temperature"] == 1.0 and kw["min_tokens"] == kw["max_tokens"] and kw["ignore_eos"]
               for kw in params.values())
    seeds = {(key, turn): kw["seed"] for (p, key, turn), kw in params.items() if p == "p0"}
    assert all(kw["seed"] == seeds[key, turn] for (_, key, turn), kw in params.items())  # every pass alike
    assert len(set(seeds.values())) == len(trace)  # no two turns, of one conversation or two, share one
    assert all(isinstance(s, int) and 0 <= s < 2**63 for s in seeds.values())  # vLLM's int64
    engine, details = _our_replay(trace, seed=4, temperature=1.0)
    ours = {(str(details["conversation_of"][rid]), details["turn_of"][rid].turn): p.seed
            for rid, p in engine.params.items()}
    assert ours == seeds
    entry = result["budgets"]["4096/in-process" if in_process else "4096"]
    assert result["temperature"] == entry["temperature"] == 1.0 and result["turn_seeds"] and entry["turn_seeds"]
    assert len(entry["passes"]) == 2 and entry["passes"][0]["output_tokens"] == sum(t.output_tokens for t in trace)


@pytest.mark.timeout(60)
def test_sampled_turns_are_unseeded_by_default_vllms_best(monkeypatch, tmp_path):
    """Without `--turn-seeds` every turn samples at the temperature with no seed of its own (vLLM then
    draws every row's noise at once), and the JSON says so."""
    trace = make_trace(conversations=2, seed=0, scale=0.002, wait_scale=0.0)
    result, params = _peer_params(monkeypatch, tmp_path, trace, "--temperature", "0.7")
    assert params and all(kw["temperature"] == 0.7 and "seed" not in kw for kw in params.values())
    assert result["turn_seeds"] is False and result["budgets"]["4096"]["turn_seeds"] is False


@pytest.mark.timeout(60)
def test_greedy_turns_carry_no_seed(monkeypatch, tmp_path):
    trace = make_trace(conversations=2, seed=0, scale=0.002, wait_scale=0.0)
    result, params = _peer_params(monkeypatch, tmp_path, trace)
    assert len(params) == 3 * len(trace)
    for (_, key, turn), kw in params.items():
        n = next(t.output_tokens for t in trace if str(t.conversation) == key and t.turn == turn)
        assert kw == {"temperature": 0.0, "max_tokens": n, "min_tokens": n, "ignore_eos": True, "detokenize": False,
                      "output_kind": "delta"}
    assert result["temperature"] == result["budgets"]["4096"]["temperature"] == 0.0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", ["-1", "nan", "inf", "-0.5", "warm"])
def test_peer_refuses_a_temperature_that_is_not_a_finite_number_at_least_0(bad, tmp_path, capsys):
    from benchmarks import vllm_peer

    with pytest.raises(SystemExit):
        vllm_peer.main(["--trace", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "v.json"),
                        "--temperature", bad])
    assert f"argument --temperature: takes a finite number >= 0 (0: greedy), got '{bad}'" in capsys.readouterr().err
    assert not (tmp_path / "v.json").exists()
    assert vllm_peer.temperature("0") == 0.0 and vllm_peer.temperature("0.7") == 0.7


@pytest.mark.timeout(30)
def test_turn_seeds_without_a_temperature_are_refused(tmp_path):
    from benchmarks import rollout, vllm_peer

    with pytest.raises(SystemExit, match="--turn-seeds seeds sampled turns: give --temperature > 0"):
        vllm_peer.main(["--trace", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "v.json"), "--turn-seeds"])
    with pytest.raises(SystemExit, match="--vllm-turn-seeds seeds the peer's sampled turns"):
        rollout.main(["--model", "tiny-moe", "--device", "cpu", "--vllm-turn-seeds", "--out", str(tmp_path / "o")])
    assert not (tmp_path / "v.json").exists() and not (tmp_path / "o").exists()
