"""Transformer Engine FP8 path for the native model's linears (and, where TE can do it without a host
sync, its routed experts).

Why: the design (docs/design.md) names TE's FP8 layers; `fp8.py` quantises weights to its own e4m3 copy and runs
`torch._scaled_mm`. Here TE keeps the scales instead (delayed, current, or Hopper 128x128 block
scaling, picked by `TEConfig.recipe`), and its modules read **the model's own bf16 weight storage**:
each matching `Linear` gets a `TEWeight` in its `fp8` slot (the slot `Linear.forward` already
dispatches through, as the FP8 backend registry does) holding a `te.pytorch.Linear` whose `weight`
is the same storage as the `Linear.weight` parameter. The TE module is not a registered submodule,
so `state_dict()` names stay Megatron's and `update_weights`' in-place copies land in TE's weight.

TE caches its FP8 copy of each weight (`is_first_microbatch=False`); the cache is refreshed in
place (stable addresses, so captured decode graphs stay valid) on the first eager call after the
weight's `_version` changed, or by `refresh_te(model)`, which callers must run after a weight
update and before replaying graphs captured earlier.

Experts: `te.pytorch.GroupedLinear` is used only when its native grouped-tensor path applies (device
`m_splits`, no host sync; TE 2.20 needs Hopper and cuBLASLt >= 13.4 for bf16, 13.5 for current
scaling, 13.6 for block scaling, and has no delayed scaling there; torch 2.11's wheels bring 13.1,
benchmarks/device/te_session.sh carries 13.6). Of the FP8 recipes that leaves current scaling: block
scaling's grouped quantize needs every expert's rows to be a multiple of 128. A grouped GEMM takes
at most `TE_MAX_GROUPS` experts, so larger layers run in chunks (`TEGroupedExperts`). Otherwise TE
falls back to a path that reads the splits on the host, which breaks sync-free decode and graphs,
and per-expert `te.Linear` is too slow, so the experts stay on their existing path and `TEResult`
says why.

Left out: gradients through TE (rollout is inference), tensor-parallel TE modules (ATP > 1 here is
the model's own collectives around local shards), MXFP8/NVFP4 recipes (Blackwell).
"""
from __future__ import annotations

import fnmatch
import functools
import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

RECIPES = ("delayed", "current", "block")
DEFAULT_INCLUDE = ("*linear_qkv", "*linear_proj", "*mlp.linear_fc1", "*mlp.linear_fc2")
INSTALL_HINT = ("Transformer Engine is not importable: install it beside your CUDA torch "
                "(pip install transformer-engine-cu13 transformer-engine-torch; docs/fp8-te.md shows a source "
                "build of its torch part where no wheel matches, with benchmarks/device/te_session.sh)")
_ROW_MULTIPLE = 16  # TE's FP8 GEMMs need leading dims % 8 (block scaling: % 16 is the safe choice)


@dataclass(frozen=True)
class TEConfig:
    recipe: str = "current"
    """'delayed' (per-tensor, scale from an amax history), 'current' (per-tensor, scale from this
    call's amax), or 'block' (1x128 activation / 128x128 weight blocks; Hopper, CUDA >= 12.9)."""
    include: tuple[str, ...] = DEFAULT_INCLUDE
    """fnmatch patterns over module names of `Linear` layers to put on TE. The default covers
    attention (QKV, projection) and dense MLPs; routed and shared experts are not matched."""
    experts: bool = True
    """Put routed experts on `GroupedLinear` where its sync-free path applies (see module docstring)."""
    amax_history_len: int = 16
    """Delayed scaling only: the amax history window."""

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"unknown TE recipe {self.recipe!r}; choose one of {RECIPES}")
        if self.amax_history_len <= 0:
            raise ValueError(f"amax_history_len must be positive, got {self.amax_history_len}")
        if not self.include:
            raise ValueError("TEConfig.include is empty: name at least one Linear pattern")


@dataclass(frozen=True)
class TEResult:
    linears: tuple[str, ...]
    """Module names whose `Linear` now runs through TE."""
    experts: tuple[str, ...]
    """`Experts` modules now on `GroupedLinear`."""
    experts_skipped: str | None = None
    """Why routed experts stayed on their existing path (None when none were skipped)."""
    versions: dict = field(default_factory=dict)


class TEUnavailable(RuntimeError):
    """Transformer Engine (or the FP8 recipe asked for) is not available here; the message says why
    and how to get it."""


@functools.lru_cache(maxsize=None)
def te_missing() -> str | None:
    """None when `transformer_engine.pytorch` imports; otherwise why not and how to fix it."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, OSError, RuntimeError, AssertionError) as exc:  # TE raises all of these at import
        return f"{INSTALL_HINT} ({type(exc).__name__}: {exc})"
    return None


def _te():
    why = te_missing()
    if why:
        raise TEUnavailable(why)
    import transformer_engine.pytorch as te

    return te


def make_recipe(cfg: TEConfig):
    """The TE recipe object for `cfg.recipe` (constructor arguments as in TE 2.20's common/recipe)."""
    _te()
    from transformer_engine.common import recipe as r

    if cfg.recipe == "delayed":
        return r.DelayedScaling(fp8_format=r.Format.E4M3, amax_history_len=cfg.amax_history_len,
                                amax_compute_algo="max")
    if cfg.recipe == "current":
        return r.Float8CurrentScaling(fp8_format=r.Format.E4M3)
    return r.Float8BlockScaling(fp8_format=r.Format.E4M3)


def recipe_unavailable(cfg: TEConfig) -> str | None:
    """None when this device can run `cfg.recipe`; otherwise TE's reason."""
    te = _te()
    ok, why = te.is_fp8_available(return_reason=True)
    if ok and cfg.recipe == "block":
        ok, why = te.is_fp8_block_scaling_available(return_reason=True)
    return None if ok else f"recipe {cfg.recipe!r} unavailable here: {why}"


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class TEWeight:
    """Sits in `Linear.fp8`: `matmul(x)` runs the TE module on the Linear's own weight storage."""

    backend = "transformer_engine"

    def __init__(self, owner: nn.Module, recipe, te_module: nn.Module) -> None:
        self.owner, self.recipe, self.module = owner, recipe, te_module
        self.seen_version = -1  # the owner's weight `_version` TE's FP8 cache was built from
        self.bind()

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.owner.weight.shape)

    def bind(self) -> None:
        """Point the TE module's weight at the owner's current storage (again after a re-bind)."""
        w = self.owner.weight
        self.module.weight.data = w.data
        self.module.weight.requires_grad_(False)
        self.seen_version = -1

    def matmul(self, x: torch.Tensor, refresh: bool | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype; rows are padded to TE's FP8 multiple."""
        te = _te()
        if self.module.weight.data_ptr() != self.owner.weight.data_ptr():
            self.bind()
        lead, k = x.shape[:-1], x.shape[-1]
        a = x.reshape(-1, k)
        m = a.shape[0]
        if m % _ROW_MULTIPLE:
            a = F.pad(a, (0, 0, 0, -m % _ROW_MULTIPLE))
        if refresh is None:  # inside a capture the cache must already exist: never re-quantise there
            refresh = not _capturing() and self.seen_version != self.owner.weight._version
        with te.autocast(enabled=True, recipe=self.recipe):
            y = self.module(a, is_first_microbatch=refresh)
        if refresh:
            self.seen_version = self.owner.weight._version
        return y[:m].view(*lead, y.shape[-1])

    def refresh(self) -> None:
        """Re-quantise TE's cached FP8 weight in place from the current bf16 weight."""
        w = self.owner.weight
        self.matmul(torch.zeros(_ROW_MULTIPLE, w.shape[1], dtype=w.dtype, device=w.device), refresh=True)


TE_MAX_GROUPS = 64
"""Experts per `GroupedLinear` call: TE 2.20's cuBLASLt grouped GEMM takes at most 64 groups
(`kMaxGroups`, seen on the H200 with 128 experts). More experts run as several chunks."""


@dataclass
class _Chunk:
    """Experts [first, stop) of one layer as two `GroupedLinear`s (fc1: H -> 2F, fc2: F -> H)."""

    first: int
    stop: int
    fc1: nn.Module
    fc2: nn.Module


class TEGroupedExperts:
    """Routed experts' two projections as `GroupedLinear`s over the stacked expert weights, in
    chunks of at most `TE_MAX_GROUPS` experts.

    A chunk after the first starts at a row only the device knows (the expert-sorted offsets), so
    its rows are rotated to the front with one gather (TE reads the first sum(splits) rows of its
    input and leaves the rest), and its output rotated back and kept where the rows are its own:
    no host sync, so decode graphs capture it."""

    def __init__(self, experts: nn.Module, recipe, chunks: list[_Chunk]) -> None:
        self.experts, self.recipe, self.chunks = experts, recipe, chunks
        self.seen = (-1, -1)
        self.bind()

    @classmethod
    def build(cls, experts: nn.Module, recipe, te) -> TEGroupedExperts:
        experts.restack()
        fc1, fc2 = experts._stacked
        e, two_f, h = fc1.shape
        chunks = []
        for first in range(0, e, TE_MAX_GROUPS):
            n = min(TE_MAX_GROUPS, e - first)
            g1 = te.GroupedLinear(n, h, two_f, bias=False, params_dtype=fc1.dtype, device=fc1.device,
                                  use_grouped_tensor=True)
            g2 = te.GroupedLinear(n, fc2.shape[2], h, bias=False, params_dtype=fc2.dtype, device=fc2.device,
                                  use_grouped_tensor=True)
            chunks.append(_Chunk(first, first + n, g1, g2))
        return cls(experts, recipe, chunks)

    def bind(self) -> None:
        st = self.experts.stacked()
        if st is None:
            raise RuntimeError("TE experts need stacked bf16 expert weights: call Experts.restack() first")
        for c in self.chunks:
            for grouped, stacked in ((c.fc1, st[0]), (c.fc2, st[1])):
                for i in range(c.stop - c.first):
                    p = getattr(grouped, f"weight{i}")
                    p.data = stacked[c.first + i]
                    p.requires_grad_(False)
        self.seen = (-1, -1)

    def _versions(self) -> tuple[int, int]:
        st = self.experts._stacked
        return (st[0]._version, st[1]._version)

    def grouped_offsets(self, x: torch.Tensor, offsets: torch.Tensor, refresh: bool | None = None) -> torch.Tensor:
        """`Experts.grouped_offsets` on TE: x [n, H] expert-sorted, offsets [E] cumulative (device)."""
        te = _te()
        st = self.experts.stacked()
        if st is None or self.chunks[0].fc1.weight0.data_ptr() != st[0].data_ptr():
            self.bind()
        ends = offsets.to(torch.int64)
        splits = torch.diff(ends, prepend=ends.new_zeros(1))
        if refresh is None:
            refresh = not _capturing() and self.seen != self._versions()
        with te.autocast(enabled=True, recipe=self.recipe):
            if len(self.chunks) == 1:
                out = self._project(self.chunks[0], x, splits, refresh)
            else:
                n = x.shape[0]
                rows = torch.arange(n, device=x.device)
                out = torch.zeros_like(x)
                for c in self.chunks:
                    start = ends[c.first - 1] if c.first else ends.new_zeros(())
                    xs = x.index_select(0, (rows + start) % n)  # this chunk's rows first
                    y = self._project(c, xs, splits[c.first:c.stop], refresh).index_select(0, (rows - start) % n)
                    out = torch.where(((rows >= start) & (rows < ends[c.stop - 1])).unsqueeze(1), y, out)
        if refresh:
            self.seen = self._versions()
        return out

    def _project(self, c: _Chunk, x: torch.Tensor, splits: torch.Tensor, refresh: bool) -> torch.Tensor:
        h = c.fc1(x, splits, is_first_microbatch=refresh)
        return c.fc2(self.experts.activation(h), splits, is_first_microbatch=refresh)

    def refresh(self) -> None:
        st = self.experts._stacked
        e, _, h = st[0].shape
        x = torch.zeros(_ROW_MULTIPLE * e, h, dtype=st[0].dtype, device=st[0].device)
        offsets = torch.arange(1, e + 1, device=x.device, dtype=torch.int32) * _ROW_MULTIPLE
        self.grouped_offsets(x, offsets, refresh=True)


def experts_unsupported(cfg: TEConfig, dtype: torch.dtype) -> str | None:
    """None when GroupedLinear's sync-free (device m_splits) path runs `cfg.recipe` on this device."""
    _te()
    from transformer_engine.pytorch.module import grouped_linear as gl

    if cfg.recipe == "block":
        return ("TE 2.20's grouped FP8 block-scaling quantize needs every expert's row count to be a multiple "
                "of 128 (seen on the H200: NaN otherwise), which routed batches are not: experts stay on their "
                "existing path")
    recipe = make_recipe(cfg)
    if gl.is_module_grouped_tensor_path_supported(recipe, dtype):
        return None
    import transformer_engine_torch as tex

    return (f"GroupedLinear's device-split path does not support recipe {cfg.recipe!r} / {dtype} here "
            f"(cuBLASLt {tex.get_cublasLt_version()}; TE 2.20 needs >= 130400 bf16, 130500 current, "
            f"130600 block on Hopper, and has no delayed scaling there): experts stay on their existing path")


def te_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("transformer-engine", "transformer-engine-cu13", "transformer-engine-torch", "torch"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def apply_te(model: nn.Module, cfg: TEConfig = TEConfig()) -> TEResult:
    """Put the model's matching `Linear`s (and, where feasible, routed experts) on TE, in place."""
    from megatron_rollout.model.layers import Experts, Linear

    te = _te()
    why = recipe_unavailable(cfg)
    if why:
        raise TEUnavailable(why)
    recipe = make_recipe(cfg)
    linears = []
    for name, module in model.named_modules():
        if isinstance(module, Linear) and any(fnmatch.fnmatchcase(name, p) for p in cfg.include):
            out_f, in_f = module.weight.shape
            if out_f % 16 or in_f % 16:
                raise ValueError(f"{name}: weight shape {tuple(module.weight.shape)} is not a multiple of 16, "
                                 "which TE's FP8 GEMMs need; leave it out of TEConfig.include")
            layer = te.Linear(in_f, out_f, bias=False, params_dtype=module.weight.dtype, device=module.weight.device)
            module.fp8 = TEWeight(module, recipe, layer)
            linears.append(name)
    if not linears:
        raise ValueError(f"no Linear layer matches {cfg.include}")
    experts, skipped = [], None
    moe = [(n, m) for n, m in model.named_modules() if isinstance(m, Experts)]
    if moe and cfg.experts:
        skipped = experts_unsupported(cfg, moe[0][1].local_experts[0].linear_fc1.weight.dtype)
        if skipped is None:
            for name, ex in moe:
                ex.te = TEGroupedExperts.build(ex, recipe, te)
                ex.grouped_offsets = ex.te.grouped_offsets  # instance attribute: the CUDA paths call this
                experts.append(name)
    elif moe:
        skipped = "TEConfig.experts is False"
    if skipped:
        log.warning("%s", skipped)
    log.info("TE %s recipe on %d linears and %d expert groups", cfg.recipe, len(linears), len(experts))
    return TEResult(tuple(linears), tuple(experts), skipped, te_versions())


def remove_te(model: nn.Module) -> int:
    """Undo `apply_te`: the model's own bf16 paths again. Returns the modules restored."""
    from megatron_rollout.model.layers import Experts, Linear

    n = 0
    for module in model.modules():
        if isinstance(module, Linear) and isinstance(module.fp8, TEWeight):
            module.fp8 = None
            n += 1
        elif isinstance(module, Experts) and "te" in module.__dict__:
            del module.grouped_offsets
            del module.te
            n += 1
    return n


def refresh_module(module: nn.Module) -> bool:
    """Re-quantise `module`'s TE weight cache in place if it has one (a `Linear` on TE, or routed
    experts on `GroupedLinear`; call under `torch.no_grad()`). Dict lookups for every other module."""
    slot = module.__dict__.get("fp8") or module.__dict__.get("te")  # `Linear.fp8`, or `Experts.te`
    if not isinstance(slot, (TEWeight, TEGroupedExperts)):
        return False
    slot.refresh()
    return True


def refresh_te(model: nn.Module) -> int:
    """Re-quantise every TE weight cache from the current weights (after `update_weights`, before
    replaying graphs captured earlier; the weight store does it). Returns the number refreshed."""
    with torch.no_grad():
        return sum(refresh_module(m) for m in model.modules())
