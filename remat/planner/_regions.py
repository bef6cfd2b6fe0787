"""Each region's choice in a plan, with the residual bytes it was predicted to add and adds."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from remat._core.apply import region_paths
from remat.analysis import saved_residuals
from remat.planner._plan import Plan
from remat.planner.programs import _spec_label
from remat.planner.steering import AS_WRITTEN, apply_policies


def region_choices(plan: Plan, step_fn: Callable[..., Any], *args: Any) -> list[dict[str, Any]]:
    """Per region of ``plan.chosen``: its policy, and the residual bytes it adds to full rematerialization.

    ``predicted_bytes`` is the cost model's figure: the uniform candidate of the same
    policy, its residual bytes above the all-``"nothing"`` candidate's, divided over the
    regions (None where no uniform candidate of that policy was traced).
    ``measured_bytes`` is one trace with this region as planned and every other region
    fully rematerialized (policy ``"nothing"``), less the all-``"nothing"`` trace: the
    region's own kept values, its input aside.

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
    paths = region_paths(step_fn, *args)
    base = saved_residuals(apply_policies(step_fn, ("nothing",) * n), *args).residual_bytes
    uniform = {}
    for c in plan.candidates:
        labels = {_spec_label(p) for p in c.policies}
        if len(labels) == 1 and len(c.policies) == n and not c.whole_step and c.residual_bytes is not None:
            uniform.setdefault(labels.pop(), c.residual_bytes)
    out = []
    for i, spec in enumerate(chosen.policies):
        label = _spec_label(spec)
        alone = ("nothing",) * i + (spec,) + ("nothing",) * (n - i - 1)
        measured = saved_residuals(apply_policies(step_fn, alone), *args).residual_bytes - base
        predicted = (uniform[label] - base) / n if label in uniform and label != AS_WRITTEN else None
        path = paths[i] if i < len(paths) else None
        out.append({"index": i, "path": ".".join(map(str, path)) if path is not None else None, "policy": label,
                    "predicted_bytes": None if predicted is None else int(predicted), "measured_bytes": measured})
    return out
