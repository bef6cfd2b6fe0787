"""A plan kept on disk: the JSON :meth:`remat.planner.Plan.save` writes and :meth:`~remat.planner.Plan.load` reads."""
from __future__ import annotations

import json
import re
from typing import Any

from remat.analysis.budget import ResidualBudget
from remat.planner._candidate import PlanCandidate
from remat.planner._segments import PREFIX, Segments
from remat.planner.steering import AS_WRITTEN, Binomial
from remat.policies import NO_CHECKPOINT, offload_names, policy_name, resolve_policy

#: The format this module writes and reads; a file of another is refused, not guessed at.
FORMAT = "remat.plan/1"


def saved_fields(plan: Any) -> dict[str, Any]:
    """The JSON object of a feasible ``plan`` (a :class:`remat.planner.Plan`)."""
    import importlib.metadata

    import jax

    chosen = plan.chosen
    paths = plan.region_paths or (None,) * len(chosen.policies)
    return {
        "format": FORMAT, "versions": {"jax": jax.__version__, "remat": importlib.metadata.version("remat")},
        "label": chosen.label,
        "regions": [_region_json(p, s, i in plan.foreign_regions)
                    for i, (p, s) in enumerate(zip(paths, chosen.policies))],
        "checked_paths": plan.region_paths is not None,
        "scan": None if chosen.scan is None else {"policy": policy_name(chosen.scan[0]),
                                                   "groups": _groups_json(chosen.scan[1])},
        "sequential_segments": chosen.sequential, "whole_step": chosen.whole_step,
        "memory_budget": plan.memory_budget, "memory_limit_bytes": plan.memory_limit_bytes,
        "limit_bytes": plan.limit_bytes, "device_bytes": plan.device_bytes, "temp_bytes": chosen.temp_bytes,
        "none_temp_bytes": plan.none_temp_bytes, "measured_ms": chosen.measured_ms,
        "predicted_ms": chosen.predicted_ms,
    }


def read_plan(path: Any) -> dict[str, Any]:
    """The :class:`remat.planner.Plan` fields of the file at ``path`` (a one-line
    ValueError for a file of another format or an option this remat cannot read)."""
    with open(path) as f:
        saved = json.load(f)
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        found = saved.get("format") if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(f"{path} is not a saved remat plan of format {FORMAT!r} (found {found!r})")
    regions = saved["regions"]
    scan = saved["scan"]
    chosen = PlanCandidate(
        saved["label"], tuple(option(r["option"]) for r in regions), temp_bytes=saved["temp_bytes"],
        predicted_ms=saved["predicted_ms"], measured_ms=saved["measured_ms"], fits=True,
        scan=None if scan is None else (option(scan["policy"]), _groups(scan["groups"])),
        sequential=saved["sequential_segments"], whole_step=saved["whole_step"])
    paths = tuple(None if r["path"] is None else tuple(r["path"]) for r in regions)
    return {"memory_budget": saved["memory_budget"], "limit_bytes": saved["limit_bytes"],
            "none_temp_bytes": saved["none_temp_bytes"], "num_regions": len(regions), "feasible": True,
            "chosen": chosen, "candidates": (chosen,), "minimum_bytes": saved["temp_bytes"],
            "memory_limit_bytes": saved["memory_limit_bytes"], "device_bytes": saved["device_bytes"],
            "region_paths": paths if saved.get("checked_paths", True) else None,
            "foreign_regions": tuple(i for i, r in enumerate(regions) if r.get("foreign", False))}


def _region_json(path: Any, spec: Any, foreign: bool) -> dict[str, Any]:
    """One region's entry: its path, its option, and ``"foreign": true`` for a region
    written with ``jax.checkpoint``, ``nnx.remat`` or ``nn.remat``."""
    entry = {"path": None if path is None else list(path), "option": policy_name(spec)}
    return {**entry, "foreign": True} if foreign else entry


_BUDGET = re.compile(r"^residual_budget\(([0-9.eE+-]+)\)$")


def option(name: str) -> Any:
    """The policy spec a saved option name stands for (the inverse of ``policy_name``).

    Example:
      >>> option("names:attn_out,mlp_hidden")
      ('attn_out', 'mlp_hidden')
      >>> option("offload:attn_out")
      offload_names('attn_out')
      >>> option("layers 0-1: nothing; 2-5: dots").parts
      ((2, 'nothing'), (4, 'dots'))
    """
    if name == policy_name(NO_CHECKPOINT):
        return NO_CHECKPOINT
    if name == AS_WRITTEN:
        return AS_WRITTEN
    if name.startswith("names:"):
        return tuple(name[len("names:"):].split(","))
    if name.startswith("offload:"):
        return offload_names(*name[len("offload:"):].split(","))
    if name.startswith(PREFIX):  # a scanned stack split into segments
        return Segments.parse(name, option)
    budget = _BUDGET.match(name)
    if budget is not None:
        return ResidualBudget(float(budget.group(1)))
    try:
        resolve_policy(name)
    except (ValueError, TypeError) as e:
        raise ValueError(f"the saved plan's option {name!r} is not one this remat knows ({e})") from None
    return name


def _groups_json(groups: Any) -> Any:
    if isinstance(groups, Binomial):
        return {"binomial_levels": groups.levels}
    return list(groups) if isinstance(groups, tuple) else groups


def _groups(saved: Any) -> Any:
    if isinstance(saved, dict):
        return Binomial(saved["binomial_levels"])
    return tuple(saved) if isinstance(saved, list) else saved
