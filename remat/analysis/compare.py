"""Checkpoint policies side by side: residual bytes, compiled temp bytes and step time."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

from remat._core.residuals import format_bytes, saved_residuals
from remat._names import POLICY_NAMES, is_no_checkpoint
from remat.analysis.compiled import compiled_step
from remat.analysis.timing import time_programs
from remat.policies import policy_name

#: Every named policy and no checkpoint, the order reports list them in.
DEFAULT_POLICIES: tuple[str, ...] = POLICY_NAMES


@dataclasses.dataclass(frozen=True)
class PolicyResult:
    """One row of :class:`PolicyComparison`.

    Attributes:
      policy: the policy's name.
      residual_bytes: bytes kept for the backward beyond the inputs
        (:attr:`ResidualReport.residual_bytes`).
      residual_count: number of residuals, inputs included.
      temp_bytes: compiled scratch bytes of ``jax.jit(jax.grad(loss))``.
      peak_bytes: compiled peak estimate (:attr:`CompiledMemory.peak_bytes`).
      step_time_s: median wall time of one gradient step.
      step_times_s: every timed step.
    """

    policy: str
    residual_bytes: int
    residual_count: int
    temp_bytes: int
    peak_bytes: int
    step_time_s: float
    step_times_s: tuple[float, ...]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["step_times_s"] = list(self.step_times_s)
        return d


@dataclasses.dataclass(frozen=True)
class PolicyComparison:
    """Residual bytes, compiled bytes and step time per checkpoint policy."""

    results: tuple[PolicyResult, ...]
    xla_flags: str = ""

    def __getitem__(self, policy: str) -> PolicyResult:
        for r in self.results:
            if r.policy == policy:
                return r
        raise KeyError(f"no policy {policy!r} in this comparison; have {[r.policy for r in self.results]}")

    def __iter__(self):
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)

    @property
    def columns(self) -> list[str]:
        return ["policy", "residuals", "residual bytes", "compiled temp", "compiled peak", "step (ms)",
                "temp vs no checkpoint"]

    def rows(self) -> list[list[str]]:
        """Table rows for people (bytes formatted, time in ms)."""
        base = next((r for r in self.results if is_no_checkpoint(r.policy)), None)
        rows = []
        for r in self.results:
            rel = f"{r.temp_bytes / base.temp_bytes:.2f}x" if base and base.temp_bytes else "-"
            rows.append([
                r.policy, str(r.residual_count), format_bytes(r.residual_bytes), format_bytes(r.temp_bytes),
                format_bytes(r.peak_bytes), f"{r.step_time_s * 1e3:.2f}", rel,
            ])
        return rows

    def to_dict(self) -> dict[str, Any]:
        return {"xla_flags": self.xla_flags, "results": [r.to_dict() for r in self.results]}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        table = [self.columns, *self.rows()]
        widths = [max(len(row[i]) for row in table) for i in range(len(self.columns))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in table]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike, title: str | None = None) -> str:
        """Writes a PNG: compiled temp bytes and residual bytes against step time.

        Args:
          path: the PNG file to write.
          title: the figure title.

        Returns:
          ``str(path)``.
        """
        # lazily: importing remat.analysis must stay light; a Figure with its own Agg canvas
        # leaves the host program's pyplot backend alone
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6.4, 4.2), dpi=120)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        ms = [r.step_time_s * 1e3 for r in self.results]
        temp = [r.temp_bytes / 2**20 for r in self.results]
        res = [r.residual_bytes / 2**20 for r in self.results]
        ax.scatter(ms, temp, marker="o", label="compiled temp (XLA)")
        ax.scatter(ms, res, marker="x", label="residuals (jax.vjp)")
        for r, x, y in zip(self.results, ms, temp):
            ax.annotate(r.policy, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.set_xlabel("median step time (ms)")
        ax.set_ylabel("MiB")
        ax.set_title(title or "checkpoint policies: memory vs time")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.fspath(path), format="png")
        return os.fspath(path)




def _loss_for(fn: Callable, policy: Any) -> Callable:
    """``fn(policy)`` for a factory; ``partial(fn, policy=policy)`` for a loss with ``policy=``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    p = params.get("policy")
    others = [n for n in params if n != "policy"]
    if p is not None and (others or p.kind is inspect.Parameter.KEYWORD_ONLY):
        return functools.partial(fn, policy=policy)
    loss = fn(policy)
    if not callable(loss):
        raise TypeError(
            f"compare_policies: fn(policy) returned {type(loss).__name__}; pass a factory "
            "policy -> loss_fn, or a loss with a policy= keyword"
        )
    return loss


def compare_policies(
    fn: Callable,
    *args: Any,
    policies: Sequence[Any] = DEFAULT_POLICIES,
    argnums: int | Sequence[int] = 0,
    steps: int = 5,
    warmup: int = 1,
    **kwargs: Any,
) -> PolicyComparison:
    """Residual bytes, compiled temp bytes and step time of a loss under several policies.

    ``fn`` is either a factory ``fn(policy) -> loss`` or a loss taking a ``policy=``
    keyword (detected from its signature: a ``policy`` parameter alongside others, or
    keyword-only). It receives each entry of ``policies`` as it is; ``NO_CHECKPOINT`` means
    "no checkpoint at all", which :func:`remat.checkpoint` (``policy=``) implements for you.

    For each policy the gradient ``jax.jit(jax.grad(loss, argnums))`` is compiled once
    (:func:`remat.analysis.compiled.compiled_step`); its ``memory_analysis()`` gives the
    bytes and the same executables are timed side by side
    (:func:`remat.analysis.timing.time_programs`: ``warmup`` untimed rounds, then
    ``steps`` interleaved rounds; the median is reported).

    Args:
      fn: the policy-parametrised loss (see above); the loss returns a scalar.
      *args: example inputs of the loss.
      policies: policy spellings to try, in table order.
      argnums: the loss arguments to differentiate.
      steps: timed steps per policy (at least 5 gives a usable median).
      warmup: untimed steps first.
      **kwargs: keyword inputs of the loss (traced).

    Returns:
      A :class:`PolicyComparison`; ``str()`` is a table, ``.plot(path)`` a PNG.

    Example:
      >>> import jax, jax.numpy as jnp, remat
      >>> def make_loss(policy):
      ...     block = remat.checkpoint(lambda w, x: jnp.tanh(x @ w), policy=policy)
      ...     def loss(ws, x):
      ...         for w in ws:
      ...             x = block(w, x)
      ...         return jnp.sum(x ** 2)
      ...     return loss
      >>> ws = [jnp.eye(64)] * 4
      >>> table = compare_policies(make_loss, ws, jnp.ones((32, 64)))  # doctest: +SKIP
      >>> print(table)                                                # doctest: +SKIP
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if not policies:
        raise ValueError("policies is empty; pass at least one, e.g. policies=('no_checkpoint', 'nothing')")
    reports, steps_compiled = [], []
    for policy in policies:
        loss = _loss_for(fn, policy)
        reports.append(saved_residuals(loss, *args, **kwargs))
        steps_compiled.append(compiled_step(loss, *args, argnums=argnums, **kwargs))
    timings = time_programs([functools.partial(s.executable, *args, **kwargs) for s in steps_compiled],
                            rounds=steps, warmup=warmup)
    results = tuple(
        PolicyResult(
            policy=policy_name(policy),
            residual_bytes=report.residual_bytes,
            residual_count=len(report),
            temp_bytes=step.memory.temp_bytes,
            peak_bytes=step.memory.peak_bytes,
            step_time_s=median,
            step_times_s=times,
        )
        for policy, report, step, times, median in zip(policies, reports, steps_compiled, timings.samples_s,
                                                       timings.medians_s())
    )
    return PolicyComparison(results, xla_flags=os.environ.get("XLA_FLAGS", ""))
