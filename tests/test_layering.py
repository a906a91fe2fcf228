"""The package's import graph keeps the shape of docs/design.md §3: no cycles, no import downwards-up.

Every `.py` file under `megatron_rollout/`, `rl/` and `benchmarks/` is parsed with `ast` (nothing is imported).
All imports count: module level, inside functions, and under `if TYPE_CHECKING:`. A type-only
import is still a dependency of the design (a lower layer that names a higher layer's type has to
know it), so it counts for the layer order and for cycles alike. `from pkg import name` resolves
to `pkg.name` when that is a module, else to `pkg`; importing a submodule is not counted as an
import of its parent package's `__init__`.

Layers, low to high (`LAYERS`). A module may import its own package (any module of it; cycles
inside a package are still refused) and any package of a lower layer; packages of one layer are
peers and import neither each other nor anything above. Third-party imports are ignored.

Code outside the package (`OUTSIDE`) uses only its public names: no `_name` imported from it, and
no `obj._name` where `_name` is private to the package (defined there as a function, class,
module name or attribute) or `obj` is one of its modules (`private_uses`).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS: list[tuple[str, ...]] = [
    ("megatron_rollout.types", "megatron_rollout.forward", "megatron_rollout.tokenizer",
     "megatron_rollout.vmm"),  # the ground floor
    ("megatron_rollout.comm",),  # phase-owned communicators, dispatch domains, collective sites
    ("megatron_rollout.model",),  # the native MoE transformer (calls only the comm facade)
    ("megatron_rollout.kv",),  # paged KV store and block pool (an AttentionBackend of the model)
    ("megatron_rollout.weights",),  # the weight store, the update vote, the Megatron bridge
    ("megatron_rollout.kernels", "megatron_rollout.multiplex"),  # device fast paths | turnstile, routing
    ("megatron_rollout.runner", "megatron_rollout.drafts"),  # device execution: the runner contract, the portable
    # and CUDA runners | draft sources that need no model (host-side token logic)
    ("megatron_rollout.engine",),  # planner, bookkeeping, execution, schedules
    ("megatron_rollout.trace", "megatron_rollout.aio"),  # trace replay and reports | asyncio face; public API only
    ("megatron_rollout.sim",),  # the engine simulated on a trace, its costs fitted from step records
    ("megatron_rollout.distributed", "megatron_rollout.options"),
    ("megatron_rollout.launch",),  # what the CLI runs
    ("megatron_rollout.cli",),
    ("megatron_rollout",),  # the package's own __init__
    ("rl",),  # the RL loop sits on top of the rollout package
    ("benchmarks",),  # measurements of the package, outside it (not installed)
]

OUTSIDE = ("rl", "benchmarks", "examples")
"""Code that uses the package as a user does: only its public names (tests, which check the
package from inside, may reach its private parts)."""


def _modules() -> dict[str, Path]:
    out = {}
    for top in ("megatron_rollout", "rl", "benchmarks"):
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


def package_privates() -> set[str]:
    """Every single-underscore name the package defines: functions, classes, module-level names,
    attributes assigned on `self`, and modules."""
    names = set()
    for path in (ROOT / "megatron_rollout").rglob("*.py"):
        if path.stem.startswith("_") and not path.stem.startswith("__"):
            names.add(path.stem)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(source: str, privates: set[str]) -> list[str]:
    """`line: text` of each use of a private name of the package in `source` (code outside it)."""
    tree = ast.parse(source)
    ours, theirs = set(), set()  # names bound by imports of the package / of anything else
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level:
            module = node.module or ""
            inside = module == "megatron_rollout" or module.startswith("megatron_rollout.")
            if inside and any(_private(part) for part in module.split(".")):
                found.append(f"{node.lineno}: from {module} import ...")
            for alias in node.names:
                if inside and _private(alias.name):
                    found.append(f"{node.lineno}: from {module} import {alias.name}")
                (ours if inside else theirs).add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                inside = alias.name.split(".")[0] == "megatron_rollout"
                if inside and any(_private(part) for part in alias.name.split(".")):
                    found.append(f"{node.lineno}: import {alias.name}")
                (ours if inside else theirs).add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            name = root.id if isinstance(root, ast.Name) else None
            if name in ("self", "cls") or (name in theirs and name not in ours):
                continue
            if name in ours or node.attr in privates:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(set(found), key=lambda f: int(f.split(":")[0]))


def test_nothing_outside_the_package_uses_its_private_names():
    privates = package_privates()
    found = [f"{path.relative_to(ROOT)}:{use}" for top in OUTSIDE for path in sorted((ROOT / top).rglob("*.py"))
             for use in private_uses(path.read_text(), privates)]
    assert not found, ("private names of megatron_rollout used outside it (make what they need public, "
                       "documented API):\n" + "\n".join(found))


def test_the_private_name_check_can_fail():
    src = ("import torch\nfrom megatron_rollout.model import te_layers\nfrom megatron_rollout.kv import _pool\n"
           "def f(runner):\n    torch.cuda._sleep(1)\n    te_layers._te()\n    runner._graph(4)\n"
           "    runner._mine()\n    self._graph\n")
    assert private_uses(src, {"_graph"}) == ["3: from megatron_rollout.kv import _pool", "6: te_layers._te",
                                             "7: runner._graph"]
    privates = package_privates()
    assert "_te" in privates and "__init__" not in privates and "forward" not in privates


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
        "(a higher layer, layer 5: megatron_rollout.multiplex)",
        "megatron_rollout.kernels.moe (layer 5: megatron_rollout.kernels) imports megatron_rollout.multiplex.turnstile "
        "(a peer of its layer, layer 5: megatron_rollout.multiplex)"]
    known = {"megatron_rollout.types", "megatron_rollout.engine", "megatron_rollout.engine.api"}
    src = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megatron_rollout.engine import api\n"
           "def f():\n    import megatron_rollout.types\n")
    assert imports_of("megatron_rollout.x", src, known) == {"megatron_rollout.engine.api", "megatron_rollout.types"}


DEVICE_SIDE = ("megatron_rollout.comm", "megatron_rollout.model", "megatron_rollout.kv.paged",
               "megatron_rollout.kernels", "megatron_rollout.runner", "megatron_rollout.multiplex")


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dst in edges.get(todo.pop(), ()):
            if dst not in seen:
                seen.add(dst)
                todo.append(dst)
    return seen


def test_the_request_table_reaches_no_device_module():
    """The CPU bookkeeping (request table, planner) holds Python numbers: nothing it imports, directly
    or through other modules, is a module that holds tensors or issues collectives."""
    edges = graph(_modules())
    for table in ("megatron_rollout.engine.bookkeeping", "megatron_rollout.engine.scheduler"):
        found = sorted(m for m in reachable(edges, table) if m.startswith(DEVICE_SIDE))
        assert not found, f"{table} reaches device modules: {found}"
    assert reachable({"a": {"b"}, "b": {"c"}}, "a") == {"b", "c"}


LARGEST_SHARE = 0.20
"""No folder of the package holds more than this share of its lines: a folder that outgrows it
holds two concerns (the measuring lab once held a quarter of the package)."""


def folder_shares(root: Path = ROOT / "megatron_rollout") -> dict[str, float]:
    """Lines of `.py` files per top-level folder of the package, as a share of all its lines."""
    lines = {path: len(path.read_text().splitlines()) for path in root.rglob("*.py")}
    total = sum(lines.values())
    shares: dict[str, float] = {}
    for path, n in lines.items():
        rel = path.relative_to(root)
        if len(rel.parts) > 1:
            shares[rel.parts[0]] = shares.get(rel.parts[0], 0.0) + n / total
    return shares


def test_no_folder_holds_more_than_a_fifth_of_the_package():
    shares = folder_shares()
    assert {"engine", "model", "kernels", "comm", "weights"} <= shares.keys()
    assert max(shares.values()) <= LARGEST_SHARE, {k: round(v, 3) for k, v in shares.items()}
