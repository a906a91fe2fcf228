"""`EngineConfig` and its component configs (`engine/config.py`): flat keywords are shorthand for
nested component fields, strings are parsed in one place, bad values are refused with the value,
and the CLI's defaults are the config's."""
from __future__ import annotations

import dataclasses
import re

import pytest

from megatron_rollout.comm.dist import CommConfig
from megatron_rollout.engine import EngineConfig, Schedule
from megatron_rollout.engine.config import DEFAULT_NUM_BLOCKS, KVConfig, MuxConfig, RunnerConfig, parse_span, span_spec
from megatron_rollout.engine.scheduler import SchedulerConfig
from megatron_rollout.multiplex.policy import FixedSpanConfig, LoadSelectedConfig, WaitBudgetConfig
from megatron_rollout.options import add_engine_args, engine_config


def test_flat_keywords_set_component_fields():
    flat = EngineConfig(schedule="mux", block_size=4, num_blocks=64, max_batch_tokens=8, mux_span="fixed:2",
                        mux_ordering="naive", prefix_caching=False, runner_kind="eager", seed=3)
    nested = EngineConfig(scheduler=SchedulerConfig(Schedule.MUX, 4, 8), kv=KVConfig(64, prefix_caching=False),
                          mux=MuxConfig(FixedSpanConfig(2), "naive"), runner=RunnerConfig(kind="eager"), seed=3)
    assert flat == nested
    assert (flat.schedule, flat.block_size, flat.num_blocks, flat.mux_span, flat.mux_ordering) == \
        (Schedule.MUX, 4, 64, "fixed:2", "naive")
    assert dataclasses.replace(flat, seed=4).seed == 4 and dataclasses.replace(flat, seed=4).kv == flat.kv
    with pytest.raises(dataclasses.FrozenInstanceError):
        flat.seed = 5  # type: ignore[misc]


def test_span_strings_are_parsed_once():
    assert parse_span("load") == LoadSelectedConfig() and parse_span("fixed:3") == FixedSpanConfig(3)
    assert span_spec(parse_span("fixed:3")) == "fixed:3" and MuxConfig("fixed:1").span == FixedSpanConfig(1)
    assert parse_span("budget:8000") == WaitBudgetConfig(budget_us=8000.0)
    assert span_spec(parse_span("budget:2500.5")) == "budget:2500.5"
    for bad in ("fixed:0", "fixed:x", "fixed", "Load", "", "budget:0", "budget:-1", "budget:"):
        with pytest.raises(ValueError, match=f"mux_span must be 'load', 'fixed:K' with K > 0 or 'budget:US'.*"
                                             f"got {re.escape(repr(bad))}"):
            EngineConfig(mux_span=bad)


@pytest.mark.parametrize("kwargs, message", [
    (dict(schedule="fast"), "'fast' is not a valid Schedule"),
    (dict(num_blocks=0), "num_blocks must be a positive int, got 0"),
    (dict(block_size=0), r"SchedulerConfig\.block_size must be a positive int, got 0"),
    (dict(mux_ordering="fifo"), "mux_ordering must be 'turnstile' or 'naive', got 'fifo'"),
    (dict(runner_kind="fast"), "the runner kind must be auto, eager or cuda, got 'fast'"),
    (dict(max_model_len=0), "max_model_len must be a positive int or None, got 0"),
])
def test_bad_values_are_refused_with_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_bad_component_values_are_refused():
    with pytest.raises(ValueError, match="CommConfig.backend must be one of"):
        CommConfig(backend="nccl")
    with pytest.raises(ValueError, match="graph_batch_sizes must be positive ints, strictly increasing"):
        RunnerConfig(graph_batch_sizes=(2, 2))
    with pytest.raises(TypeError, match=r"unknown keywords \['num_block'\]"):
        EngineConfig(num_block=8)


def test_cli_arguments_build_the_same_config():
    import argparse

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--schedule", "mux", "--mux-span", "fixed:1", "--block-size", "4", "--runner", "eager",
                         "--timeout", "30", "--p-exchange", "alltoall"])
    config = engine_config(args)
    assert config.num_blocks == DEFAULT_NUM_BLOCKS == EngineConfig().num_blocks == 1024  # one default
    assert config == EngineConfig(schedule="mux", mux_span="fixed:1", block_size=4, runner_kind="eager",
                                  comm=CommConfig(timeout_s=30, p_exchange="alltoall"))
    assert engine_config(args, "off").schedule is Schedule.OFF
    off = engine_config(p.parse_args(["--decode-ahead", "off"]))
    assert off.runner.decode_ahead == "off" and config.runner.decode_ahead == "auto"
    assert engine_config(p.parse_args(["--fp8", "block"])).runner.fp8 == "block" and config.runner.fp8 == "off"


def test_fp8_mode_is_checked():
    assert EngineConfig(fp8="tensor").runner.fp8 == "tensor"
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
