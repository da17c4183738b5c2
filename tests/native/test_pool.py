"""The kernels' thread pool: how it waits (spins or sleeps) changes neither a result nor who finishes.

Each case runs in a fresh process, since the pool takes its settings once, when it is made: products through
the plain entry points (kernels.h) from numpy with ctypes, their outputs hashed, the pool's counters read back
(`native.pool_counts`). Nothing here is timed: the waiting's speed is measured by `benchmarks/variants.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import requires_kernels
from xlagen import native
from xlagen.cli.bench_timing import busy_processes

pytestmark = requires_kernels

# Float32 products of 1 row (streamed) and 40 (many rows) and an argmax from `threads` Python threads at once
# (ctypes lets go of the GIL: the pool is busy for one, which then computes alone), `rounds` times each,
# every result checked against the first one's and against numpy; prints the outputs' hash and the counters.
CHILD = textwrap.dedent("""
    import ctypes, hashlib, json, sys, threading
    import numpy as np
    from xlagen import native

    threads, rounds = int(sys.argv[1]), int(sys.argv[2])
    library = native.library.opened()
    def entry(name, *types):
        function = getattr(library, name)
        function.argtypes, function.restype = list(types), ctypes.c_char_p
        return function
    P, I = ctypes.c_void_p, ctypes.c_int
    product, many = entry("xlagen_f32_product", P, P, P, I, I, I), entry("xlagen_f32_many_product", P, P, P, I, I, I)
    argmax = entry("xlagen_argmax", P, P, I, I)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((768, 2304)).astype(np.float32)
    inputs = [rng.standard_normal((m, 768)).astype(np.float32) for m in (1, 40)]
    scores = rng.standard_normal((8, 50257)).astype(np.float32)
    p = lambda a: a.ctypes.data_as(ctypes.c_void_p)

    def run():
        outputs = []
        for x, call in zip(inputs, (product, many)):
            y = np.empty((x.shape[0], w.shape[1]), np.float32)
            assert call(p(x), p(w), p(y), x.shape[0], 768, 2304) is None
            outputs.append(y)
        best = np.empty(8, np.int32)
        assert argmax(p(scores), p(best), 8, 50257) is None
        return outputs + [best]

    first = run()
    for x, y in zip(inputs, first):
        np.testing.assert_allclose(y, x @ w, rtol=1e-4, atol=1e-3)
    assert (first[2] == scores.argmax(axis=1)).all()
    failures = []
    def repeat():
        try:
            for _ in range(rounds):
                assert all((a == b).all() for a, b in zip(run(), first)), "a result changed"
        except BaseException as error:
            failures.append(repr(error))
    workers = [threading.Thread(target=repeat) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not failures, failures
    digest = hashlib.sha256(b"".join(a.tobytes() for a in first)).hexdigest()
    print(json.dumps({"digest": digest, "counts": native.pool_counts()}))
""")


def _run(env: dict[str, str], threads: int = 1, rounds: int = 20) -> dict:
    """The child's record, in a process whose pool takes `env`'s XLAGEN_NATIVE_* variables (unset: default)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("XLAGEN_NATIVE_")}
    # A deadlock fails the test by the timeout rather than hanging the suite.
    out = subprocess.run([sys.executable, "-c", CHILD, str(threads), str(rounds)], env={**environ, **env},
                         capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("spin", [None, "0", "40"])
def test_the_spin_bound_is_the_environments_and_zero_never_spins(spin):
    record = _run({"XLAGEN_NATIVE_THREADS": "2", **({"XLAGEN_NATIVE_SPIN_US": spin} if spin else {})})
    counts = record["counts"]
    assert counts["threads"] == 2 and counts["tasks"] >= 3 * 21
    assert counts["spin_us"] == (int(spin) if spin else native.constant("default_spin_us"))
    if spin == "0":
        # No thread spins, so nothing needs the machine's runnable threads counted.
        assert counts["spun_ns"] == 0 and counts["samples"] == counts["crowded_samples"] == 0


def test_results_are_the_same_however_the_pool_waits():
    digests = {spin: _run({"XLAGEN_NATIVE_THREADS": "2", "XLAGEN_NATIVE_SPIN_US": spin})["digest"]
               for spin in ("0", "40", "600")}
    assert len(set(digests.values())) == 1, digests


@pytest.mark.parametrize("pool_threads", ["2", "3"])
@pytest.mark.parametrize("spin", ["0", "5", "600"])
def test_nothing_hangs_from_two_threads_beside_busy_processes(pool_threads, spin):
    # More runnable threads than cores: workers preempted mid-chunk, callers that sleep for them, a pool found
    # busy by the other thread; 3 pool threads on fewer cores have more workers than spin slots.
    with busy_processes(4):
        record = _run({"XLAGEN_NATIVE_THREADS": pool_threads, "XLAGEN_NATIVE_SPIN_US": spin}, threads=2,
                      rounds=60)
    assert record["counts"]["threads"] == int(pool_threads)
    assert record["counts"]["tasks"] > 0
