"""The vLLM peer kept up beside our engines, so that its timed passes interleave with our repeats.

`benchmarks.rollout --vllm-interleave own|in-process` starts `benchmarks.vllm_peer --serve` once,
before its own stages. The peer starts vLLM at one budget and runs its warm-up passes while our
model is built; our warm-up waits for it (it times budgets and expert kernels, which must not run
beside anything). Then each round of our timed repeats is followed by one timed pass of the peer,
so a drift of the machine (clocks, heat, a neighbour) lands on both engines alike. Both hold their
GPU memory all along: the peer gets a fixed KV cache (`--vllm-kv-gb`, ours by default) and a
smaller share of the device (`--vllm-memory`).

The channel: commands on the peer's stdin (`pass`, `quit`), answers as JSON lines on a pipe of
their own (`--reply-fd`; vLLM logs to stdout). Every wait has a time limit; a peer that does not
answer in time, answers with an error or exits is stopped, the error is kept in the result and our
replays go on without it.
"""
from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("benchmarks.interleave")


class PeerError(RuntimeError):
    """The peer did not answer as the protocol says (module docstring)."""


class PeerSession:
    """One `benchmarks.vllm_peer --serve` process and its two channels."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path, json_path: Path) -> None:
        self.json_path, self.cmd = json_path, cmd
        read, write = os.pipe()
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([*cmd, "--serve", "--reply-fd", str(write)], env=env, stdin=subprocess.PIPE,
                                     stdout=self._log, stderr=subprocess.STDOUT, pass_fds=(write,), text=True)
        os.close(write)
        self._fd, self._buffer = read, b""
        self.started = time.perf_counter()
        self.ready: dict[str, Any] | None = None
        self.error: str | None = None
        self.pass_s: list[float] = []
        """Wall time of each timed pass, answer included."""

    @property
    def alive(self) -> bool:
        return self.error is None and self.proc.poll() is None

    def _answer(self, timeout: float) -> dict[str, Any]:
        end = time.perf_counter() + timeout
        while b"\n" not in self._buffer:
            left = end - time.perf_counter()
            if left <= 0 or not select.select([self._fd], [], [], left)[0]:
                raise PeerError(f"no answer from the peer within {timeout:.0f} s")
            chunk = os.read(self._fd, 1 << 16)
            if not chunk:
                raise PeerError(f"the peer exited (code {self.proc.wait()}) without answering")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        answer = json.loads(line)
        if answer.get("event") == "error":
            raise PeerError(f"the peer failed: {answer.get('reason')}")
        return answer

    def _send(self, command: str) -> None:
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise PeerError(f"the peer's stdin is closed ({exc}); exit code {self.proc.poll()}") from exc

    def _fail(self, exc: PeerError) -> None:
        self.error = str(exc)
        log.error("vLLM peer: %s; our replays go on without it", exc)
        self.proc.kill()
        self.proc.wait()

    def wait_ready(self, timeout: float) -> bool:
        """Block until the peer has started and warmed up (once); False if it failed."""
        if self.ready is None and self.error is None:  # (an exited peer's last answers are still read)
            try:
                self.ready = self._answer(timeout)
                if self.ready.get("event") != "ready":
                    raise PeerError(f"expected 'ready', got {self.ready}")
                log.info("vLLM peer ready after %.0f s (warm-ups %s)", time.perf_counter() - self.started,
                         self.ready.get("warmups"))
            except PeerError as exc:
                self._fail(exc)
        return self.ready is not None and self.alive

    def run_pass(self, timeout: float) -> dict[str, Any] | None:
        """One timed pass of the peer: its report, or None if it could not run one."""
        if not self.wait_ready(timeout):
            return None
        t0 = time.perf_counter()
        try:
            self._send("pass")
            answer = self._answer(timeout)
        except PeerError as exc:
            self._fail(exc)
            return None
        if answer.get("event") != "pass":
            log.warning("vLLM peer skipped a pass: %s", answer)
            return None
        self.pass_s.append(time.perf_counter() - t0)
        return answer["report"]

    def close(self, timeout: float = 60.0) -> dict[str, Any]:
        """Stop the peer; its JSON (`benchmarks.vllm_peer`'s), with how it ran."""
        if self.proc.poll() is None:
            try:
                self._send("quit")
                self.proc.wait(timeout)
            except (PeerError, subprocess.TimeoutExpired) as exc:
                self.error = self.error or f"the peer did not stop: {exc}"
                self.proc.kill()
                self.proc.wait()
        os.close(self._fd)
        self._log.close()
        peer = json.loads(self.json_path.read_text()) if self.json_path.exists() else {}
        peer.update(command=" ".join(self.cmd + ["--serve"]), exit=self.proc.returncode,
                    wall_s=time.perf_counter() - self.started, interleaved=True, pass_wall_s=self.pass_s)
        for entry in (peer.get("budgets") or {}).values():  # per setting: a resumed run adds others, not interleaved
            entry["interleaved"] = True
        if self.error is not None:
            peer["error"] = self.error
        return peer
