import json
import logging
import os

import pytest

from megatron_rollout.trace.schema import (
    TraceError,
    TraceRequest,
    group_conversations,
    load_trace,
    load_trace_lenient,
    write_trace,
)

GOOD = [
    {"conversation": "a", "turn": 0, "input_tokens": 100, "output_tokens": 5, "wait_ms": 0},
    {"conversation": 7, "turn": 0, "input_tokens": 50, "output_tokens": 3, "wait_ms": 12.5},
    {"conversation": "a", "turn": 1, "input_tokens": 30, "output_tokens": 2, "wait_ms": 400.0},
]


def _write_lines(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_load_reads_every_field_in_file_order(tmp_path):
    path = _write_lines(tmp_path / "t.jsonl", GOOD[:2] + [""] + GOOD[2:])  # a blank line is allowed
    reqs = load_trace(path)
    assert reqs == [TraceRequest("a", 0, 100, 5, 0.0), TraceRequest(7, 0, 50, 3, 12.5),
                    TraceRequest("a", 1, 30, 2, 400.0)]
    assert isinstance(reqs[0].wait_ms, float)


@pytest.mark.parametrize("bad, message", [
    ("{not json", "malformed JSON"),
    ("[1, 2]", "expected a JSON object"),
    ({"conversation": "b", "turn": 0, "input_tokens": 1, "output_tokens": 1}, "missing field(s) 'wait_ms'"),
    ({"conversation": "b", "turn": 0, "input_tokens": 1, "output_tokens": 1, "wait_ms": 0, "wait": 3},
     "unexpected field(s) 'wait'"),
    ({"conversation": "b", "turn": 0, "input_tokens": 0, "output_tokens": 1, "wait_ms": 0},
     "'input_tokens' must be a positive integer, got 0"),
    ({"conversation": "b", "turn": 0, "input_tokens": 5.0, "output_tokens": 1, "wait_ms": 0},
     "'input_tokens' must be a positive integer, got 5.0 (float)"),
    ({"conversation": "b", "turn": 0, "input_tokens": 4, "output_tokens": -2, "wait_ms": 0},
     "'output_tokens' must be a positive integer, got -2"),
    ({"conversation": "b", "turn": 0, "input_tokens": 4, "output_tokens": 2, "wait_ms": -1},
     "'wait_ms' must be a finite number >= 0, got -1"),
    ({"conversation": "b", "turn": 0, "input_tokens": 4, "output_tokens": 2, "wait_ms": "5"},
     "'wait_ms' must be a finite number >= 0, got '5' (str)"),
    ('{"conversation": "b", "turn": 0, "input_tokens": 4, "output_tokens": 2, "wait_ms": NaN}',
     "'wait_ms' must be a finite number"),
    ({"conversation": True, "turn": 0, "input_tokens": 4, "output_tokens": 2, "wait_ms": 0},
     "'conversation' must be a string or an integer, got True (bool)"),
    ({"conversation": "b", "turn": "0", "input_tokens": 4, "output_tokens": 2, "wait_ms": 0},
     "'turn' must be an integer >= 0, got '0' (str)"),
    ({"conversation": "b", "turn": 1, "input_tokens": 4, "output_tokens": 2, "wait_ms": 0},
     "conversation 'b': turn 1 where turn 0 was expected"),
    ({"conversation": "a", "turn": 1, "input_tokens": 4, "output_tokens": 2, "wait_ms": 0},
     "conversation 'a': turn 1 where turn 2 was expected (duplicate"),
    ({"conversation": "a", "turn": 3, "input_tokens": 4, "output_tokens": 2, "wait_ms": 0},
     "conversation 'a': turn 3 where turn 2 was expected (out-of-order or missing"),
])
def test_strict_load_names_file_line_and_problem(tmp_path, bad, message):
    path = _write_lines(tmp_path / "bad.jsonl", GOOD + [bad])
    with pytest.raises(TraceError) as info:
        load_trace(path)
    err = info.value
    assert (err.path, err.line) == (str(path), 4)
    assert message in err.message, err.message
    assert str(err).startswith(f"{path}:4: ")


def test_one_based_turns_are_rejected_at_the_first_line(tmp_path):
    path = _write_lines(tmp_path / "t.jsonl", [
        {"conversation": 1, "turn": 1, "input_tokens": 4, "output_tokens": 2, "wait_ms": 0}])
    with pytest.raises(TraceError, match=r"t.jsonl:1: conversation 1: turn 1 where turn 0 was expected"):
        load_trace(path)


def test_empty_trace_is_an_error(tmp_path):
    path = _write_lines(tmp_path / "t.jsonl", ["", "  "])
    with pytest.raises(TraceError, match="no requests"):
        load_trace(path)
    assert load_trace_lenient(path).requests == []


def test_lenient_skips_bad_lines_and_the_rest_of_their_conversation(tmp_path, caplog):
    lines = [
        GOOD[0],                                                                       # 1 a/0 kept
        {"conversation": "b", "turn": 0, "input_tokens": 9, "output_tokens": 1, "wait_ms": 0},  # 2 kept
        {"conversation": "a", "turn": 1, "input_tokens": -3, "output_tokens": 1, "wait_ms": 0},  # 3 bad
        "oops",                                                                        # 4 bad JSON
        {"conversation": "b", "turn": 1, "input_tokens": 9, "output_tokens": 1, "wait_ms": 5},  # 5 kept
        {"conversation": "a", "turn": 2, "input_tokens": 9, "output_tokens": 1, "wait_ms": 5},  # 6 cut
    ]
    path = _write_lines(tmp_path / "t.jsonl", lines)
    with caplog.at_level(logging.WARNING, logger="megatron_rollout.trace.schema"):
        load = load_trace_lenient(path)
    assert [(r.conversation, r.turn) for r in load.requests] == [("a", 0), ("b", 0), ("b", 1)]
    assert [e.line for e in load.errors] == [3, 4, 6]
    assert "'input_tokens' must be a positive integer" in load.errors[0].message
    assert "malformed JSON" in load.errors[1].message
    assert "conversation 'a' skipped from here on: line 3 was invalid" in load.errors[2].message
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 3
    with pytest.raises(TraceError) as info:  # strict stops at the first of them
        load_trace(path)
    assert info.value.line == 3


def test_write_then_load_round_trips(tmp_path):
    reqs = [TraceRequest("x", 0, 10, 2, 0.0), TraceRequest(3, 0, 7, 1, 1.25), TraceRequest("x", 1, 4, 9, 800.125)]
    write_trace(tmp_path / "t.jsonl", reqs)
    assert load_trace(tmp_path / "t.jsonl") == reqs
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 3


def test_group_conversations_keeps_order_and_checks_turns():
    reqs = [TraceRequest("x", 0, 1, 1, 0.0), TraceRequest("y", 0, 1, 1, 0.0), TraceRequest("x", 1, 1, 1, 0.0)]
    groups = group_conversations(reqs)
    assert list(groups) == ["x", "y"]
    assert [r.turn for r in groups["x"]] == [0, 1]
    with pytest.raises(ValueError, match="request 1: conversation 'x': turn 2 where turn 1 was expected"):
        group_conversations([reqs[0], TraceRequest("x", 2, 1, 1, 0.0)])


def test_trace_request_validates_when_built_in_code():
    with pytest.raises(ValueError, match="'output_tokens' must be a positive integer"):
        TraceRequest("x", 0, 1, 0, 0.0)
    with pytest.raises(ValueError, match="'conversation' must not be the empty string"):
        TraceRequest("", 0, 1, 1, 0.0)


# ---------------------------------------------------------------- limits, at parse time

def _line(**kw):
    return {"conversation": "b", "turn": 0, "input_tokens": 4, "output_tokens": 2, "wait_ms": 0, **kw}


@pytest.mark.parametrize("bad, message", [
    (_line(input_tokens=100_000_000_000), "'input_tokens' must be at most 16777216 (no context holds more), "
                                          "got 100000000000"),
    ('{"conversation": "b", "turn": 0, "input_tokens": 1e11, "output_tokens": 2, "wait_ms": 0}',
     "'input_tokens' must be a positive integer, got 100000000000.0 (float)"),
    (_line(output_tokens=100_000_000_000), "'output_tokens' must be at most 16777216"),
    (_line(output_tokens=2.5), "'output_tokens' must be a positive integer, got 2.5 (float)"),
    (_line(wait_ms=1e12), "'wait_ms' must be at most 3600000 (one hour), got 1000000000000.0"),
    (_line(turn=10**7), "'turn' must be below 1048576, got 10000000"),
    (_line(turn=1e3), "'turn' must be an integer >= 0, got 1000.0 (float)"),
    (_line(conversation=2**70), "'conversation' must fit in 64 bits"),
    (_line(conversation="c" * 300), "'conversation' must be at most 256 characters, got 300"),
])
def test_limits_are_refused_at_parse_time_with_the_line(tmp_path, bad, message):
    import time

    path = _write_lines(tmp_path / "big.jsonl", GOOD + [bad])
    start, cpu = time.perf_counter(), time.process_time()
    with pytest.raises(TraceError) as info:
        load_trace(path)
    # refused, not allocated (CPU time, which a busy machine does not inflate) or slept on (wall clock)
    assert time.process_time() - cpu < 1.0 and time.perf_counter() - start < 30
    assert (info.value.path, info.value.line) == (str(path), 4)
    assert message in info.value.message, info.value.message


def test_validate_trace_bounds_tokens_by_the_context_and_names_the_line(tmp_path):
    from megatron_rollout.trace.schema import validate_trace

    lines = GOOD + [_line(input_tokens=200), _line(conversation="c", output_tokens=128)]
    path = _write_lines(tmp_path / "t.jsonl", lines)
    reqs = load_trace(path)
    validate_trace(reqs[:3], max_model_len=128)  # 100 + 5 fits
    with pytest.raises(TraceError, match=r"t\.jsonl:4: input_tokens 200 does not fit the context: max_model_len "
                                         r"128 leaves room for at most 127") as info:
        validate_trace(reqs, max_model_len=128)
    assert info.value.line == 4
    with pytest.raises(TraceError, match=r"t\.jsonl:5: output_tokens 128 does not fit the context"):
        validate_trace(reqs[:3] + reqs[4:], max_model_len=128)
    with pytest.raises(TraceError, match=r"t\.jsonl:3: wait_ms 400.0 is above the limit of 100"):
        validate_trace(reqs, max_model_len=1000, max_wait_ms=100)
    built = [TraceRequest("x", 0, 3, 1, 0.0), TraceRequest("x", 1, 64, 1, 0.0)]  # in code: no file line
    with pytest.raises(TraceError, match=r"<trace>:2: request 1 \(conversation 'x' turn 1\): input_tokens 64"):
        validate_trace(built, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len must be an integer >= 2, got 0"):
        validate_trace(built, max_model_len=0)


def test_where_is_metadata_not_a_field(tmp_path):
    path = _write_lines(tmp_path / "t.jsonl", GOOD)
    reqs = load_trace(path)
    assert reqs[1].where == f"{path}:2" and reqs[1] == TraceRequest(7, 0, 50, 3, 12.5)
    assert reqs[1].to_dict() == GOOD[1] | {"wait_ms": 12.5}


def test_only_readable_regular_files_are_read(tmp_path, monkeypatch):
    """A directory, a FIFO and a device are refused at once (a FIFO blocked forever waiting for a
    writer, /dev/zero read without end); an unreadable file says so (a traceback before)."""
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    for path, kind in ((tmp_path, "a directory"), (fifo, "not a regular file (a FIFO, socket or device)"),
                       ("/dev/zero", "not a regular file (a FIFO, socket or device)")):
        with pytest.raises(ValueError) as info:
            load_trace(path)
        assert str(info.value) == f"trace {path} is {kind}: give a JSONL trace file"
    path = _write_lines(tmp_path / "t.jsonl", GOOD)

    def refuse(name, flags, *args):
        raise PermissionError(13, "Permission denied", name)

    monkeypatch.setattr(os, "open", refuse)  # root reads any file: refuse the way a non-owner is refused
    with pytest.raises(ValueError, match=f"trace {path} cannot be read \\(Permission denied\\): give a readable"):
        load_trace(path)


def test_deep_nesting_and_bad_bytes_are_errors_of_their_line(tmp_path):
    """JSON nested 100,000 deep raised RecursionError; a byte that is not UTF-8 is named with its line."""
    path = _write_lines(tmp_path / "t.jsonl", [GOOD[0], "[" * 100_000])
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert str(info.value) == f"{path}:2: malformed JSON: nested too deeply (a request is one flat object)"
    path.write_bytes(json.dumps(GOOD[0]).encode() + b"\n\xff{}\n")
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert str(info.value) == f"{path}:2: not UTF-8 text (invalid start byte at byte 0)"
    assert load_trace_lenient(path).requests == [TraceRequest("a", 0, 100, 5, 0.0)]
