"""Counts consumed on the device (`CommConfig.counts="device"`): P's padded domain or padded ADP
all-gather, D's low-latency domain and padded all-gather, and the sharded model over them give the
reference's results on ATP2/ADP2/EP4 with no host read (`tolist`, `item`, `cpu`, `int()`, ...)
inside a forward, where the host-count comm makes several; a rank-order mismatch is still found,
by the deferred device-side check after the forward (shared worlds, see worlds.py)."""
import pytest

from tests.comm.worlds import get, world


@pytest.mark.parametrize("p_kind", ["alltoall", "allgather"])
def test_sync_free_exchanges_match_reference_without_host_reads(p_kind):
    for r in get(world(4), f"device_counts_p_{p_kind}"):
        assert r["sync_free"] is True
        assert r["kinds"]["P"] == ("PaddedAllToAllDomain" if p_kind == "alltoall" else "AllGatherExchange")
        assert r["kinds"]["D"] == "LowLatencyAllToAllDomain"
        for name, errors in r["errors"].items():
            assert len(errors) == 4 and max(errors) < 1e-5, (name, errors)
        assert r["host_reads"] == []
        model = r["model"]
        assert max(model["errors"]) < 1e-5 and model["local_experts"] == 2
        assert model["host_reads"] == []


def test_host_counts_do_read_back():
    """The control: the counting sees the host-count exchanges' reads (so the zero above means something)."""
    for reads in get(world(4), "host_counts_reads"):
        assert reads >= 4


def test_deferred_sequence_check_raises_on_every_rank():
    results = get(world(2), "device_sequence_mismatch")
    for rank, r in enumerate(results):
        assert r["error"].startswith(f"SequenceMismatch: D/low_latency on EP rank {rank}: count exchange out of order: "
                                     f"EP rank(s) [{1 - rank}] sent [1] count message(s)")
        assert r["state"] == "retired"
        assert r["after"] is None and r["rows"] == (3, 64)  # a reset on both recovers
