"""Each region's choice in a plan, with the residual bytes it was predicted to add and adds."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from remat._core.apply import region_paths
from remat.analysis import saved_residuals
from remat.analysis.machine import current_rates
from remat.planner._costs import RegionCosts, region_costs
from remat.planner._foreign import path_text
from remat.planner._plan import Plan
from remat.planner._segments import Segments
from remat.planner.steering import AS_WRITTEN, apply_policies
from remat.policies import policy_name


def region_choices(plan: Plan, step_fn: Callable[..., Any], *args: Any) -> list[dict[str, Any]]:
    """Per region of ``plan.chosen``: its policy, and the residual bytes it adds to full rematerialization.

    ``predicted_bytes`` is the cost model's figure: what the region's body keeps under its
    policy above what it keeps under ``"nothing"``, times the runs one step makes of it (a
    region in a scanned body, once per trip) (:func:`remat.planner._costs.region_costs`,
    the default search's per-region kept bytes). ``measured_bytes`` is one trace of the
    whole step with this region as planned and every other region fully rematerialized
    (policy ``"nothing"``), less the all-``"nothing"`` trace: the region's own kept
    values, its input aside.

    Args:
      plan: a feasible plan of ``step_fn``.
      step_fn, *args: the step and its example arguments, as planned.

    Returns:
      ``[{"index", "path", "policy", "predicted_bytes", "measured_bytes"}, ...]`` in trace
      order (``path``: the module, None for a region written by hand).

    Example:
      >>> region_choices(p, loss, params, x)[0]["policy"]  # doctest: +SKIP
      'dots'
    """
    chosen = plan.chosen
    if chosen is None or chosen.whole_step or chosen.scan is not None or chosen.sequential is not None:
        return []
    n = len(chosen.policies)
    # the plan's paths name every region it decides (foreign ones too, remat.planner._foreign)
    paths = list(plan.region_paths) if plan.region_paths is not None else region_paths(step_fn, *args)
    foreign = plan.foreign_regions
    base = saved_residuals(apply_policies(step_fn, ("nothing",) * n, foreign=foreign), *args).residual_bytes
    # a split region is costed by its parts' options, layer by layer
    parts = [o for p in chosen.policies for _, o in (p.parts if isinstance(p, Segments) else ((1, p),))]
    options = list({policy_name(p): p for p in ("nothing", *parts) if policy_name(p) != AS_WRITTEN}.items())
    # only the kept bytes are read, which no rate changes
    costs = region_costs(step_fn, args, n, [p for _, p in options], rates=current_rates())
    column = {label: j for j, (label, _) in enumerate(options)}
    out = []
    for i, spec in enumerate(chosen.policies):
        label = policy_name(spec)
        alone = ("nothing",) * i + (spec,) + ("nothing",) * (n - i - 1)
        measured = saved_residuals(apply_policies(step_fn, alone, foreign=foreign), *args).residual_bytes - base
        predicted = _predicted(costs, i, spec, column)
        path = paths[i] if i < len(paths) else None
        text = None if path is None else path_text(path) if i in foreign else ".".join(map(str, path))
        out.append({"index": i, "path": text, "policy": label,
                    "predicted_bytes": None if predicted is None else int(predicted), "measured_bytes": measured})
    return out


def _predicted(costs: RegionCosts | None, i: int, spec: Any, column: dict[str, int]) -> float | None:
    """Region ``i``'s kept bytes under ``spec`` above ``"nothing"``'s (column 0), for all its
    runs; a split's, its parts' for their layers (None: not costed)."""
    parts = spec.parts if isinstance(spec, Segments) else ((costs.runs(i) if costs is not None else 1, spec),)
    if costs is None or any(policy_name(o) not in column for _, o in parts):
        return None
    return sum(count * (costs.kept[i][column[policy_name(o)]] - costs.kept[i][0]) for count, o in parts)
