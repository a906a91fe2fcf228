"""The P/D overlap benchmark: its arguments, its arithmetic and its JSON on CPU; the whole run on a GPU."""
import ctypes
import json

import pytest
import torch

from benchmarks import pd_overlap, sm_partition
from benchmarks.pd_overlap import Times
from benchmarks.sm_partition import Split
from megatron_rollout.runner.partition import DevResource


@pytest.mark.timeout(30)
def test_splits_parse_and_refuse_what_is_not_p_over_d():
    assert sm_partition.parse_splits("100/32, 108/24") == [Split(100, 32), Split(108, 24)]
    assert Split(116, 16).label == "116/16"
    for bad in ("100", "100/32/4", "a/b", "100/-3", ""):
        with pytest.raises(ValueError, match="split"):
            sm_partition.parse_splits(bad)
    with pytest.raises(ValueError, match="decode_sms must be a positive int, got 0"):
        Split(100, 0)
    with pytest.raises(ValueError, match="unknown partition method 'mps'"):
        with sm_partition.partitions("mps", Split(100, 32), torch.device("cpu")):
            pass


@pytest.mark.timeout(30)
def test_driver_resource_struct_matches_cuda_h():
    # CUdevResource is 144 bytes and the SM member's smCount sits right after type + 92 bytes
    assert ctypes.sizeof(DevResource) == 144
    assert DevResource.sm_count.offset == 96


@pytest.mark.timeout(30)
def test_arguments_quick_and_plan():
    args = pd_overlap.parse_args([])
    assert args.methods == ["streams", "driver", "torch"] and len(args.split_list) == 4
    # streams has no split: measured once; the partitioned methods once per split
    assert [(m, s.label) for m, s in pd_overlap.plan(pd_overlap.parse_args(["--method", "streams,driver",
                                                                            "--splits", "100/32,124/8"]))] == \
        [("streams", "100/32"), ("driver", "100/32"), ("driver", "124/8")]
    quick = pd_overlap.parse_args(["--quick", "--splits", "108/24,116/16"])
    assert (quick.prefill_layers, quick.decode_layers, quick.repeats) == (2, 2, 2)
    assert quick.split_list == [Split(108, 24)]
    held = pd_overlap.plan(pd_overlap.parse_args(["--method", "held", "--splits", "116/16"]))
    assert [(m, s.label) for m, s in held] == [("held", "116/16")]
    for argv in (["--method", "mps"], ["--splits", "108"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            pd_overlap.parse_args(argv)


@pytest.mark.timeout(30)
def test_factors_and_gain():
    # P 30 ms and D 20 ms alone on the whole device; beside each other P ends at 36, D at 40
    t = Times(prefill_alone_s=0.030, decode_alone_s=0.020, prefill_part_s=0.033, decode_part_s=0.030,
              prefill_beside_s=0.036, decode_beside_s=0.040, together_s=0.040)
    s = pd_overlap.summarize(t)
    assert s["sequential_s"] == pytest.approx(0.050) and s["gain"] == pytest.approx(1.25)
    assert s["prefill_factor"] == pytest.approx(1.2) and s["decode_factor"] == pytest.approx(2.0)
    assert s["prefill_partition_factor"] == pytest.approx(1.1) and s["decode_partition_factor"] == pytest.approx(1.5)
    # a pilot of 10 steps ending at 40 ms beside a P ending at 30 ms: 8 steps end with P; never 0
    assert pd_overlap.resized_steps(10, 0.030, 0.040) == 8
    assert pd_overlap.resized_steps(1, 0.001, 0.040) == 1


def held_limit(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count - 24


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_quick_run_partitions_are_disjoint_and_both_phases_run(tmp_path):
    probe = sm_partition.probe("driver", Split(108, 24), torch.device("cuda", 0))
    assert probe["shared_sms"] == 0 and probe["decode_sms"] == 24 and probe["decode_eager"] <= 24
    result = pd_overlap.main(["--quick", "--method", "streams,driver,held", "--splits", "108/24",
                              "--out", str(tmp_path)])
    assert json.loads((tmp_path / "pd_overlap.json").read_text()) == result
    assert [r["method"] for r in result["runs"]] == ["streams", "driver", "held"] and result["stopped"] is None
    for run in result["runs"]:
        assert "error" not in run, run
        assert run["steps"] >= 1 and len(run["runs_s"]) == 2
        assert run["together_s"] >= max(run["prefill_beside_s"], run["decode_beside_s"]) * 0.999
    assert result["runs"][1]["decode_sms"] == 24
    held = result["runs"][2]  # P on the device minus 24 SMs, D on an ordinary stream over all of them
    assert held["prefill_sms"] <= held_limit(torch.device("cuda", 0)) and held["decode_sms"] is None
