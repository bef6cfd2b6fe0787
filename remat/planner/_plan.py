"""The planner's answer: the chosen candidate, every candidate weighed, and why."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from remat._core.residuals import format_bytes
from remat.planner._candidate import PlanCandidate
from remat.planner._footprint import Footprint
from remat.planner._saved import read_plan, saved_fields
from remat.planner.steering import apply_policies


@dataclasses.dataclass(frozen=True)
class Plan:
    """What :func:`remat.plan` found.

    Attributes:
      memory_budget: the budget asked for, a fraction of ``none_temp_bytes``.
      limit_bytes: the most compiled temp memory allowed.
      none_temp_bytes: the un-checkpointed step's compiled temp memory.
      num_regions: the checkpointed regions one trace of the step goes through.
      feasible: whether a candidate fits.
      chosen: the plan (None when nothing fits).
      candidates: every candidate weighed.
      minimum_bytes: the least temp memory any compiled candidate reached.
      plan_s: seconds the planning took.
      compile_s: seconds one compile of the un-checkpointed step took in the same run
        (None: it came compiled from the cache).
      memory_limit_bytes: the device limit asked for (``memory_limit=``; None: a budget).
      device_bytes: the chosen plan's compiled footprint on one device: arguments +
        outputs + temp - aliased (None: nothing fits).
      footprint: the chosen plan's :class:`~remat.planner._footprint.Footprint`, or where
        nothing fits, the leanest candidate's.
      region_paths: each region's module path, in trace order (None for a region written
        by hand); :meth:`apply` checks the step against them.
      not_offloaded: why offloading the step's tagged values to host memory was not
        weighed, in one line (None: it was, or the step tags none).
      foreign_regions: the positions of the regions written with ``jax.checkpoint``,
        ``nnx.remat`` or ``nn.remat`` (their paths name the transform, the function and
        its number of inputs); the others are ``remat.checkpoint`` regions.
      not_split: why a scanned region was not offered segment splits, in one line
        (None: every scanned region was, or none is in a scan).
      not_timed: why the fitting candidates were not timed, in one line (None: they
        were, one program fits, or ``measure=`` said which).
    """

    memory_budget: float
    limit_bytes: int
    none_temp_bytes: int
    num_regions: int
    feasible: bool
    chosen: PlanCandidate | None
    candidates: tuple[PlanCandidate, ...]
    minimum_bytes: int
    plan_s: float | None = None
    compile_s: float | None = None
    memory_limit_bytes: int | None = None
    device_bytes: int | None = None
    footprint: Footprint | None = None
    region_paths: tuple[Any, ...] | None = None
    not_offloaded: str | None = None
    foreign_regions: tuple[int, ...] = ()
    not_split: str | None = None
    not_timed: str | None = None

    def apply(self, step_fn: Callable[..., Any]) -> Callable[..., Any]:
        """``step_fn`` with the plan's choice for every checkpointed region (at trace time).

        A trace whose regions are not the plan's (another module at some position, more
        or fewer regions) raises a one-line ValueError naming the first that differs:
        a plan is never applied in part."""
        if self.chosen is None:
            raise ValueError(self.shortfall())
        return apply_policies(step_fn, self.chosen.policies, scan=self.chosen.scan,
                              sequential=self.chosen.sequential, whole_step=self.chosen.whole_step,
                              paths=self.region_paths, foreign=self.foreign_regions)

    def shortfall(self) -> str:
        """Why nothing fits, in one line."""
        if self.memory_limit_bytes is not None and self.footprint is not None:
            return (f"the memory limit {format_bytes(self.memory_limit_bytes)} cannot be met: the least footprint "
                    f"found is {format_bytes(self.footprint.device_bytes)}, mostly {self.footprint.dominant()}; "
                    "no checkpointing shrinks parameters or optimizer state")
        return (f"the memory budget {self.memory_budget} cannot be met: the smallest compiled temp memory "
                f"found is {self.minimum_bytes} bytes ({self.minimum_bytes / max(self.none_temp_bytes, 1):.2f} "
                "of no checkpoint); raise the budget or use remat.scan")

    def save(self, path: Any) -> None:
        """Writes the chosen plan to ``path`` as JSON: a format version, the step's region
        paths, each region's option, the scan and sequential choices, the limit, the
        measured bytes and time, and the jax and remat versions.

        Example:
          >>> p.save("plan.json"); remat.Plan.load("plan.json").apply(loss)  # doctest: +SKIP
        """
        if self.chosen is None:
            raise ValueError(f"nothing to save: {self.shortfall()}")
        with open(path, "w") as f:
            json.dump(saved_fields(self), f, indent=1)

    @classmethod
    def load(cls, path: Any) -> Plan:
        """The plan :meth:`save` wrote to ``path``: its chosen candidate and region paths,
        ready for :meth:`apply` to the same step (in any process)."""
        fields = read_plan(path)
        return cls(**fields)

    @property
    def runner_up(self) -> PlanCandidate | None:
        """The next best fitting candidate: the fastest compiled one whose program is not the
        chosen one's, else the fastest one the default search's model predicts to fit."""
        if self.chosen is None:
            return None
        others = [c for c in self.candidates if c.contends and c.program != self.chosen.program]
        if others:
            return min(others, key=PlanCandidate.speed_ms)
        # the default search compiles little: the fastest other candidate its model
        # predicts to fit, not compiled
        predicted = [c for c in self.candidates if c.compiled is None and c.estimated_ms is not None
                     and c.estimated_temp_bytes is not None and c.estimated_temp_bytes <= self.limit_bytes]
        return min(predicted, key=lambda c: c.estimated_ms or 0.0, default=None)

    @property
    def faster_over_limit(self) -> PlanCandidate | None:
        """The compiled candidate predicted faster than the chosen one that misses the limit
        by the fewest bytes: what a little more memory would buy."""
        if self.chosen is None:
            return None
        chosen_ms = self.chosen.compiled_ms()
        faster = [c for c in self.candidates if c.temp_bytes is not None and not c.fits
                  and c.compiled_ms() < chosen_ms]
        return min(faster, key=PlanCandidate.compiled_temp_bytes, default=None)

    def why(self) -> list[str]:
        """What the alternatives would have cost: the runner-up's time, the nearest faster
        candidate's bytes over the limit; why host offload or a scanned stack's segment
        splits were not weighed, and why the fitting candidates were not timed, if so."""
        lines: list[str] = []
        note = [n for n in (self.not_offloaded, self.not_split, self.not_timed) if n is not None]
        if self.chosen is None:
            return note
        up = self.runner_up
        if up is not None and up.compiled is None and up.estimated_ms is not None:
            chosen_ms = self.chosen.estimated_ms or self.chosen.compiled_ms()
            lines.append(f"runner-up (predicted, not compiled): {up.label} "
                         f"({format_bytes(up.estimated_temp_bytes or 0)} predicted), "
                         f"{100 * (up.estimated_ms / chosen_ms - 1):+.1f}% predicted step time")
        elif up is not None:
            chosen_ms, up_ms = self.chosen.speed_ms(), up.speed_ms()
            kind = "measured" if up.measured_ms is not None else "predicted"
            lines.append(f"runner-up: {up.label} ({format_bytes(up.compiled_temp_bytes())}), "
                         f"{100 * (up_ms / chosen_ms - 1):+.1f}% step time ({kind} {up_ms:.2f} ms)")
        over = self.faster_over_limit
        if over is not None:
            over_bytes = over.compiled_temp_bytes() - self.limit_bytes
            lines.append(f"faster but over the limit: {over.label}, {format_bytes(over_bytes)} over "
                         f"({100 * (over.compiled_ms() / self.chosen.compiled_ms() - 1):+.1f}% predicted time)")
        return lines + note

    def to_dict(self) -> dict[str, Any]:
        return {"memory_budget": self.memory_budget, "limit_bytes": self.limit_bytes,
                "memory_limit_bytes": self.memory_limit_bytes, "device_bytes": self.device_bytes,
                "footprint": self.footprint.to_dict() if self.footprint else None,
                "none_temp_bytes": self.none_temp_bytes, "num_regions": self.num_regions,
                "feasible": self.feasible, "minimum_bytes": self.minimum_bytes,
                "plan_s": self.plan_s, "compile_s": self.compile_s,
                "chosen": self.chosen.to_dict() if self.chosen else None,
                "runner_up": self.runner_up.to_dict() if self.runner_up else None,
                "faster_over_limit": self.faster_over_limit.to_dict() if self.faster_over_limit else None,
                "why": self.why(),
                "candidates": [c.to_dict() for c in self.candidates]}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        mib = 2**20
        lines = [f"remat plan: memory budget {self.memory_budget} of {self.none_temp_bytes / mib:.1f} MiB "
                 f"(limit {self.limit_bytes / mib:.1f} MiB), {self.num_regions} checkpointed regions"]
        if self.memory_limit_bytes is not None:
            shown = format_bytes(self.device_bytes) if self.device_bytes is not None else "-"
            lines.append(f"  memory limit {format_bytes(self.memory_limit_bytes)} per device; the plan's "
                         f"footprint {shown}")
        if not self.feasible:
            lines.append(f"  the budget cannot be met: the minimum found is {self.minimum_bytes / mib:.1f} MiB "
                         f"({self.minimum_bytes / max(self.none_temp_bytes, 1):.2f} of no checkpoint)")
            if self.memory_limit_bytes is not None:
                lines.append(f"  {self.shortfall()}")
        lines.append(f"  {'':2}{'candidate':<42}{'temp MiB':>10}{'of none':>9}{'fits':>6}"
                     f"{'pred ms':>9}{'meas ms':>9}")
        for c in self.candidates:
            mark = "->" if self.chosen is not None and c.label == self.chosen.label else "  "
            meas = f"{c.measured_ms:9.2f}" if c.measured_ms is not None else f"{'-':>9}"
            if c.temp_bytes is None:  # rejected before compiling
                lines.append(f"  {mark}{c.label:<42}{'-':>10}{'-':>9}{'no':>6}{'-':>9}{meas}")
                continue
            lines.append(f"  {mark}{c.label:<42}{c.temp_bytes / mib:>10.1f}"
                         f"{c.temp_bytes / self.none_temp_bytes:>9.2f}{'yes' if c.fits else 'no':>6}"
                         f"{c.predicted_ms:>9.2f}{meas}")
        return "\n".join(lines + [f"  {line}" for line in self.why()])
