import gc
import os
import threading
import time

import pytest
import torch

from megatron_rollout.kernels.fused import interpreting

torch.set_num_threads(1)

PROGRESS_EVERY_S = 30.0
"""A test running longer than this says so on the terminal, and again every as long."""

_terminal = None  # a duplicate of the terminal's stdout (see pytest_configure)


def pytest_configure(config):
    global _terminal
    # Taken while pytest's output capture is suspended (it resumes around each test, redirecting
    # fd 1): a line written here during a test reaches the terminal, not the test's captured output.
    _terminal = os.fdopen(os.dup(1), "w", buffering=1)


def pytest_unconfigure(config):
    if _terminal is not None:
        _terminal.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Per-test progress for long tests: under `-q` a multi-rank world shows nothing for minutes."""
    done, start = threading.Event(), time.monotonic()

    def report() -> None:
        while not done.wait(PROGRESS_EVERY_S):
            _terminal.write(f"\n    ... {item.nodeid} running for {time.monotonic() - start:.0f} s\n")

    threading.Thread(target=report, name="test-progress", daemon=True).start()
    try:
        return (yield)
    finally:
        done.set()


def _release(package: str) -> tuple[int, int] | None:
    """(major, minor) of an installed package, None where it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return tuple(int(part) for part in version(package).split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return None


def interpreter_broken() -> str | None:
    """Why Triton's interpreter cannot run this suite's kernels here, or None. Triton 3.6 and older
    turn a loop bound computed from a program id into a one-element array, which NumPy 2.4 no longer
    converts to an int: the attention kernels' split loops fail with "only 0-dimensional arrays can be
    converted to Python scalars" (Triton 3.7 runs them)."""
    triton, numpy = _release("triton"), _release("numpy")
    if triton is not None and numpy is not None and triton < (3, 7) and numpy >= (2, 4):
        return (f"Triton {'.'.join(map(str, triton))}'s interpreter fails under NumPy {'.'.join(map(str, numpy))} "
                f"(loop bounds from program ids): install triton>=3.7 or numpy<2.4")
    return None


def _interpreted(item) -> bool:
    """A test case that runs Triton kernels in the interpreter (its `interpret` mark or param id)."""
    callspec = getattr(item, "callspec", None)
    return "interpret" in item.keywords or (callspec is not None and "interpret" in callspec.id.split("-"))


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available()
    n_gpu = torch.cuda.device_count() if has_gpu else 0
    broken = interpreter_broken() if interpreting() else None
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "multigpu" in item.keywords and n_gpu < 2:
            item.add_marker(pytest.mark.skip(reason="needs several CUDA devices"))
        if broken and _interpreted(item):
            item.add_marker(pytest.mark.skip(reason=broken))


@pytest.fixture(autouse=True)
def _collector_unfrozen():
    """An engine left with requests in flight keeps the heap frozen (`engine.gc_freeze`) until a step
    finds it idle; the next test starts with the collector seeing everything."""
    yield
    gc.unfreeze()
