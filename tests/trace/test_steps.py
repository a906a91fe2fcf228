"""Step records to JSON columns and back, unchanged."""
import json

import pytest

from megatron_rollout.engine.records import StepRecord
from megatron_rollout.trace.steps import (
    FIELDS,
    SUBMISSION_COLUMNS,
    from_columns,
    marks_from_columns,
    marks_to_columns,
    to_columns,
)

RECORDS = [
    StepRecord("P", 0, 0, 2, 300, 45_150, 1234.567890123456, 1234.6012345678901),
    StepRecord("D", 5, 2_050, 0, 0, 0, 1234.602, 1234.6031),
    StepRecord("P", 3, 911, 1, 64, 2_080, 1234.61, 1234.62, None),
    StepRecord("P", 0, 0, 1, 17, 153, 0.1 + 0.2, 1e-9 + 0.3, epoch=4),
    StepRecord("D", 2, 1_010, 0, 0, 0, 1234.7, 1234.71, decode_positions=9),  # two rows and 7 drafts
]


def test_columns_round_trip_through_json_unchanged():
    cols = to_columns(RECORDS)
    assert list(cols) == list(FIELDS)
    assert cols["decode_rows"] == [0, 5, 3, 0, 2] and cols["epoch"] == [None, None, None, 4, None]
    back = from_columns(json.loads(json.dumps(cols)))
    assert back == RECORDS
    assert all(type(b.prefill_pairs) is int and type(b.start) is float for b in back)


def test_no_records_is_empty_columns():
    assert from_columns(to_columns([])) == []
    assert to_columns([]) == {name: [] for name in FIELDS}


def test_refusals():
    cols = to_columns(RECORDS)
    with pytest.raises(ValueError, match=r"missing \['epoch'\], unknown \[\]"):
        from_columns({k: v for k, v in cols.items() if k != "epoch"})
    with pytest.raises(ValueError, match="differ in length"):
        from_columns({**cols, "end": cols["end"][:2]})


def test_results_written_before_decode_positions_read_as_one_position_a_row():
    cols = {k: v for k, v in to_columns(RECORDS[:3]).items() if k != "decode_positions"}
    back = from_columns(json.loads(json.dumps(cols)))
    assert back == RECORDS[:3] and [r.positions for r in back] == [0, 5, 3]
    assert RECORDS[4].positions == 9


def test_the_replays_marks_round_trip_and_keep_their_columns_when_empty():
    marks = [(1.5, 1.75, 300), (2.0, 2.125, 4000)]
    cols = json.loads(json.dumps(marks_to_columns(marks, SUBMISSION_COLUMNS)))
    assert cols == {"start": [1.5, 2.0], "end": [1.75, 2.125], "tokens": [300, 4000]}
    assert marks_from_columns(cols, SUBMISSION_COLUMNS) == marks
    assert marks_to_columns([], SUBMISSION_COLUMNS) == {"start": [], "end": [], "tokens": []}
    assert marks_from_columns({}, SUBMISSION_COLUMNS) == []
    with pytest.raises(ValueError):
        marks_from_columns({"start": [1.0], "end": [], "tokens": [3]}, SUBMISSION_COLUMNS)
