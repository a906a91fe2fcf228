"""The native shared-memory barrier: build and load the C++ extension, and attach every rank of a
group on one host to one segment (megatron_rollout/csrc/shm_rendezvous.cpp says how it meets).

Why it exists: the turnstile meets twice per round, and the store rendezvous pays a TCP round trip
per rank per meeting; ranks on one host can meet through shared memory in microseconds.

The extension is built at first use with torch's extension loader (CPU only, pybind11 without the
ATen headers, so a build takes seconds) into a per-user cache, and loaded from there afterwards.
The cache entry (`extension_dir()`) is named by a hash of the source's content with the Python and
torch versions and the flags, never its path: checkouts of the same source share one build, and an
edited source gets its own. A build runs in a private temporary folder that one atomic rename makes
the entry, so a build killed half-way leaves no entry; builders take an advisory lock (`flock`)
that the kernel drops when its holder dies, however it died. The library's size and SHA-256 are
recorded beside it and checked before every load: a truncated or overwritten library is discarded
and built again instead of being mapped (which dies with SIGBUS). Anything that keeps it from
loading (`MEGATRON_ROLLOUT_NO_NATIVE=1`, no compiler or ninja, a failed build) raises
`NativeUnavailable` with the reason; callers fall back to the store.

Attaching (`ShmBarrier.attach`) agrees on the segment through the process group's store: rank 0
creates a file in /dev/shm named after the user, the group and a random token, and posts its name
and a nonce; the others open it and check the nonce; all post whether that worked, and rank 0
unlinks the file once every rank reported (the mapping outlives the name). If any rank failed,
every rank raises the same `NativeUnavailable`, so all of them fall back together. A rank 0 killed
before that unlink leaves its file behind; the file's name carries the creator's pid, and the next
rank 0 of this user removes files whose creator is gone (`remove_orphan_segments`).

Deliberately left out: the turnstile's vocabulary and errors (multiplex/native_rendezvous.py adds
them), and any cross-host path.
"""
from __future__ import annotations

import contextlib
import fcntl
import getpass
import hashlib
import importlib.util
import logging
import os
import platform
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple, Sequence

import torch
import torch.distributed as dist

from megatron_rollout.comm.dist import StoreRendezvous
from megatron_rollout.comm.errors import process_state

logger = logging.getLogger(__name__)

DISABLE_ENV = "MEGATRON_ROLLOUT_NO_NATIVE"
DIR_ENV = "MEGATRON_ROLLOUT_EXTENSIONS_DIR"
SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "shm_rendezvous.cpp"
SHM_DIR = Path("/dev/shm")
_NAME = "megatron_rollout_shm_rendezvous"
_CFLAGS = ("-O2", "-std=c++17")
_RECORD = "library.sha256"  # "<file name> <size> <sha256>" of the built library, beside it

# Status codes of `meet` (the extension's constants, repeated so callers need not load it).
OK, MISMATCH, TIMEOUT, BAD_ARGS = 0, 1, 2, 3

_loaded: ModuleType | None = None
_failure: str | None = None


class NativeUnavailable(RuntimeError):
    """The native barrier cannot be used here; the message says why (fall back to the store)."""


def extension_dir() -> Path:
    """This source's build in the per-user cache (`$MEGATRON_ROLLOUT_EXTENSIONS_DIR` overrides the
    root): named by a hash of the source's content, the Python and torch versions, the machine and
    the flags (not the source's path), so every checkout of the same source shares it."""
    root = os.environ.get(DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "megatron_rollout", "extensions")
    key = hashlib.sha256(SOURCE.read_bytes() if SOURCE.is_file() else b"")
    for part in (f"py{sys.version_info.major}.{sys.version_info.minor}", torch.__version__, platform.machine(),
                 *_CFLAGS):
        key.update(b"\0" + part.encode())
    return Path(root) / f"shm_rendezvous-{key.hexdigest()[:16]}"


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


BUILD_WAIT_S = 300.0
"""How long to wait for another live process's build before building beside it (a build takes
well under a minute; a holder stuck longer is not worth waiting for)."""


def _build() -> ModuleType:
    if not SOURCE.is_file():
        raise FileNotFoundError(f"{SOURCE} is missing (the package was installed without its csrc/ data)")
    entry = extension_dir()
    entry.parent.mkdir(parents=True, exist_ok=True)
    module = _load_checked(entry)
    if module is not None:
        return module
    with _build_lock(entry.parent / f"{entry.name}.lock"):
        _remove_leftovers(entry)
        return _load_checked(entry, discard=True) or _compile(entry)


def _load_checked(entry: Path, discard: bool = False) -> ModuleType | None:
    """The library of a finished build entry, once its size and hash match the record; None when
    there is no entry or it does not match (with `discard`, then logged and moved out of the way, so
    that it is built again)."""
    if not entry.is_dir():
        return None
    try:
        name, size, digest = (entry / _RECORD).read_text().split()
        data = (entry / name).read_bytes()
        problem = None if (len(data), _sha256(data)) == (int(size), digest) else (
            f"{entry / name} has {len(data)} bytes (SHA-256 {_sha256(data)[:12]}...), its record says {size} "
            f"({digest[:12]}...): the file was truncated or overwritten")
    except (OSError, ValueError) as exc:
        name, problem = "", f"the build entry {entry} is incomplete ({type(exc).__name__}: {exc})"
    if problem is not None:
        if discard:  # checked again under the build lock: now say so, and build it again
            logger.warning("%s; not loading it: building it again", problem)
            aside = Path(tempfile.mkdtemp(prefix=f".{entry.name}.{os.getpid()}.", dir=entry.parent))
            os.rename(entry, aside / "discarded")
            shutil.rmtree(aside, ignore_errors=True)
        return None
    t0 = time.perf_counter()
    spec = importlib.util.spec_from_file_location(name.split(".")[0], entry / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    logger.debug("loaded %s in %.2fs", entry / name, time.perf_counter() - t0)
    return module


def _compile(entry: Path) -> ModuleType:
    """Build in a private folder, record the library's size and hash, and rename the folder to
    `entry` in one step: a build killed half-way leaves only a folder `_remove_leftovers` clears."""
    from torch.utils import cpp_extension

    work = Path(tempfile.mkdtemp(prefix=f".{entry.name}.{os.getpid()}.", dir=entry.parent))
    try:
        source = work / SOURCE.name  # compiled from here: nothing of the checkout's path is built in
        shutil.copyfile(SOURCE, source)
        t0 = time.perf_counter()
        module = cpp_extension.load(name=_NAME, sources=[str(source)], build_directory=str(work),
                                    extra_cflags=list(_CFLAGS), with_cuda=False, verbose=False)
        library = Path(module.__file__)
        data = library.read_bytes()
        (work / _RECORD).write_text(f"{library.name} {len(data)} {_sha256(data)}\n")
        try:
            os.rename(work, entry)
        except OSError:  # another process's build landed first (it gave up waiting for ours): keep that one
            shutil.rmtree(work, ignore_errors=True)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    logger.info("built %s into %s in %.1fs", SOURCE.name, entry, time.perf_counter() - t0)
    return module


@contextlib.contextmanager
def _build_lock(path: Path, wait_s: float | None = None) -> Iterator[bool]:
    """Hold an exclusive `flock` on `path` while building; yields whether it was taken. The kernel
    releases it when the holder exits, so a killed build never keeps it. A holder alive past
    `wait_s` (default `BUILD_WAIT_S`) is not waited for: the build goes on beside it, which is
    safe because each build writes its own folder and lands by an atomic rename."""
    wait_s = BUILD_WAIT_S if wait_s is None else wait_s
    with open(path, "a") as f:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    logger.warning("another process has been building the native rendezvous for over %.0f s "
                                   "(lock %s); building beside it", wait_s, path)
                    yield False
                    return
                time.sleep(0.2)
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove_leftovers(entry: Path) -> None:
    """Remove the private folders (`.<entry>.<pid>.*`) of builds whose process is gone."""
    for folder in entry.parent.glob(f".{entry.name}.*"):
        parts = folder.name.split(".")
        if len(parts) >= 3 and parts[2].isdigit() and process_state(int(parts[2])) == "dead":
            logger.info("removing %s, left by a build that did not finish", folder)
            shutil.rmtree(folder, ignore_errors=True)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def remove_orphan_segments() -> list[Path]:
    """Remove this user's segment files whose creating rank 0 is gone (it was killed during set-up,
    before it could unlink the name); the paths removed. The name carries the creator's pid."""
    removed = []
    owner = f"megatron_rollout.{_user()}"
    for path in SHM_DIR.glob(f"{owner}.*.*"):
        head, pid, _ = path.name.rsplit(".", 2)
        try:
            mine = path.stat().st_uid == os.getuid()
        except FileNotFoundError:
            continue
        if head == owner and pid.isdigit() and mine and process_state(int(pid)) == "dead":
            _unlink(str(path))
            removed.append(path)
    if removed:
        logger.info("removed %d shared-memory file(s) left by killed ranks: %s", len(removed),
                    ", ".join(map(str, removed)))
    return removed


@dataclass(frozen=True)
class ShmBarrierConfig:
    """How a waiting rank waits. The defaults were tuned with `python -m benchmarks.rendezvous`
    on a 2-core machine with 2 to 8 ranks (docs/multi-gpu.md)."""

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
            remove_orphan_segments()
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
           "load_extension", "remove_orphan_segments"]
