"""`EngineConfig` and its component configs (`engine/config.py`): one nested spelling (in Python and
as a mapping), strings parsed in one place, bad values refused with the value, the comm's
coupling to the token budget kept by the config, and the CLI's defaults the config's."""
from __future__ import annotations

import dataclasses
import re

import pytest

from megatron_rollout.engine import (
    CommConfig,
    EngineConfig,
    KVConfig,
    MuxConfig,
    RunnerConfig,
    Schedule,
    SchedulerConfig,
)
from megatron_rollout.engine.config import DEFAULT_NUM_BLOCKS, parse_span, span_spec
from megatron_rollout.multiplex.policy import FixedSpanConfig, LoadSelectedConfig, WaitBudgetConfig
from megatron_rollout.options import add_engine_args, engine_config


def test_one_nested_spelling_in_python_and_as_a_mapping():
    config = EngineConfig(scheduler=SchedulerConfig("mux", 4, 8), kv=KVConfig(64, prefix_caching=False),
                          mux=MuxConfig("fixed:2", "naive"), runner=RunnerConfig(kind="eager"), seed=3)
    assert config.scheduler.schedule is Schedule.MUX and config.mux.span == FixedSpanConfig(2)
    assert config == EngineConfig.from_dict({
        "scheduler": {"schedule": "mux", "block_size": 4, "max_batch_tokens": 8},
        "kv": {"num_blocks": 64, "prefix_caching": False}, "mux": {"span": "fixed:2", "ordering": "naive"},
        "runner": {"kind": "eager"}, "seed": 3})
    assert EngineConfig.from_dict({"runner": {"graph_batch_sizes": [1, 2]}}).runner.graph_batch_sizes == (1, 2)
    assert dataclasses.replace(config, seed=4).seed == 4 and dataclasses.replace(config, seed=4).kv == config.kv
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 5  # type: ignore[misc]
    assert not hasattr(config, "num_blocks") and not hasattr(config, "schedule")  # no flat aliases


@pytest.mark.parametrize("raw, message", [
    ({"schedule": "mux"}, r"EngineConfig has no field \['schedule'\]; its fields are \['scheduler', 'kv'"),
    ({"kv": {"num_block": 8}}, r"KVConfig \(EngineConfig.kv\) has no field \['num_block'\]"),
    ({"scheduler": "mux"}, r"EngineConfig.scheduler takes a mapping of SchedulerConfig fields, got 'mux'"),
    (["scheduler"], "an engine config must be a mapping of EngineConfig fields"),
])
def test_mappings_with_unknown_or_flat_names_are_refused(raw, message):
    with pytest.raises(TypeError, match=message):
        EngineConfig.from_dict(raw)


def test_a_component_of_the_wrong_type_is_refused():
    with pytest.raises(TypeError, match=r"EngineConfig.kv must be a KVConfig, got \{'num_blocks': 8\}"):
        EngineConfig(kv={"num_blocks": 8})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_blocks'"):
        EngineConfig(num_blocks=8)  # type: ignore[call-arg]


def test_the_comm_holds_a_whole_prefill_epoch():
    """`EngineConfig.comm.p_max_tokens` covers `scheduler.max_batch_tokens` (it was the CLI's rule)."""
    big = EngineConfig(scheduler=SchedulerConfig(max_batch_tokens=8192), comm=CommConfig(timeout_s=30))
    assert big.comm.p_max_tokens == 8192 and big.comm.timeout_s == 30
    assert EngineConfig(comm=CommConfig(p_max_tokens=6000)).comm.p_max_tokens == 6000
    assert EngineConfig().comm is None  # the model's comm as built


def test_span_strings_are_parsed_once():
    assert parse_span("load") == LoadSelectedConfig() and parse_span("fixed:3") == FixedSpanConfig(3)
    assert span_spec(parse_span("fixed:3")) == "fixed:3" and MuxConfig("fixed:1").span == FixedSpanConfig(1)
    assert parse_span("budget:8000") == WaitBudgetConfig(budget_us=8000.0)
    assert span_spec(parse_span("budget:2500.5")) == "budget:2500.5"
    for bad in ("fixed:0", "fixed:x", "fixed", "Load", "", "budget:0", "budget:-1", "budget:"):
        with pytest.raises(ValueError, match=r"MuxConfig.span \(--mux-span\) must be 'load', 'fixed:K' with K > 0 "
                                             f"or 'budget:US'.*got {re.escape(repr(bad))}"):
            MuxConfig(span=bad)


@pytest.mark.parametrize("make, message", [
    (lambda: SchedulerConfig(schedule="fast"), "'fast' is not a valid Schedule"),
    (lambda: KVConfig(num_blocks=0), "num_blocks must be a positive int, got 0"),
    (lambda: SchedulerConfig(block_size=0), r"SchedulerConfig\.block_size must be a positive int, got 0"),
    (lambda: MuxConfig(ordering="fifo"), "MuxConfig.ordering must be 'turnstile' or 'naive', got 'fifo'"),
    (lambda: RunnerConfig(kind="fast"), "the runner kind must be auto, eager or cuda, got 'fast'"),
    (lambda: EngineConfig(max_model_len=0), "max_model_len must be a positive int or None, got 0"),
    (lambda: EngineConfig(seed=1.5), "seed must be an int, got 1.5"),
])
def test_bad_values_are_refused_with_the_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_bad_component_values_are_refused():
    with pytest.raises(ValueError, match="CommConfig.backend must be one of"):
        CommConfig(backend="nccl")
    with pytest.raises(ValueError, match="graph_batch_sizes must be positive ints, strictly increasing"):
        RunnerConfig(graph_batch_sizes=(2, 2))


def test_cli_arguments_build_the_same_config():
    import argparse

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--schedule", "mux", "--mux-span", "fixed:1", "--block-size", "4", "--runner", "eager",
                         "--timeout", "30", "--p-exchange", "alltoall"])
    config = engine_config(args)
    assert config.kv.num_blocks == DEFAULT_NUM_BLOCKS == EngineConfig().kv.num_blocks == 1024  # one default
    assert config == EngineConfig(scheduler=SchedulerConfig("mux", block_size=4), mux=MuxConfig("fixed:1"),
                                  runner=RunnerConfig(kind="eager"),
                                  comm=CommConfig(timeout_s=30, p_exchange="alltoall"))
    assert engine_config(args, "off").scheduler.schedule is Schedule.OFF
    off = engine_config(p.parse_args(["--decode-ahead", "off"]))
    assert off.runner.decode_ahead == "off" and config.runner.decode_ahead == "auto"
    assert engine_config(p.parse_args(["--fp8", "block"])).runner.fp8 == "block" and config.runner.fp8 == "off"
    budget = engine_config(p.parse_args(["--max-batch-tokens", "8192"]))
    assert budget.comm.p_max_tokens == 8192  # the config's rule, not the CLI's
    assert engine_config(p.parse_args(["--priority", "most-turns"])).scheduler.priority == "most-turns"
    assert config.scheduler.priority == "fifo"
    from_yaml = EngineConfig.from_dict({"scheduler": {"priority": "longest-context"}})
    assert from_yaml.scheduler.priority == "longest-context"


def test_fp8_mode_is_checked():
    assert EngineConfig(runner=RunnerConfig(fp8="tensor")).runner.fp8 == "tensor"
    with pytest.raises(ValueError, match="fp8 must be one of .*got 'e5m2'"):
        RunnerConfig(fp8="e5m2")


@pytest.mark.parametrize("field, value", [
    ("block_size", True), ("block_size", 2.5), ("max_batch_tokens", float("inf")), ("max_batch_tokens", 512.5),
    ("max_decode_rows", 1.5), ("max_batch_tokens", False), ("block_size", -16),
])
def test_token_budgets_and_block_size_must_be_positive_ints(field, value):
    message = rf"SchedulerConfig\.{field} must be a positive int, got {re.escape(repr(value))}"
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**{field: value})


def test_a_fractional_block_size_is_refused_before_torch_allocates():
    with pytest.raises(ValueError, match=r"SchedulerConfig\.block_size must be a positive int, got 2\.5"):
        EngineConfig(scheduler=SchedulerConfig(block_size=2.5))  # torch's allocation used to raise a TypeError


@pytest.mark.parametrize("kwargs", [dict(graph_batch_sizes=(1, 2.5)), dict(graph_batch_sizes=(True, 2)),
                                    dict(prefill_graph_tokens=(64, float("inf"))), dict(prefill_graph_rows=1.5)])
def test_runner_buckets_must_be_positive_ints(kwargs):
    with pytest.raises(ValueError, match="must be (positive ints|a positive int)"):
        RunnerConfig(**kwargs)


def test_the_cli_runner_default_is_the_environment_read_once(monkeypatch):
    import argparse

    p = argparse.ArgumentParser()
    add_engine_args(p)
    monkeypatch.setenv("MEGATRON_ROLLOUT_RUNNER", "eager")
    assert engine_config(p.parse_args([])).runner.kind == "eager"
    assert engine_config(p.parse_args(["--runner", "cuda"])).runner.kind == "cuda"
    monkeypatch.setenv("MEGATRON_ROLLOUT_RUNNER", "fast")  # an error the CLI reports, not a traceback at parsing
    args = p.parse_args([])
    with pytest.raises(ValueError, match=r"\$MEGATRON_ROLLOUT_RUNNER must be auto, eager or cuda, got 'fast'"):
        engine_config(args)


def test_the_engine_honours_its_comm_config():
    """The engine runs on the communicators its config names: a model's comm built from another
    CommConfig is refused, and so is a P exchange smaller than a prefill epoch."""
    from megatron_rollout.engine.engine import comm_config_of

    built = CommConfig(timeout_s=30, p_exchange="alltoall")
    assert comm_config_of(EngineConfig(comm=built), built) == built
    assert comm_config_of(EngineConfig(), built) == built  # None: the comm as built
    assert comm_config_of(EngineConfig(comm=built), None) == built  # one process: nothing was built
    with pytest.raises(ValueError, match=r"EngineConfig.comm is CommConfig\(.*p_exchange='allgather'.*but the "
                                         r"model's comm was built with CommConfig\(.*p_exchange='alltoall'"):
        comm_config_of(EngineConfig(comm=CommConfig(timeout_s=30)), built)
    with pytest.raises(ValueError, match=r"holds 4096 tokens per P exchange .*max_batch_tokens = 8192"):
        comm_config_of(EngineConfig(scheduler=SchedulerConfig(max_batch_tokens=8192)), CommConfig())
