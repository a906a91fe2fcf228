"""What `pip install .` installs: the packages setuptools finds under pyproject's
`[tool.setuptools.packages.find]`, read here exactly as setuptools reads it. The benchmarks and the
tests stay in the repository: no module of theirs is installed."""
import tomllib
from pathlib import Path

from setuptools import find_namespace_packages, find_packages

ROOT = Path(__file__).resolve().parents[1]


def installed_packages() -> set[str]:
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    finder = find_namespace_packages if find.get("namespaces", True) else find_packages
    return set(finder(where=str(ROOT / find.get("where", ["."])[0]), include=find.get("include", ["*"]),
                      exclude=find.get("exclude", ())))


def test_no_benchmark_or_test_module_is_installed():
    packages = installed_packages()
    assert {"megatron_rollout", "megatron_rollout.engine", "megatron_rollout.kernels", "rl"} <= packages
    assert not {p for p in packages if p.split(".")[0] in ("benchmarks", "tests", "examples", "docs")}
    assert not {p for p in packages if p.rsplit(".", 1)[-1] in ("bench", "benchmarks")}
    assert (ROOT / "benchmarks" / "rollout.py").is_file()  # the benchmarks exist, beside the package


def test_package_data_ships_no_benchmark_files():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "csrc/*.cpp" in data["megatron_rollout"]  # the native rendezvous is built from shipped sources
    assert not [(k, v) for k, patterns in data.items() for v in patterns if "bench" in k + v or "results" in v]
