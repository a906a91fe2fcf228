"""The package's import graph keeps the shape of DESIGN.md §3: no cycles, no import downwards-up.

Every `.py` file under `megatron_rollout/` and `rl/` is parsed with `ast` (nothing is imported).
All imports count: module level, inside functions, and under `if TYPE_CHECKING:`. A type-only
import is still a dependency of the design (a lower layer that names a higher layer's type has to
know it), so it counts for the layer order and for cycles alike. `from pkg import name` resolves
to `pkg.name` when that is a module, else to `pkg`; importing a submodule is not counted as an
import of its parent package's `__init__`.

Layers, low to high (`LAYERS`). A module may import its own package (any module of it; cycles
inside a package are still refused) and any package of a lower layer; packages of one layer are
peers and import neither each other nor anything above. Third-party imports are ignored.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS: list[tuple[str, ...]] = [
    ("megatron_rollout.types", "megatron_rollout.forward", "megatron_rollout.tokenizer"),  # the ground floor
    ("megatron_rollout.comm",),  # phase-owned communicators, dispatch domains, collective sites
    ("megatron_rollout.model",),  # the native MoE transformer (calls only the comm facade)
    ("megatron_rollout.kv",),  # paged KV store and block pool (an AttentionBackend of the model)
    ("megatron_rollout.kernels", "megatron_rollout.multiplex"),  # device fast paths | turnstile, routing
    ("megatron_rollout.engine",),  # planner, bookkeeping, execution, schedules, runners
    ("megatron_rollout.trace",),  # trace replay and reports over the engine's public API
    ("megatron_rollout.sim",),  # the engine simulated on a trace, its costs fitted from step records
    ("megatron_rollout.bench", "megatron_rollout.distributed", "megatron_rollout.options"),
    ("megatron_rollout.launch",),  # what the CLI runs
    ("megatron_rollout.cli",),
    ("megatron_rollout",),  # the package's own __init__
    ("rl",),  # the RL loop sits on top of the rollout package
]


def _modules() -> dict[str, Path]:
    out = {}
    for top in ("megatron_rollout", "rl"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports_of(name: str, source: str, known: set[str], is_package: bool = False) -> set[str]:
    """The project modules `name` imports (all of them: module level, functions, TYPE_CHECKING)."""
    found = set()
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a non-module attribute path
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    known = set(modules)
    return {name: imports_of(name, path.read_text(), known, path.name == "__init__.py")
            for name, path in modules.items()}


def layer_of(module: str) -> tuple[int, str]:
    """(layer index, owning package) of the most specific entry of `LAYERS` that holds `module`."""
    best = None
    for i, packages in enumerate(LAYERS):
        for pkg in packages:
            if module == pkg or module.startswith(pkg + "."):
                if best is None or len(pkg) > len(best[1]):
                    best = (i, pkg)
    if best is None:
        raise AssertionError(f"module {module} is in no layer: add its package to LAYERS in {__file__}")
    return best


def violations(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in sorted(edges.items()):
        (ls, ps) = layer_of(src)
        for dst in sorted(targets):
            (ld, pd) = layer_of(dst)
            if pd == ps or ld < ls:
                continue
            why = "a peer of its layer" if ld == ls else "a higher layer"
            bad.append(f"{src} (layer {ls}: {ps}) imports {dst} ({why}, layer {ld}: {pd})")
    return bad


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan), as sorted lists."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def test_the_graph_is_read():
    edges = graph(_modules())
    assert "megatron_rollout.engine.engine" in edges
    assert "megatron_rollout.types" in edges["megatron_rollout.comm.facade"]
    assert "megatron_rollout.comm.facade" in edges["megatron_rollout.model.layers"]


def test_no_import_cycles():
    found = cycles(graph(_modules()))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_imports_follow_the_layer_order():
    found = violations(graph(_modules()))
    assert not found, "imports against the layer order (LAYERS, low to high):\n" + "\n".join(found)


def test_the_checks_can_fail():
    edges = {"megatron_rollout.comm.dist": {"megatron_rollout.multiplex.routing"},
             "megatron_rollout.multiplex.routing": {"megatron_rollout.comm.dist"},
             "megatron_rollout.kernels.moe": {"megatron_rollout.multiplex.turnstile"}}
    assert cycles(edges) == [["megatron_rollout.comm.dist", "megatron_rollout.multiplex.routing"]]
    assert violations(edges) == [
        "megatron_rollout.comm.dist (layer 1: megatron_rollout.comm) imports megatron_rollout.multiplex.routing "
        "(a higher layer, layer 4: megatron_rollout.multiplex)",
        "megatron_rollout.kernels.moe (layer 4: megatron_rollout.kernels) imports megatron_rollout.multiplex.turnstile "
        "(a peer of its layer, layer 4: megatron_rollout.multiplex)"]
    known = {"megatron_rollout.types", "megatron_rollout.engine", "megatron_rollout.engine.api"}
    src = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megatron_rollout.engine import api\n"
           "def f():\n    import megatron_rollout.types\n")
    assert imports_of("megatron_rollout.x", src, known) == {"megatron_rollout.engine.api", "megatron_rollout.types"}
