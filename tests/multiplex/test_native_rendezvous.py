"""The shared-memory rendezvous on 2 and 4 CPU processes: payloads over many rounds, mismatch on
every rank, a rank that never comes and a rank that was killed (named, the latter as dead and at
once), the store fallback, and the cached build."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from megatron_rollout.comm import shm_rendezvous as shm
from megatron_rollout.multiplex.native_rendezvous import NativeRendezvous, NativeRendezvousTimeout, make_rendezvous
from megatron_rollout.multiplex.rendezvous import RendezvousMismatch, RendezvousTimeout
from tests.world import _entry, free_port, run_world

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROUNDS = 2000
TAGS = ("pre-D", "post-D")
SLACK_S = 10.0  # how late past its timeout a waiting rank may be scheduled on a loaded 2-core machine


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    """Build (or load the cached build) once here, so ranks do not race on a cold cache."""
    try:
        shm.load_extension()
    except shm.NativeUnavailable as exc:
        pytest.skip(f"native rendezvous not buildable here: {exc}")


def exchange(rdv, rank: int, n: int) -> bool:
    """Every round carries a different payload per rank, of varying length."""
    for k in range(ROUNDS):
        payload = tuple(range(rank * k, rank * k + k % 4))
        got = rdv.meet(7, k, TAGS[k % 2], payload)
        if got != [tuple(range(r * k, r * k + k % 4)) for r in range(n)]:
            return False
    return True


def four_ranks(rank: int) -> dict:
    out: dict = {}
    rdv = make_rendezvous(timeout_s=30, name="native-test")
    out["kind"] = type(rdv).__name__
    out["exchange"] = exchange(rdv, rank, 4)
    for wide in ((2**63,), [1, -2**63 - 1]):  # publishes nothing: the rendezvous stays usable
        try:
            rdv.meet(7, 0, "pre-D", wide)
        except ValueError as exc:
            out.setdefault("wide", []).append(str(exc))
    out["after_wide"] = rdv.meet(7, 1, "post-D", (rank,))
    # Ranks at different points: every rank raises, naming where rank 2 is.
    mism = NativeRendezvous(timeout_s=30, name="native-mismatch")
    try:
        mism.meet(2, 4, "post-D" if rank == 2 else "pre-D", (rank,))
    except RendezvousMismatch as exc:
        out["mismatch"] = str(exc)
    try:
        mism.meet(2, 5, "pre-D")
    except RuntimeError as exc:
        out["mismatch_poisoned"] = str(exc)
    # Rank 3 never comes (it sleeps past the others' timeout). Built right after a barrier: its
    # attach runs under the same 1 s timeout, which a rank started late on a busy machine would miss.
    dist.barrier()
    late = NativeRendezvous(timeout_s=1.0, name="native-timeout")
    if rank < 3:
        t0 = time.monotonic()
        try:
            late.meet(9, 13, "post-D")
        except RendezvousTimeout as exc:
            out["timeout"] = (type(exc).__name__, exc.missing, exc.epoch, exc.boundary, exc.tag, exc.elapsed_s,
                              exc.dead, str(exc), time.monotonic() - t0)
        try:
            late.meet(9, 14, "pre-D")
        except RuntimeError as exc:
            out["poisoned"] = str(exc)
    else:
        time.sleep(1.5)
    # Fallback: one rank disables native, so every rank gets the store path; it still meets.
    if rank == 2:
        os.environ[shm.DISABLE_ENV] = "1"
    auto = make_rendezvous(timeout_s=30, name="native-fallback")
    out["fallback"] = (type(auto).__name__, auto.meet(1, 0, "pre-D", (rank,)))
    try:
        make_rendezvous(timeout_s=30, name="native-forced", prefer="native")
    except shm.NativeUnavailable as exc:
        out["forced"] = str(exc)
    os.environ.pop(shm.DISABLE_ENV, None)
    out["store"] = type(make_rendezvous(timeout_s=30, name="native-store", prefer="store")).__name__
    return out


def test_four_ranks():
    res = run_world(four_ranks, 4, timeout=120)
    for rank, r in enumerate(res):
        assert r["kind"] == "NativeRendezvous" and r["exchange"], r
        assert [w.split(", got ")[1].split(":")[0] for w in r["wide"]] == [str(2**63), str(-2**63 - 1)], r["wide"]
        assert "must fit in 64 bits" in r["wide"][0] and r["after_wide"] == [(0,), (1,), (2,), (3,)]
        assert "mismatch_poisoned" in r and "used after a failure" in r["mismatch_poisoned"]
        if rank != 2:
            assert "rank 2 is at epoch 2, boundary 4, post-D" in r["mismatch"], r["mismatch"]
        else:
            assert "rank 0 is at epoch 2, boundary 4, pre-D" in r["mismatch"], r["mismatch"]
        assert r["fallback"] == ("Rendezvous", [(0,), (1,), (2,), (3,)])
        assert f"rank 2: native rendezvous disabled by {shm.DISABLE_ENV}=1" in r["forced"]
        assert r["store"] == "Rendezvous"
    for r in res[:3]:
        kind, missing, epoch, boundary, tag, elapsed, dead, msg, waited = r["timeout"]
        assert (kind, missing, epoch, boundary, tag, dead) == ("NativeRendezvousTimeout", (3,), 9, 13, "post-D", {})
        assert (f"rank(s) [3] did not arrive at the post-D rendezvous of epoch 9, boundary 13: waited {elapsed:.3f}s "
                "(not within 1.0s;") in msg
        assert 1.0 <= elapsed <= waited < 1.0 + SLACK_S  # the timeout, then at most a busy machine's delay
        assert "used after a failure" in r["poisoned"]
    assert "timeout" not in res[3]


def two_ranks_killed(rank: int, queue) -> None:
    rdv = NativeRendezvous(timeout_s=20, name="native-killed")
    ok = exchange(rdv, rank, 2)
    pids = rdv.meet(0, 0, "pre-D", (os.getpid(),))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # a zombie until the parent reaps it: still named dead
    t0 = time.monotonic()
    try:
        rdv.meet(3, 8, "post-D")
    except NativeRendezvousTimeout as exc:
        queue.put(("timeout", ok, pids, exc.missing, exc.dead, exc.epoch, exc.boundary, str(exc),
                   time.monotonic() - t0))


def test_killed_rank_is_named_dead():
    """Rank 1 dies by SIGKILL; rank 0 fails well before its 20 s timeout, naming rank 1's pid."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out, status = ctx.Queue(), ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, 2, port, two_ranks_killed, (out,), status, 60.0), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = out.get(timeout=90)
    except Exception:  # queue.Empty: show what the ranks reported instead
        got = [status.get(timeout=1) for _ in range(status.qsize())]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert isinstance(got, tuple) and got[0] == "timeout", got
    kind, ok, pids, missing, dead, epoch, boundary, msg, waited = got
    assert ok
    assert pids[1][0] == procs[1].pid and procs[1].exitcode == -signal.SIGKILL
    assert (missing, dead, epoch, boundary) == ((1,), {1: procs[1].pid}, 3, 8)
    assert f"rank 1 (pid {procs[1].pid}) is dead" in msg and "gave up early" in msg
    assert waited < 20.0  # not the timeout's wait


def _build_outputs() -> dict[str, tuple[int, int]]:
    """{file name: (inode, mtime in ns)} of the cached build's library and object files."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in shm.extension_dir().iterdir()
            if p.suffix in (".so", ".o")}


def two_ranks_stopped(rank: int, queue) -> None:
    rdv = NativeRendezvous(timeout_s=1.0, name="native-stopped")
    rdv.meet(0, 0, "pre-D")
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # the parent kills it
    try:
        rdv.meet(3, 8, "post-D")
    except NativeRendezvousTimeout as exc:
        queue.put(("timeout", exc.missing, exc.dead, exc.stopped, exc.states, str(exc)))


def test_stopped_rank_is_named_stopped():
    """Rank 1 stops (SIGSTOP): rank 0 waits out its timeout and says rank 1 is stopped, as the
    store path and the engine's collectives do (before: only "did not arrive")."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out, status = ctx.Queue(), ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, 2, port, two_ranks_stopped, (out,), status, 60.0), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = out.get(timeout=90)
    except Exception:  # queue.Empty: show what the ranks reported instead
        got = [status.get(timeout=1) for _ in range(status.qsize())]
    finally:
        procs[1].kill()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert isinstance(got, tuple) and got[0] == "timeout", got
    _, missing, dead, stopped, states, msg = got
    pid = procs[1].pid
    assert (missing, dead, stopped, states) == ((1,), {}, {1: pid}, {1: "stopped"})
    assert f"rank 1 (pid {pid}) is stopped" in msg and "not within 1.0s" in msg, msg


def test_build_is_cached():
    """A second process loads the library built above and compiles nothing: its build outputs are
    the same files, untouched (what a rebuild would change, however long it took)."""
    so = list(shm.extension_dir().glob("*.so"))
    assert len(so) == 1, so
    before = _build_outputs()
    code = "from megatron_rollout.comm import shm_rendezvous as s; print(s.load_extension().__file__)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0 and res.stdout.strip() == str(so[0]), res.stdout + res.stderr
    assert _build_outputs() == before


def test_checkouts_of_one_source_share_a_build_and_an_edit_gets_its_own(tmp_path, monkeypatch):
    """The cache entry is named by the source's content, not its path (two worktrees rebuilt each
    other's library before)."""
    here = shm.extension_dir()
    copy = tmp_path / "other-checkout" / "csrc" / shm.SOURCE.name
    copy.parent.mkdir(parents=True)
    copy.write_bytes(shm.SOURCE.read_bytes())
    monkeypatch.setattr(shm, "SOURCE", copy)
    assert shm.extension_dir() == here
    copy.write_bytes(shm.SOURCE.read_bytes() + b"\n// edited\n")
    assert shm.extension_dir() != here and shm.extension_dir().parent == here.parent


def test_a_killed_builders_lock_is_not_kept(tmp_path, caplog):
    """A builder killed while it holds the build lock releases it (the kernel drops a flock with its
    holder); a live holder is waited for only up to the given bound."""
    lock = tmp_path / "entry.lock"
    code = ("import sys, time; from megatron_rollout.comm import shm_rendezvous as s\n"
            f"with s._build_lock(__import__('pathlib').Path({str(lock)!r})) as held:\n"
            "    print('held', held, flush=True); time.sleep(120)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held True"
        t0 = time.monotonic()
        with shm._build_lock(lock, wait_s=0.5) as held:
            assert held is False and 0.5 <= time.monotonic() - t0 < 5
        assert "building beside it" in caplog.text
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        t0 = time.monotonic()
        with shm._build_lock(lock, wait_s=60) as held:
            assert held is True and time.monotonic() - t0 < 2
    finally:
        holder.kill()
        holder.wait()


def test_a_truncated_library_is_not_loaded(tmp_path):
    """A cached library cut short (a full disk, a copy interrupted) is caught by its recorded size
    and hash before it is mapped (mapping it died with SIGBUS): it is discarded and built again, and
    when that build fails the extension is unavailable with the reason (callers use the store).
    A private folder left by a killed build is cleared on the way."""
    import shutil

    cached = shm.extension_dir()
    target = tmp_path / cached.name
    shutil.copytree(cached, target)
    library = next(target.glob("*.so"))
    half = library.stat().st_size // 2
    library.write_bytes(library.read_bytes()[:half])
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = tmp_path / f".{cached.name}.{int(dead.stdout)}.abc123"
    leftover.mkdir()
    (leftover / "shm_rendezvous.o").write_bytes(b"half a build")
    code = ("from megatron_rollout.comm import shm_rendezvous as s\n"
            "try:\n    s.load_extension(); print('loaded')\n"
            "except s.NativeUnavailable as e:\n    print('unavailable', e)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, shm.DIR_ENV: str(tmp_path), "CXX": "/bin/false"})
    assert res.returncode == 0, res.stdout + res.stderr  # SIGBUS before
    assert res.stdout.startswith("unavailable cannot build shm_rendezvous.cpp"), res.stdout + res.stderr
    assert f"{library} has {half} bytes" in res.stderr, res.stderr
    assert "the file was truncated or overwritten; not loading it: building it again" in res.stderr, res.stderr
    assert not target.exists() and not leftover.exists()


def test_a_timeout_too_long_for_int64_nanoseconds_waits(tmp_path):
    """1e10 s is 1e19 ns, past int64: the deadline overflowed into the past and the meeting timed out
    at once. Two attachments in one process meet from two threads, the second 0.3 s late."""
    import secrets
    import threading

    ext = shm.load_extension()
    path = str(shm.SHM_DIR / f"megatron_rollout.test.{os.getpid()}.{secrets.token_hex(4)}")
    first, second = ext.ShmBarrier(path, True, 2, 0, 7), ext.ShmBarrier(path, False, 2, 1, 7)
    os.unlink(path)
    for b in (first, second):
        b.set_wait(0.0, 0.0, 50.0, False)
    for timeout_s in (1e10, 1e300, float("inf")):
        got: list = []
        waiter = threading.Thread(target=lambda t=timeout_s: got.append(first.meet(1, 0, 0, (5,), t)))
        waiter.start()
        time.sleep(0.3)
        assert second.meet(1, 0, 0, (6,), timeout_s) == (shm.OK, [(5,), (6,)])
        waiter.join(10)
        assert got == [(shm.OK, [(5,), (6,)])], (timeout_s, got)


def test_segments_of_killed_rank_zeros_are_removed():
    """A rank 0 killed during set-up leaves its /dev/shm file; the next set-up removes files whose
    creator (the pid in the name) is gone, and keeps a live one's."""
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    orphan = shm.SHM_DIR / f"megatron_rollout.{shm._user()}.{dead}.0123abcd"
    live = shm.SHM_DIR / f"megatron_rollout.{shm._user()}.{os.getpid()}.0123abcd"
    try:
        orphan.write_bytes(b"\0" * 64)
        live.write_bytes(b"\0" * 64)
        assert orphan in shm.remove_orphan_segments()
        assert not orphan.exists() and live.exists()
    finally:
        orphan.unlink(missing_ok=True)
        live.unlink(missing_ok=True)


def test_failed_or_disabled_build_is_unavailable_with_reason(tmp_path):
    """A cold cache and a compiler that fails: the reason says so; the env switch is checked first."""
    code = ("import os; from megatron_rollout.comm import shm_rendezvous as s\n"
            "for disabled in ('1', ''):\n"
            "    os.environ[s.DISABLE_ENV] = disabled\n"
            "    try:\n        s.load_extension(); print('loaded')\n"
            "    except s.NativeUnavailable as e:\n        print('unavailable', e)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, shm.DIR_ENV: str(tmp_path), "CXX": "/bin/false"})
    disabled, failed = res.stdout.splitlines()
    assert disabled == f"unavailable native rendezvous disabled by {shm.DISABLE_ENV}=1", res.stdout + res.stderr
    assert failed.startswith("unavailable cannot build shm_rendezvous.cpp") and "install a C++ compiler" in failed
    assert not list(tmp_path.rglob("*.so"))
