"""Property-based suite: checkpointing changes nothing (issue 19, part 3).

Hypothesis draws small programs as JSON specs (:mod:`fuzz.strategies`); each runs in a child
worker (:mod:`fuzz.pool`) twice, with remat's checkpoints and with each checkpoint replaced by
the identity, and every value and gradient must agree: the same tree, dtypes and shapes,
floats to rtol 1e-6 (float32) or 1e-12 (float64). A failure names the spec and the command
that reproduces it, ``python -m tests.fuzz.run '<spec>'``. See docs/property-tests.md.

The fast run draws 10 cases (4 programs, two of each dtype, and 6 NNX stacks); ``-m slow``
draws 2,000 more (1,900 programs, 100 NNX stacks), with a fixed seed (derandomized).
"""
from __future__ import annotations

import numpy as np
import pytest
from fuzz.compare import assert_no_less_accurate, assert_same
from fuzz.pool import Pool, failure_report
from fuzz.strategies import function_cases, nnx_cases
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def pool():
    # one worker per dtype for the few cases of the default run (each worker is a fresh
    # interpreter that imports JAX and compiles anew); two per dtype for the many (slow) ones
    workers = Pool(per_dtype=1)
    yield workers
    workers.close()


@pytest.fixture(scope="module")
def pool_many():
    workers = Pool(per_dtype=2)
    yield workers
    workers.close()


def _settings(batches: int) -> settings:
    # derandomize: the same cases on every run (CI is reproducible); no shrinking: each example
    # is a batch, and a failing case is reported with its own reproducer
    return settings(max_examples=batches, derandomize=True, deadline=None, database=None,
                    phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))


def _check(pool: Pool, specs: list[dict]) -> None:
    results = pool.run(specs)
    report = failure_report(results)
    assert not report, f"checkpointing changed a result (reproduce with the command):\n{report}"


def _batches(strategy: st.SearchStrategy, size: int) -> st.SearchStrategy:
    return st.lists(strategy, min_size=size, max_size=size)


# two pairs, one float32 and one float64 program each (the first pair is Hypothesis's simplest
# programs, the second a random draw): both workers start and each runs one random program; the
# many (1,900, either dtype) are slow
@_settings(batches=2)
@given(specs=st.tuples(function_cases(dtype="float32"), function_cases(dtype="float64")).map(list))
def test_function_programs(pool, specs):
    _check(pool, specs)


@_settings(batches=1)
@given(specs=_batches(nnx_cases(), 6))
def test_nnx_stacks(pool, specs):
    _check(pool, specs)


@pytest.mark.slow
@_settings(batches=95)
@given(specs=_batches(function_cases(), 20))
def test_function_programs_many(pool_many, specs):
    _check(pool_many, specs)


@pytest.mark.slow
@_settings(batches=10)
@given(specs=_batches(nnx_cases(), 10))
def test_nnx_stacks_many(pool_many, specs):
    _check(pool_many, specs)


# --- the suite's own machinery --------------------------------------------------------------

@pytest.mark.slow
def test_an_abort_or_a_hang_fails_only_its_case_with_a_reproducer():
    def run(pool, action, timeout_s):
        for worker in pool.workers:  # a started worker answers at once: the hang is cut short;
            worker.timeout_s = timeout_s  # a fresh one is given the time to start
        return pool.run([{"kind": "selftest", "dtype": "float32", "action": action}])

    pool = Pool(per_dtype=1)
    try:
        results = [*run(pool, "abort", 60), *run(pool, "ok", 60), *run(pool, "hang", 1), *run(pool, "ok", 60)]
    finally:
        pool.close()
    kinds = [r["kind"] if not r["ok"] else "ok" for _, r in results]
    assert kinds[0].startswith("worker died") and kinds[2].startswith("hung"), kinds
    assert kinds[1] == kinds[3] == "ok"  # a fresh worker took over after each
    report = failure_report(results)
    assert report.count("python -m tests.fuzz.run '") == 2, report


def test_the_comparison_is_exact_on_trees_dtypes_shapes_and_tolerances():
    a = {"x": np.ones(3, np.float32), "i": np.arange(2)}
    assert_same(a, {"x": np.ones(3, np.float32) * (1 + 5e-7), "i": np.arange(2)}, 1e-6)
    wrong = [
        {"x": np.ones(3, np.float32) * (1 + 5e-6), "i": np.arange(2)},  # beyond rtol
        {"x": np.ones(3, np.float64), "i": np.arange(2)},  # dtype
        {"x": np.ones((3, 1), np.float32), "i": np.arange(2)},  # shape
        {"x": np.ones(3, np.float32), "i": np.arange(2) + 1},  # an integer off by one
        {"x": np.ones(3, np.float32), "j": np.arange(2)},  # tree
    ]
    for want in wrong:
        with pytest.raises(AssertionError):
            assert_same(a, want, 1e-6)


def test_a_float32_result_is_judged_against_float64_by_the_plain_programs_own_error():
    exact = np.array([1.0, -2.0, 3.0])
    plain = (exact * (1 + 3e-5)).astype(np.float32)  # the plain float32 program's rounding
    assert_no_less_accurate({"g": (exact * (1 - 3e-5)).astype(np.float32)}, {"g": plain}, {"g": exact}, 1e-6)
    assert_no_less_accurate({"g": exact.astype(np.float32)}, {"g": exact.astype(np.float32)}, {"g": exact}, 1e-6)
    with pytest.raises(AssertionError, match="from the float64 result"):
        assert_no_less_accurate({"g": (exact * (1 + 2e-4)).astype(np.float32)}, {"g": plain}, {"g": exact}, 1e-6)
