"""Timing programs side by side: warm-up, interleaved rounds, medians.

Every step time remat reports (:func:`remat.analysis.compare_policies`, :func:`remat.plan`,
the cost model's :func:`remat.analysis.machine.calibrate`, the benchmarks) comes from
:func:`time_programs`. Programs are timed in rounds: each round runs every program once,
in an order that rotates from round to round, so that a slow spell of the machine, or
the program that happens to run first, is shared out instead of landing on one program.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

__all__ = ["Timings", "time_programs", "warm_up"]


@dataclasses.dataclass(frozen=True)
class Timings:
    """Seconds of every timed call, one tuple per program (in the order given)."""

    samples_s: tuple[tuple[float, ...], ...]

    def __len__(self) -> int:
        return len(self.samples_s)

    def __getitem__(self, i: int) -> tuple[float, ...]:
        return self.samples_s[i]

    def medians_s(self) -> list[float]:
        """The median seconds of each program."""
        return [statistics.median(s) for s in self.samples_s]

    def medians_ms(self) -> list[float]:
        """The median milliseconds of each program."""
        return [1e3 * m for m in self.medians_s()]

    def paired_ms(self) -> list[float]:
        """Each program's time with the machine's slow spells taken out, in milliseconds.

        Every round runs each program once, back to back, so a spell that slows the machine
        slows the whole round: each sample is divided by its round's median (of all the
        programs), the median of those ratios is taken over the rounds, and the result is
        scaled back by the median round. Two programs' ``paired_ms`` compare as the median
        of their per-round ratio does, which moves less between runs than their medians do.
        """
        rounds = list(zip(*self.samples_s))  # every program's samples in round order
        if not rounds:
            return []
        typical = [statistics.median(r) for r in rounds]
        scale = 1e3 * statistics.median(typical)
        return [scale * statistics.median(s / t for s, t in zip(samples, typical)) for samples in self.samples_s]

    def minima_s(self) -> list[float]:
        """The fastest call of each program, in seconds."""
        return [min(s) for s in self.samples_s]


def _timed(program: Callable[[], Any], calls: int = 1) -> float:
    """Seconds per call of ``calls`` calls one after the other, each waited for."""
    t0 = time.perf_counter()
    for _ in range(calls):
        out = jax.block_until_ready(program())
        del out  # freed before the next call, as a training loop frees it after the step
    return (time.perf_counter() - t0) / calls


def warm_up(programs: Sequence[Callable[[], Any]], times: int = 1) -> None:
    """Runs every program ``times`` times (round by round), untimed."""
    for _ in range(times):
        for p in programs:
            _timed(p)


def time_programs(
    programs: Sequence[Callable[[], Any]],
    rounds: int,
    *,
    warmup: int = 1,
    groups: Sequence[Sequence[int]] | None = None,
    before_group: Callable[[Sequence[int]], Any] | None = None,
    min_sample_s: float = 0.0,
) -> Timings:
    """Times several programs in interleaved rounds, after ``warmup`` untimed rounds.

    Each call's result is waited for (``jax.block_until_ready``; other results are taken
    as they are) before the clock stops.

    Args:
      programs: zero-argument callables, e.g. ``functools.partial(compiled, *args)``.
      rounds: timed calls of each program.
      warmup: untimed calls of each program first.
      groups: optional partition of the program indices (e.g. by framework): within a
        round the groups run one after the other, their order rotating from round to
        round, and each group's programs back to back, their order rotating too.
        Default: one group of all programs.
      before_group: called with a group's indices before it runs in each round (e.g. to
        pause and wake that group's threads); not timed.
      min_sample_s: each sample is the mean of as many back-to-back calls as make up at
        least this long (from one timed call after the warm-up): a millisecond step timed
        one call at a time shows the clock's and the scheduler's jitter more than its
        own time. 0: one call per sample.

    Returns:
      :class:`Timings`; ``.medians_ms()`` is what to compare.

    Example:
      >>> import functools, jax, jax.numpy as jnp
      >>> x = jnp.ones((256, 256))
      >>> f, g = jax.jit(lambda x: x @ x), jax.jit(lambda x: x + 1)
      >>> t = time_programs([functools.partial(f, x), functools.partial(g, x)], rounds=5)
      >>> len(t[0]), len(t[1])
      (5, 5)
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    if warmup < 0:
        raise ValueError(f"warmup must be at least 0, got {warmup}")
    n = len(programs)
    order = [list(g) for g in groups] if groups is not None else [list(range(n))]
    if sorted(i for g in order for i in g) != list(range(n)) or not all(order):
        raise ValueError(f"groups must split the program indices 0..{n - 1} into non-empty parts, got {groups}")
    warm_up(programs, warmup)
    calls = [1] * n
    if min_sample_s > 0:
        calls = [max(1, math.ceil(min_sample_s / max(_timed(p), 1e-6))) for p in programs]
    samples: list[list[float]] = [[] for _ in programs]
    for r in range(rounds):
        for group in order[r % len(order):] + order[:r % len(order)]:
            k = r % len(group)
            group = group[k:] + group[:k]
            if before_group is not None:
                before_group(group)
            for i in group:
                samples[i].append(_timed(programs[i], calls[i]))
    return Timings(tuple(tuple(s) for s in samples))
