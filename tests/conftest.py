import gc
import os
import threading
import time

import pytest
import torch

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


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available()
    n_gpu = torch.cuda.device_count() if has_gpu else 0
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "multigpu" in item.keywords and n_gpu < 2:
            item.add_marker(pytest.mark.skip(reason="needs several CUDA devices"))


@pytest.fixture(autouse=True)
def _collector_unfrozen():
    """An engine left with requests in flight keeps the heap frozen (`engine.gc_freeze`) until a step
    finds it idle; the next test starts with the collector seeing everything."""
    yield
    gc.unfreeze()
