"""Weight hot-swap: versions, validation, copy into persistent buffers, zero-copy bind.

Tensors arrive under full Megatron names (`sharding.full_shapes`); each rank keeps its slice, so a
trainer whose TP/EP layout differs from the rollout's ATP/EP hands over full tensors and this
store reshards them; `gather_full_state` builds those from a sharded trainer's local state.

An update is all-or-nothing. Every name, value type, layout, shape, dtype and value (finite, and
within range of the engine's dtype) is checked before the first parameter is touched; a refused
update leaves the serving version intact, bit for bit. A version may arrive in several chunks
(`final=False` until the last): those chunks are validated and staged (this rank's slices, copied
to host memory, since the caller may reuse its buffers), and the final chunk copies staged and
final tensors in place only once the version is complete. Until then the version before keeps
serving (nothing staged is in the model) and the tokens sampled meanwhile carry its number. A
version sent whole (one `final=True` call) is validated, then copied in place: no staging copy.
A tensor that is the engine's own parameter (an engine sharing a trainer's storage, sent the
trainer's tensors) is neither checked nor copied: it serves already, and only the version moves.
FP8 copies of the weights (`model.fp8`) are re-rounded from the new values in place after every
update.

Checking (`prepare`) and changing the weights (`commit`, `abandon`) are separate steps so that the
engine can let every rank of the model vote between them (`weights.vote`); `update` does
both for one rank. Left out: staging in device memory (it would hold a second model where chunking
exists to bound memory) and rollback of a copy that fails half-way on the device itself.
"""
from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

import torch

from megatron_rollout.comm.facade import Shard
from megatron_rollout.model import fp8, te_layers
from megatron_rollout.model.config import ModelConfig
from megatron_rollout.model.sharding import full_name, full_shapes, local_name, shard_tensor, unshard_tensor
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.weights.megatron_names import rollout_pairs
from megatron_rollout.weights.vote import Prepared, WeightOffer

log = logging.getLogger(__name__)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""Dtypes an update may bring; each is cast to the engine's dtype (e.g. a trainer's fp32 master
weights into a bf16 engine: the rounding every bf16 inference does). Integer, bool, complex and
fp8 tensors are refused rather than cast (fp8 means nothing without its scales)."""


class WeightVersionError(RuntimeError):
    """A stale, out-of-order, malformed or incomplete weight version."""


class _Incoming(NamedTuple):
    """One validated tensor of an update: its full name, and this rank's parameter and slice
    (both None when another rank holds it, e.g. another EP rank's expert)."""

    name: str
    param: torch.nn.Parameter | None
    value: torch.Tensor | None


def _follow_weights(model: MoETransformer) -> None:
    """What is derived from the full-precision weights follows them, in place (so captured graphs
    read it): `model.fp8`'s FP8 copies and Transformer Engine's FP8 weight caches (`model.te_layers`;
    a decode graph replays TE's cache and would never rebuild it itself). One walk over the modules."""
    with torch.no_grad():
        for module in model.modules():
            fp8.requantize_module(module) or te_layers.refresh_module(module)


class WeightStore:
    def __init__(self, model: MoETransformer) -> None:
        self.model = model
        self.version = 0
        self._pending: int | None = None
        self._chunks = 0  # chunks of the pending version staged so far
        self._staged: dict[str, torch.Tensor | None] = {}  # full name -> host copy of this rank's slice
        self._shapes = full_shapes(model.cfg)
        self.shared = False
        """The parameters are another model's own tensors (`bind`, `RolloutEngine.from_megatron` sharing
        storage): the engine holds no copy of them, so sleeping its `weights` moves nothing."""

    @property
    def pending(self) -> int | None:
        """The version being received in chunks (staged, not serving), or None."""
        return self._pending

    def update(self, named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int,
               final: bool = True) -> None:
        """Apply (final) or stage (not final) one chunk of `version` on this rank alone: `prepare`,
        then `commit`, or `abandon` and raise its error. See the module docstring.

        Raises (and changes nothing the engine serves): WeightVersionError for a version that is not
        a new integer or not the pending one, and for a final chunk that leaves tensors unset;
        KeyError for an unknown name; TypeError for a value that is not a dense float tensor;
        ValueError for a wrong shape, a repeated name, a tensor without values (meta), or a value
        that is not finite in the engine's dtype. A refused chunk drops the whole pending version:
        send it again from its first chunk.
        """
        prepared = self.prepare(named, version, final)
        if prepared.error is not None:
            self.abandon()
            raise prepared.error
        self.commit(prepared)

    def prepare(self, named: object, version: object, final: object = True) -> Prepared:
        """Check one chunk without changing anything; a refusal is returned, not raised."""
        chunk = self._chunks if self._pending is not None and self._pending == version else 0
        try:
            if not isinstance(final, bool):
                raise TypeError(f"final must be True or False, got {final!r}")
            version = self._check_version(version)
            if self._pending is not None and version != self._pending:
                raise WeightVersionError(f"version {self._pending} is half-applied; got a chunk of version {version}")
            params = dict(self.model.named_parameters())  # one walk, not one `get_parameter` walk per tensor
            incoming = self._validate(named, version, params)
            if final:
                missing = sorted(set(self._shapes) - set(self._staged) - {t.name for t in incoming})
                if missing:
                    raise WeightVersionError(
                        f"final chunk of version {version} leaves {len(missing)} tensors unset, e.g. {missing[0]}; "
                        f"version {version} was dropped whole and version {self.version} keeps serving: "
                        f"send every tensor again")
        except Exception as exc:  # noqa: BLE001 - every refusal is voted on, then raised by the caller
            text = f"{type(exc).__name__}: {exc}"
            offered = int(version) if isinstance(version, numbers.Integral) and not isinstance(version, bool) else None
            return Prepared(WeightOffer(offered, chunk, bool(final), text[:400]), [], exc)
        return Prepared(WeightOffer(version, chunk, final, None), incoming, None)

    def commit(self, prepared: Prepared) -> None:
        """Stage (non-final) or apply (final) a chunk `prepare` accepted."""
        offer = prepared.offer
        if prepared.error is not None:
            raise ValueError(f"cannot commit {offer.describe()}: it was refused ({offer.refusal})")
        if not offer.final:
            for t in prepared.incoming:
                self._staged[t.name] = None if t.value is None else t.value.detach().to("cpu", copy=True)
            self._pending, self._chunks = offer.version, self._chunks + 1
            return
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, value in self._staged.items():
                local = local_name(name, self.model.cfg, self.model.comm.shard)
                if value is not None and local is not None:
                    params[local].copy_(value)
            for t in prepared.incoming:
                if t.param is not None:
                    t.param.copy_(t.value)
        _follow_weights(self.model)
        self.version, self._pending, self._chunks, self._staged = offer.version, None, 0, {}

    def abandon(self) -> None:
        """Drop the pending version, if any (a refused chunk drops all of it)."""
        if self._pending is not None:
            log.warning("weight version %d dropped (%d staged tensors); version %d keeps serving",
                        self._pending, len(self._staged), self.version)
        self._pending, self._chunks, self._staged = None, 0, {}

    def bind(self, params: Mapping[str, torch.Tensor], version: int) -> None:
        """Zero-copy: point the engine's parameters at a colocated trainer's tensors (same local
        names, shapes, dtypes and devices), for an eager engine; captured graphs need `update`."""
        version = self._check_version(version)
        if self._pending is not None:
            raise WeightVersionError(f"version {self._pending} is half-applied; finish it before bind()")
        own = dict(self.model.named_parameters())
        if set(params) != set(own):
            raise KeyError(f"bind needs exactly the engine's parameters; differ: {sorted(set(params) ^ set(own))[:3]}")
        for name, t in params.items():
            _check_tensor(f"cannot bind {name}", t)
            p = own[name]
            if t.shape != p.shape or t.dtype != p.dtype or t.device != p.device:
                raise ValueError(f"cannot bind {name}: {tuple(t.shape)}/{t.dtype}/{t.device} vs "
                                 f"{tuple(p.shape)}/{p.dtype}/{p.device}; use update() to copy")
        _check_values(list(params.items()), version)
        for name, t in params.items():
            own[name].data = t.detach()
        _follow_weights(self.model)
        self.version, self.shared = version, True

    # -- validation -----------------------------------------------------------------------------
    def _check_version(self, version: object) -> int:
        if isinstance(version, bool) or not isinstance(version, numbers.Integral):
            raise WeightVersionError(f"weight version must be an integer, got {version!r} ({type(version).__name__})")
        if version <= self.version:
            raise WeightVersionError(f"weight version {version} is stale: the engine is at {self.version}")
        return int(version)

    def _validate(self, named: object, version: int, params: dict[str, torch.nn.Parameter]) -> list[_Incoming]:
        """Every tensor of one chunk checked (nothing copied yet): names, types, shapes, dtypes, values."""
        if isinstance(named, Mapping):
            pairs = list(named.items())
        elif isinstance(named, Iterable) and not isinstance(named, (str, bytes, torch.Tensor)):
            pairs = list(named)
        else:
            raise TypeError(f"update_weights takes a mapping or (name, tensor) pairs, got {type(named).__name__}")
        pairs = rollout_pairs(pairs)  # a Megatron state_dict() of either layer spec: `_extra_state` out, TE renamed
        cfg, shard = self.model.cfg, self.model.comm.shard
        seen: set[str] = set()
        serving: set[str] = set()  # the engine's own parameters (shared storage)
        out: list[_Incoming] = []
        for pair in pairs:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise TypeError(f"update_weights takes (name, tensor) pairs, got {pair!r:.80}")
            name, tensor = pair
            if not isinstance(name, str) or name not in self._shapes:
                raise KeyError(f"unknown weight {name!r} (expected Megatron names, e.g. {next(iter(self._shapes))!r})")
            if name in seen or name in self._staged:
                where = "twice in one chunk" if name in seen else "again: an earlier chunk of this version had it"
                raise ValueError(f"weight {name} of version {version} arrived {where}")
            seen.add(name)
            _check_tensor(f"weight {name}", tensor)
            if tuple(tensor.shape) != self._shapes[name]:
                raise ValueError(f"weight {name}: shape {tuple(tensor.shape)}, expected {self._shapes[name]}")
            if tensor.dtype not in FLOAT_DTYPES:
                raise TypeError(f"weight {name}: dtype {tensor.dtype} is refused (not cast); send one of "
                                f"{', '.join(str(d) for d in FLOAT_DTYPES)}")
            local = local_name(name, cfg, shard)
            if local is None:
                out.append(_Incoming(name, None, None))
            elif _is(tensor, params[local]):  # shared storage: already serving, nothing to check or copy
                out.append(_Incoming(name, None, None))
                serving.add(name)
            else:
                out.append(_Incoming(name, params[local], shard_tensor(name, tensor, cfg, shard)))
        # The whole tensor, not this rank's slice: every rank refuses the same update.
        _check_values([(n, t) for n, t in pairs if n not in serving], version, self.model.cfg.torch_dtype)
        return out


def _is(tensor: torch.Tensor, param: torch.Tensor) -> bool:
    """`tensor` is `param`'s own storage, viewed the same way."""
    return (tensor.data_ptr() == param.data_ptr() and tensor.dtype == param.dtype and tensor.shape == param.shape
            and tensor.stride() == param.stride())


def _check_tensor(what: str, tensor: object) -> None:
    """A dense tensor that holds values: sparse, nested or meta tensors are refused by name (torch's
    own failure on them, later, would be a NotImplementedError deep inside a reduction)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout is not torch.strided or tensor.is_nested:
        raise TypeError(f"{what}: layout {tensor.layout} is refused; send a dense tensor (e.g. t.to_dense())")
    if tensor.is_meta:
        raise ValueError(f"{what}: a meta tensor holds no values; send a materialised tensor")


def _check_values(named: list[tuple[str, torch.Tensor]], version: int, target: torch.dtype | None = None) -> None:
    """Refuse NaN, infinities, and values beyond `target`'s range (they would become inf): one
    min/max reduction per tensor (a read, no copy), one host sync per device and dtype."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (_, t) in enumerate(named):
        if t.numel():
            groups.setdefault((t.device, t.dtype), []).append(i)
    limit = torch.finfo(target).max if target is not None else float("inf")
    for indices in groups.values():
        lows, highs = zip(*(torch.aminmax(named[i][1].detach()) for i in indices))
        stats = torch.stack(lows + highs).tolist()
        for i, lo, hi in zip(indices, stats[:len(indices)], stats[len(indices):]):
            if not (math.isfinite(lo) and math.isfinite(hi)):
                kind = "NaN" if math.isnan(lo) or math.isnan(hi) else "an infinity"
                raise ValueError(f"weight {named[i][0]} of version {version} holds {kind}; refused "
                                 f"(the serving version is unchanged): check the trainer's step")
            if max(-lo, hi) > limit:
                raise ValueError(f"weight {named[i][0]} of version {version} holds {max(-lo, hi):.4g}, beyond "
                                 f"{target}'s range ({limit:.4g}); refused rather than cast to inf")


class ShardPiece(NamedTuple):
    """One rank's slice of a full-named tensor, as `gather_full_state` gathers it."""

    atp_rank: int
    tensor: torch.Tensor


def gather_full_state(local_state: Mapping[str, torch.Tensor], cfg: ModelConfig, shard: Shard,
                      all_gather_object: Callable[[object], list]) -> dict[str, torch.Tensor]:
    """Full tensors from a sharded trainer: every rank passes its local (Megatron-named, TP-sliced,
    locally numbered experts) state and its `Shard`; `all_gather_object` gathers a Python object
    over ranks that together hold the whole model (e.g. `DistComm.all_gather_object` or
    `torch.distributed.all_gather_object` over the model-parallel group). Portable and simple,
    it moves tensors through the CPU; a trainer that already holds full tensors skips it."""
    mine = {full_name(n, cfg, shard): ShardPiece(shard.atp_rank, t.detach().cpu()) for n, t in local_state.items()}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for entry in all_gather_object(mine):
        for name, piece in entry.items():
            parts.setdefault(name, {}).setdefault(piece.atp_rank, piece.tensor)
    missing = sorted(set(full_shapes(cfg)) - set(parts))
    if missing:
        raise KeyError(f"no rank holds {missing[0]} ({len(missing)} tensors missing): gather over every "
                       f"model-parallel rank")
    return {name: unshard_tensor(name, [parts[name][r] for r in sorted(parts[name])], cfg) for name in full_shapes(cfg)}
