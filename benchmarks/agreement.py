"""Whether two replays of one trace generated the same tokens, turn by turn.

A closed-loop replay feeds each turn's generated ids back into the conversation's next prompt, so
two engines (or two passes of one) that compute one function greedily should generate the same ids
for every turn, up to ties that bf16 sums in another order can break. Each replay keeps a short
digest of every turn's generated ids (`digest`), keyed by `turn_key`: ours in each timed repeat of
`benchmarks.rollout` (`digests`), the peer's in each pass report of `benchmarks.vllm_peer`. A
digest is 8 bytes of BLAKE2b over the ids as int64, so equal digests mean equal ids but for a
1-in-2^64 chance. Once one turn of a conversation differs, its later prompts differ too, so later
turns are compared as the engines saw them, not as one reference would have them.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np


def digest(ids: Sequence[int]) -> str:
    """16 hex digits standing for the token ids `ids` (order and length included)."""
    return hashlib.blake2b(np.asarray(ids, dtype=np.int64).tobytes(), digest_size=8).hexdigest()


def turn_key(conversation: Any, turn: int) -> str:
    return f"{conversation}/{turn}"


def replay_digests(outputs: Iterable[Any], conversation_of: Mapping[int, Any], turn_of: Mapping[int, Any]
                   ) -> dict[str, str]:
    """Our replay's digests from its finished requests (`trace.replay`'s outputs and details)."""
    return {turn_key(conversation_of[o.request_id], turn_of[o.request_id].turn): digest(o.result.token_ids)
            for o in outputs}


def compare(a: Mapping[str, str], b: Mapping[str, str]) -> dict[str, int]:
    """How many of the turns both replays finished generated the same ids, how many conversations
    agree on every such turn, and in how many the first turn both finished already differs (no
    earlier turn's text can have led the two apart there: only how its forwards were computed)."""
    common = a.keys() & b.keys()
    differ = {k for k in common if a[k] != b[k]}
    conversations = {k.rpartition("/")[0] for k in common}
    split = {k.rpartition("/")[0] for k in differ}
    first: dict[str, str] = {}
    for k in sorted(common, key=lambda k: int(k.rpartition("/")[2])):
        first.setdefault(k.rpartition("/")[0], k)
    return {"turns": len(common) - len(differ), "of": len(common),
            "conversations": len(conversations - split), "of_conversations": len(conversations),
            "first_turn_differs": sum(k in differ for k in first.values())}


SAMPLED_AGREEMENT = "sampled: vLLM's sampler is not ours, so its tokens are not expected to match ours"
"""Why a sampled run's peer agrees with ours on no turn, and that this is no fault."""


def sampled_at(result: dict[str, Any]) -> float:
    """The temperature the run's replays sampled at (0: greedy)."""
    return float((result.get("args") or {}).get("temperature") or 0.0)


def agreement(result: dict[str, Any]) -> dict[str, Any] | None:
    """A `benchmarks.rollout` result's agreement: every timed repeat of ours and every timed pass of the
    peer set against our first repeat that kept digests, and the peer's passes against its first of
    the same setting; a sampled run is marked (`sampled`: our replays draw each turn from one seed and
    may still agree, the peer draws with another sampler). None where no repeat of ours kept digests."""
    ours = [(name, r["digests"]) for name, s in result.get("schedules", {}).items()
            for r in s.get("repeats") or [] if r.get("digests")]
    if not ours:
        return None
    reference = ours[0][1]
    out: dict[str, Any] = {"reference": ours[0][0], "ours": [{"schedule": n, **compare(reference, d)} for n, d in ours]}
    peer = {}
    for budget, entry in ((result.get("vllm") or {}).get("budgets") or {}).items():
        passes = [p["digests"] for p in entry.get("passes") or [] if p.get("digests")]
        if passes:
            peer[budget] = {"with_ours": [compare(reference, d) for d in passes],
                            "with_its_first": [compare(passes[0], d) for d in passes[1:]]}
    if peer:
        out["vllm"] = peer
    if sampled_at(result) > 0:
        out["sampled"] = {"temperature": sampled_at(result), "note": SAMPLED_AGREEMENT}
    return out


def _span(comparisons: Sequence[dict[str, int]]) -> str:
    same = sorted(c["turns"] for c in comparisons)
    return f"{same[0]}" if same[0] == same[-1] else f"{same[0]}-{same[-1]}"


def agreement_note(result: dict[str, Any]) -> str | None:
    """One line: how many turns our replays and the peer's passes generated alike; None without digests.
    A sampled run says its temperature, and, beside a peer, that the peer's tokens cannot match."""
    a = agreement(result)
    if a is None:
        return None
    total, t = a["ours"][0]["of"], sampled_at(result)
    alike = f"at temperature {t:g}, tokens alike" if t > 0 else "greedy tokens alike"
    parts = [f"{alike} on {_span(a['ours'])} of {total} turns across our {len(a['ours'])} replays"]
    for budget, p in (a.get("vllm") or {}).items():
        part = f"vLLM@{budget} {_span(p['with_ours'])} with ours"
        if p["with_its_first"]:
            part += f", {_span(p['with_its_first'])} between its passes"
        parts.append(part)
    line = "; ".join(parts)
    return f"{line} ({SAMPLED_AGREEMENT})" if t > 0 and a.get("vllm") else line
