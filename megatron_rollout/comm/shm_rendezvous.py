"""The native shared-memory barrier: build and load the C++ extension, and attach every rank of a
group on one host to one segment (megatron_rollout/csrc/shm_rendezvous.cpp says how it meets).

Why it exists: the turnstile meets twice per round, and the store rendezvous pays a TCP round trip
per rank per meeting; ranks on one host can meet through shared memory in microseconds.

The extension is built at first use with torch's extension loader (CPU only, pybind11 without the
ATen headers, so a build takes seconds) into a per-user cache (`extension_dir()`), and loaded from
there afterwards. Anything that keeps it from loading (`MEGATRON_ROLLOUT_NO_NATIVE=1`, no compiler
or ninja, a failed build) raises `NativeUnavailable` with the reason; callers fall back to the store.

Attaching (`ShmBarrier.attach`) agrees on the segment through the process group's store: rank 0
creates a file in /dev/shm named after the user, the group and a random token, and posts its name
and a nonce; the others open it and check the nonce; all post whether that worked, and rank 0
unlinks the file once every rank reported (the mapping outlives the name). If any rank failed,
every rank raises the same `NativeUnavailable`, so all of them fall back together.

Deliberately left out: the turnstile's vocabulary and errors (multiplex/native_rendezvous.py adds
them), and any cross-host path.
"""
from __future__ import annotations

import getpass
import logging
import os
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple, Sequence

import torch
import torch.distributed as dist

from megatron_rollout.comm.dist import StoreRendezvous

logger = logging.getLogger(__name__)

DISABLE_ENV = "MEGATRON_ROLLOUT_NO_NATIVE"
DIR_ENV = "MEGATRON_ROLLOUT_EXTENSIONS_DIR"
SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "shm_rendezvous.cpp"
SHM_DIR = Path("/dev/shm")
_NAME = "megatron_rollout_shm_rendezvous"

# Status codes of `meet` (the extension's constants, repeated so callers need not load it).
OK, MISMATCH, TIMEOUT, BAD_ARGS = 0, 1, 2, 3

_loaded: ModuleType | None = None
_failure: str | None = None


class NativeUnavailable(RuntimeError):
    """The native barrier cannot be used here; the message says why (fall back to the store)."""


def extension_dir() -> Path:
    """Per-user build cache, one per Python and torch version (`$MEGATRON_ROLLOUT_EXTENSIONS_DIR`
    overrides the root)."""
    root = os.environ.get(DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "megatron_rollout", "extensions")
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__.replace('+', '_')}"
    return Path(root) / tag / "shm_rendezvous"


def load_extension() -> ModuleType:
    """The compiled extension, built on first use. Raises `NativeUnavailable` with the reason; a
    failure is remembered for the process (no second build attempt)."""
    global _loaded, _failure
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        raise NativeUnavailable(f"native rendezvous disabled by {DISABLE_ENV}={os.environ[DISABLE_ENV]}")
    if _loaded is not None:
        return _loaded
    if _failure is not None:
        raise NativeUnavailable(_failure)
    try:
        _loaded = _build()
    except Exception as exc:  # noqa: BLE001 - any build problem means: use the store
        first = str(exc).strip().splitlines()
        _failure = (f"cannot build {SOURCE.name} ({type(exc).__name__}: {first[0] if first else ''}); "
                    f"install a C++ compiler and ninja, or set {DISABLE_ENV}=1 to skip the attempt")
        raise NativeUnavailable(_failure) from exc
    return _loaded


STALE_LOCK_S = 180.0
"""Age past which a build lock is a killed build's (a build takes well under a minute)."""


def _wait_for_build_lock(lock: Path) -> None:
    """Wait for another process's build to release `lock`, at most until the lock is `STALE_LOCK_S`
    old; then remove it. torch's `cpp_extension` waits on the lock with no bound, and a build that
    was killed leaves it behind: every later start would hang."""
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > STALE_LOCK_S:
            logger.warning("removing the build lock %s, %.0f s old: the build that took it is gone", lock, age)
            lock.unlink(missing_ok=True)
            return
        time.sleep(0.5)


def _build() -> ModuleType:
    from torch.utils import cpp_extension

    if not SOURCE.is_file():
        raise FileNotFoundError(f"{SOURCE} is missing (the package was installed without its csrc/ data)")
    build_dir = extension_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    _wait_for_build_lock(build_dir / "lock")
    t0 = time.perf_counter()
    module = cpp_extension.load(name=_NAME, sources=[str(SOURCE)], build_directory=str(build_dir),
                                extra_cflags=["-O2", "-std=c++17"], with_cuda=False, verbose=False)
    logger.debug("loaded %s from %s in %.2fs", _NAME, build_dir, time.perf_counter() - t0)
    return module


@dataclass(frozen=True)
class ShmBarrierConfig:
    """How a waiting rank waits. The defaults were tuned with `python -m benchmarks.rendezvous`
    on a 2-core machine with 2 to 8 ranks (docs/rendezvous.md)."""

    spin_us: float | None = None
    """Busy-wait this long before yielding. None: 5 us when every rank of the group can have a
    core (ranks <= usable CPUs), else 0 (spinning steals the core a late rank needs)."""
    yield_us: float = 2000.0
    """Then `sched_yield` for this long before sleeping on a futex. Long on purpose: once one rank
    sleeps, every meeting pays a futex wake-up (tens of us on a busy machine) and the ranks take
    turns sleeping; yielding keeps the waiter runnable without holding a core another rank needs
    (2 ranks, 2 cores: 2.3 us per meeting with 2 ms of yielding, 50 us with 50 us)."""
    poll_ms: float = 50.0
    """While asleep, wake this often to check whether a missing rank's process is gone."""
    check_dead: bool = True
    """Fail at once (and say so) when a missing rank's process is gone, instead of at the timeout."""

    def __post_init__(self) -> None:
        if self.spin_us is not None and not self.spin_us >= 0:
            raise ValueError(f"ShmBarrierConfig.spin_us must be >= 0 or None, got {self.spin_us!r}")
        if not self.yield_us >= 0:
            raise ValueError(f"ShmBarrierConfig.yield_us must be >= 0, got {self.yield_us!r}")
        if not self.poll_ms >= 1:
            raise ValueError(f"ShmBarrierConfig.poll_ms must be >= 1 (ms), got {self.poll_ms!r}")

    def resolved(self, nranks: int) -> tuple[float, float]:
        """(spin_us, yield_us) for a group of `nranks` on this machine."""
        fits = nranks <= len(os.sched_getaffinity(0))
        return (self.spin_us if self.spin_us is not None else (5.0 if fits else 0.0)), self.yield_us


class Absence(NamedTuple):
    """Why a meeting timed out: group indices that did not arrive, those whose process is gone,
    their pids, and the time actually waited."""

    missing: tuple[int, ...]
    gone: tuple[int, ...]
    pids: tuple[int, ...]
    elapsed_s: float


class ShmBarrier:
    """One rank's attachment to a group's segment. `meet(epoch, boundary, tag_id, payload, timeout_s)`
    is the extension's own method (no Python layer on the hot path) and returns `(status, data)`:
    OK → payload tuples in group order; MISMATCH → (epoch, boundary, tag_id) per rank; TIMEOUT →
    (missing, gone, elapsed_s), see `absence()`; BAD_ARGS → None (nothing was published)."""

    def __init__(self, native: Any, index: int, nranks: int, path: str, max_payload: int) -> None:
        self._native, self.index, self.nranks, self.path = native, index, nranks, path
        self.meet = native.meet
        self.max_payload = max_payload

    @classmethod
    def attach(cls, rank: int, ranks: Sequence[int], timeout_s: float, prefix: str, store: dist.Store | None = None,
               config: ShmBarrierConfig = ShmBarrierConfig()) -> "ShmBarrier":
        """Attach every rank of `ranks` (global ranks; `rank` is this one) to one new segment.
        Collective over `ranks`: every rank must call it with the same prefix. Raises
        `NativeUnavailable` on every rank if any rank cannot attach."""
        ranks = tuple(ranks)
        index = ranks.index(rank)
        gather = StoreRendezvous(rank, ranks, timeout_s, prefix + "attach/", store)
        problem: str | None = None
        try:
            ext = load_extension()
        except NativeUnavailable as exc:
            ext, problem = None, str(exc)
        native, path, nonce = None, "", 0
        if index == 0 and ext is not None:
            nonce = secrets.randbits(63)
            path = str(SHM_DIR / f"megatron_rollout.{_user()}.{os.getpid()}.{secrets.token_hex(8)}")
            try:
                native = ext.ShmBarrier(path, True, len(ranks), 0, nonce)
            except (RuntimeError, ValueError) as exc:
                problem = f"rank {rank}: {exc}"
        announced = gather.all_gather_object((path, nonce, problem), context="shm name")[0]
        try:
            if index != 0 and problem is None:
                if announced[2] is not None:
                    problem = f"rank {ranks[0]} could not create the segment"
                else:
                    path, nonce = announced[0], announced[1]
                    try:
                        native = ext.ShmBarrier(path, False, len(ranks), index, nonce)
                    except (RuntimeError, ValueError) as exc:
                        problem = f"rank {rank}: {exc}"
            statuses = gather.all_gather_object((os.getpid(), problem), context="shm attached")
        finally:
            if index == 0 and path:
                _unlink(path)  # every rank has mapped it or given up: the name is no longer needed
        problems = [p for _, p in statuses if p is not None]
        if problems:
            raise NativeUnavailable("native rendezvous unavailable on this group: " + "; ".join(problems))
        check_dead = config.check_dead and _pids_visible([pid for pid, _ in statuses])
        spin_us, yield_us = config.resolved(len(ranks))
        native.set_wait(spin_us, yield_us, config.poll_ms, check_dead)
        logger.debug("rank %d attached to %s (%d ranks, spin %.0f us, yield %.0f us, dead check %s)",
                     rank, path, len(ranks), spin_us, yield_us, check_dead)
        return cls(native, index, len(ranks), path, ext.MAX_PAYLOAD)

    def pids(self) -> tuple[int, ...]:
        return tuple(self._native.pids())

    def absence(self, data: tuple[list[int], list[int], float]) -> Absence:
        missing, gone, elapsed = data
        return Absence(tuple(missing), tuple(gone), self.pids(), float(elapsed))


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry in some containers
        return str(os.getuid())


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _pids_visible(pids: Sequence[int]) -> bool:
    """Whether every rank's pid names a live process here (false across pid namespaces, where a
    dead-rank check would misfire)."""
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            logger.info("rank pids %s are not all visible from pid %d (separate pid namespaces?); "
                        "the native rendezvous will not check for dead ranks", list(pids), os.getpid())
            return False
        except PermissionError:
            pass
    return True


__all__ = ["Absence", "NativeUnavailable", "ShmBarrier", "ShmBarrierConfig", "extension_dir",
           "load_extension"]
