"""The conflict registry derived from the layout and the phases' real paths (routing.derive_conflicts):
recorded on 4 gloo ranks (ATP2/ADP2), each phase's forward issues exactly the collectives
`phase_path` says for its exchange kind, and the registered D collectives are ones D issues.
With the default `d_exchange="alltoall"` D never issues the ADP all-gather, and the derived
conflict is P's ADP all-gather against D's EP exchange instead.
"""
from __future__ import annotations

from megatron_rollout.comm.facade import CollectiveSite
from megatron_rollout.multiplex.routing import derive_for_exchanges, megatron_groups, phase_path
from megatron_rollout.types import Axis

AG_ADP, AR_FULL = CollectiveSite("all_gather", Axis.ADP), CollectiveSite("all_reduce", Axis.FULL)
A2A_EP = CollectiveSite("all_to_all", Axis.EP)


def pairs(reg) -> set[tuple[CollectiveSite, CollectiveSite]]:
    return {(c.p_site, c.d_site) for p in (AG_ADP, AR_FULL, A2A_EP, CollectiveSite("all_reduce", Axis.ATP),
                                           CollectiveSite("all_gather", Axis.ATP)) for c in reg.conflicts_of(p)}


def test_derived_conflicts_per_layout_and_exchange():
    assert pairs(derive_for_exchanges(2, 2, "allgather", "allgather")) == {(AR_FULL, AG_ADP), (AG_ADP, AR_FULL)}
    assert pairs(derive_for_exchanges(2, 2, "allgather", "alltoall")) == {(AG_ADP, A2A_EP)}
    assert pairs(derive_for_exchanges(2, 4, "alltoall", "allgather")) == {(A2A_EP, AG_ADP)}
    assert pairs(derive_for_exchanges(2, 2, "alltoall", "alltoall")) == set()
    for atp, adp in ((4, 1), (1, 4), (1, 1)):  # one non-trivial axis: nothing is crossed
        for p in ("allgather", "alltoall"):
            for d in ("allgather", "alltoall"):
                assert len(derive_for_exchanges(atp, adp, p, d)) == 0, (atp, adp, p, d)
    assert megatron_groups(2, 2)[Axis.ADP] == ((0, 2), (1, 3))


def test_each_phase_issues_its_derived_path_and_the_registry_names_what_d_issues(engine_worlds):
    res = [r["issued"] for r in engine_worlds[4]]
    for r in res:
        assert isinstance(r, dict), r
    for rank, r in enumerate(res):
        groups = {Axis(a): tuple(g) for a, g in r["groups"].items()}
        assert groups == {axis: next(g for g in megatron_groups(2, 2)[axis] if rank in g) for axis in Axis}

        def expected(kind):
            return sorted({(s.op, groups[s.axis]) for sites in phase_path(kind).values() for s in sites})

        for kind in ("allgather", "alltoall"):
            assert r[("P", kind)] == expected(kind), (rank, kind)
            assert r[("D", kind)] == expected(kind), (rank, kind)
        # What D really issues contains every D collective the registry orders P against.
        for p_kind in ("allgather", "alltoall"):
            for d_kind in ("allgather", "alltoall"):
                for _, d_site in pairs(derive_for_exchanges(2, 2, p_kind, d_kind)):
                    assert (d_site.op, groups[d_site.axis]) in r[("D", d_kind)], (p_kind, d_kind, d_site)
        assert ("all_gather", groups[Axis.ADP]) not in r[("D", "alltoall")]  # the issue's observation
