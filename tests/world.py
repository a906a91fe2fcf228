"""Run a function on N CPU processes joined in one gloo world; collect what each returns.

`run_world(fn, n, *args)` spawns n processes, initialises torch.distributed (gloo) in each, calls
`fn(rank, *args)` and returns the per-rank results (anything picklable) in rank order. An
exception on any rank is re-raised here with that rank's traceback; a rank that neither returns
nor fails within `timeout` fails the test instead of hanging it.

Ranks fork from one server process that imported torch and the package once per session
(`multiprocessing`'s forkserver): a spawned rank paid seconds of imports each, dozens of times a
suite. Each rank still starts from that clean server (never from pytest's process, whose threads and
state a plain fork would copy) and takes the caller's environment as it is at the call. NCCL worlds
keep a fresh interpreter per rank (`spawn`): nothing CUDA-related is shared with a server.
"""
from __future__ import annotations

import os
import socket
import traceback
from datetime import timedelta
from multiprocessing import reduction
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = ["torch", "torch.distributed", "megatron_rollout.distributed", "megatron_rollout.engine",
           "megatron_rollout.model.transformer", "tests.world",
           "megatron.core.parallel_state", "megatron.core.models.gpt"]  # ~7 CPU-s, a dozen ranks use it
"""What the fork server imports once (one that fails to import is left out); anything else a rank
imports as a spawned one would."""


class _CallerStdio:
    """The caller's stdout and stderr as they are at the rank's start (during a test: pytest's capture
    of that test), handed to a rank forked from the server, whose own are the server's."""

    def __reduce__(self):  # runs while the rank is being started: the fds travel with it
        return tuple, ([reduction.DupFd(1), reduction.DupFd(2)],)


def context(backend: str = "gloo", cuda: bool = False):
    """The multiprocessing context a world's ranks start from (see the module docstring). Ranks that
    use CUDA spawn: one forked from the server fails its first CUDA call ("Cannot re-initialize CUDA
    in forked subprocess", seen on the H200 with a one-rank gloo world) once anything in the server
    has initialised CUDA."""
    if backend == "nccl" or cuda:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (first use); later calls change nothing
    return ctx


def _entry(rank: int, n: int, port: int, fn: Callable, args: tuple, queue, pg_timeout: float,
           backend: str = "gloo", env: dict[str, str] | None = None, stdio: tuple | None = None) -> None:
    import torch

    if env is not None:  # the caller's environment now, not the fork server's from its start
        os.environ.clear()
        os.environ.update(env)
    for fd, dup in zip((1, 2), stdio or ()):
        os.dup2(dup.detach(), fd)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(n),
                      LOCAL_RANK=str(rank))
    try:
        if backend == "nccl":  # one GPU per rank
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=n, timeout=timedelta(seconds=pg_timeout))
        queue.put((rank, "ok", fn(rank, *args)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent with its traceback
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        import sys

        if "megatron.core.parallel_state" in sys.modules:  # importing it just to tear down costs seconds
            try:
                sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
            except Exception:  # noqa: BLE001
                pass
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn: Callable, n: int, *args: Any, timeout: float = 120.0, pg_timeout: float = 60.0,
              allow_errors: bool = False, backend: str = "gloo", cuda: bool = False) -> list[Any]:
    """Results of `fn(rank, *args)` per rank. With `allow_errors`, a failing rank's entry is the
    error text (a str starting with the exception type) instead of raising. `backend="nccl"` joins
    the ranks over NCCL, one GPU each (what a Megatron optimizer's collectives on CUDA tensors need);
    `cuda` says that ranks of another backend use CUDA (they spawn: `context`)."""
    ctx = context(backend, cuda)
    queue = ctx.Queue()
    port = free_port()
    env, stdio = dict(os.environ), _CallerStdio()
    procs = [ctx.Process(target=_entry, args=(r, n, port, fn, args, queue, pg_timeout, backend, env, stdio),
                         daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    try:
        for _ in range(n):
            rank, status, value = queue.get(timeout=timeout)
            results[rank] = (status, value)
    except Exception as exc:  # queue.Empty
        missing = sorted(set(range(n)) - set(results))
        raise TimeoutError(f"ranks {missing} returned nothing within {timeout}s (hang?)") from exc
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = {r: v for r, (s, v) in results.items() if s == "error"}
    if errors and not allow_errors:
        raise AssertionError("\n".join(f"rank {r} failed:\n{v}" for r, v in sorted(errors.items())))
    return [results[r][1] for r in range(n)]
