"""The worker processes of `compare.py`: one scenario of one system each, driven call by call, and the two
ways of alternating them (their timed calls side by side, or the workers themselves, one alive at a time).

Imports only the standard library, like the harness that uses it (the reference's environment runs it too).
"""

from __future__ import annotations

import json
import logging
import subprocess
import tempfile
from collections.abc import Callable

logger = logging.getLogger("compare")
RESULT_PREFIX = "XLAGEN_BENCH "  # marks the workers' JSON lines on stdout


class Worker:
    """One scenario of one system in its own process (`compare.worker_main`), driven call by call.

    Starting it waits for the worker's "system" record, then for `until` (None: nothing more): "ready" once
    it has built the model and made the first call (trace + compile), "built" for a worker that only builds
    the model (a reference's conversion) and exits. `run(n)` then times one call of n new tokens. Raises
    RuntimeError with the worker's error or the end of its stderr.
    """

    def __init__(self, name: str, command: list[str], env: dict[str, str], until: str | None):
        self.system = name
        self.stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 - lives as long as the worker; see close().
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.stderr, text=True, bufsize=1)
        self.info = self._expect("system")
        self.ready = self._expect(until) if until else None

    def _expect(self, kind: str) -> dict:
        for line in self.process.stdout:
            if line.startswith(RESULT_PREFIX):
                record = json.loads(line[len(RESULT_PREFIX):])
                if record["kind"] == "error":
                    raise RuntimeError(record["error"])
                if record["kind"] == kind:
                    return record
        code = self.process.wait()
        self.stderr.seek(0)
        tail = [line for line in self.stderr.read().strip().splitlines() if line.strip()][-15:]
        logger.error("%s worker exited (%d):\n%s", self.system, code, "\n".join(tail))
        raise RuntimeError(f"worker exit {code}: {tail[-1] if tail else 'no message'}")

    def run(self, new_tokens: int) -> float:
        self.process.stdin.write(f"{new_tokens}\n")
        self.process.stdin.flush()
        return self._expect("run")["seconds"]

    def close(self) -> None:
        try:
            self.process.stdin.close()
            self.process.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
        self.stderr.close()


# A schedule's timing: worker index -> {"runs": [s], "short": [s], and "ready" (the first worker's record) or
# "error"}; `start(index, timing)` starts worker `index` and records its "ready" or "error" in `timing[index]`,
# returning None when it failed.
Start = Callable[[int, dict], "Worker | None"]


def timed_calls(workers: dict[int, Worker], timing: dict[int, dict], new_tokens: int, repeats: int, warmup: int,
                ttft: bool) -> None:
    """Warm-up and timed calls of `workers` (index -> worker), alternating them call by call (A B C, C B A,
    ...), into `timing` ("runs", and with `ttft` "short": runs of 2 new tokens after one that compiles)."""

    def alternate(tokens: int, count: int, store: str | None) -> None:
        for turn in range(count):
            for index in list(workers)[::-1 if turn % 2 else 1]:
                if "error" in timing[index]:
                    continue
                try:
                    seconds = workers[index].run(tokens)
                except RuntimeError as error:
                    timing[index]["error"] = str(error)
                    continue
                if store is not None:
                    timing[index][store].append(seconds)

    alternate(new_tokens, warmup, None)
    alternate(new_tokens, repeats, "runs")
    if ttft and new_tokens > 2:
        alternate(2, 1 + warmup, None)  # The first one compiles.
        alternate(2, repeats, "short")


def alternate_calls(count: int, start: Start, new_tokens: int, repeats: int, warmup: int,
                    ttft: bool) -> dict[int, dict]:
    """All `count` workers alive at once (started one after the other, so no compile overlaps a timed run),
    their timed calls alternated."""
    timing = {index: {"runs": [], "short": []} for index in range(count)}
    workers: dict[int, Worker] = {}
    try:
        for index in range(count):
            worker = start(index, timing)
            if worker is not None:
                workers[index] = worker
        timed_calls(workers, timing, new_tokens, repeats, warmup, ttft)
    finally:
        for worker in workers.values():
            worker.close()
    return timing


def alternate_workers(count: int, start: Start, new_tokens: int, repeats: int, warmup: int,
                      ttft: bool) -> dict[int, dict]:
    """One worker alive at a time (models that do not fit in memory together): each runs half of the repeats
    (rounded up), the workers in the order A B C, then fresh ones C B A; the first call reported is the first
    worker's."""
    timing = {index: {"runs": [], "short": []} for index in range(count)}
    for turn in range(2):
        for index in list(timing)[::-1 if turn else 1]:
            if "error" in timing[index]:
                continue
            worker = start(index, timing)
            if worker is None:
                continue
            try:
                timed_calls({index: worker}, timing, new_tokens, (repeats + 1) // 2, warmup, ttft)
            finally:
                worker.close()
    return timing
