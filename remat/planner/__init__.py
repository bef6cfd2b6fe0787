"""``remat.plan``: the fastest rematerialization of a whole training step that fits a memory budget.

The step is the user's own loss function, with ``remat.checkpoint`` (or
``checkpoint_sequential``, or ``remat.scan_layers``) around its blocks as usual. While the
planner traces it, it re-decides every checkpointed region (through a hook in
:func:`remat.checkpoint`'s one dispatch): checkpoint it or not, and with which policy. The
guide, with the candidate families and how the search weighs them, is ``docs/planner.md``.
The modules: ``steering`` (what a candidate changes in a trace), ``_families`` (the
candidates), ``_search`` (tracing, early rejection, one compile per distinct program),
``programs`` (fingerprints, predicted and measured times), ``_planner`` (:func:`plan`) and
``_plan`` (:class:`Plan`), ``_mixed`` (the first-k assignments of the compile-everything
search), the default search's ``_fast`` (its per-region model and finalists), ``_costs``
(each region's recompute time under each policy) and ``_assign`` (the exact per-region
assignment), and ``_regions`` (each region's choice and bytes).
"""
from __future__ import annotations

from remat._core.apply import region_paths
from remat.planner._candidate import CandidateSpec, PlanCandidate
from remat.planner._plan import Plan
from remat.planner._planner import plan
from remat.planner._regions import region_choices
from remat.planner._search import REJECT_MARGIN, CandidateSearch, compile_all
from remat.planner.programs import (  # noqa: F401  (private helpers the CLI and tests reach)
    _predicted_ms,
    _spec_label,
    compile_step,
    lower_step,
    lowered_fingerprint,
    program_fingerprint,
    time_side_by_side,
)
from remat.planner.steering import (  # noqa: F401  (private helpers the CLI and tests reach)
    AS_WRITTEN,
    NONE,
    Binomial,
    _survey,
    apply_policies,
    count_regions,
    scan_depths,
)

__all__ = [
    "AS_WRITTEN", "NONE", "REJECT_MARGIN", "Binomial", "CandidateSearch", "CandidateSpec", "Plan", "PlanCandidate",
    "apply_policies", "compile_all", "compile_step", "count_regions", "lower_step", "lowered_fingerprint", "plan",
    "program_fingerprint", "region_choices", "region_paths", "scan_depths", "time_side_by_side",
]
