"""``remat.plan``: the fastest rematerialization of a whole training step that fits a memory budget.

The step is the user's own loss function, with ``remat.checkpoint`` (or
``checkpoint_sequential``, or ``remat.scan_layers``) around its blocks as usual. While the
planner traces it, it re-decides every checkpointed region (through a hook in
:func:`remat.checkpoint`'s one dispatch): checkpoint it or not, and with which policy.
Regions written with ``jax.checkpoint``, ``nnx.remat`` or ``nn.remat`` are re-decided in
the step's jaxpr instead (``_foreign``). The
guide, with the candidate families and how the search weighs them, is ``docs/planner.md``.

What a user reads here: :func:`plan`, its result :class:`Plan`, each candidate weighed
(:class:`PlanCandidate`, whose policies may be ``AS_WRITTEN`` and whose scan groups may be
a :class:`Binomial` schedule), and per region, :func:`region_choices` and
:func:`region_paths`. The search's machinery lives in the modules: ``steering`` (what a
candidate changes in a trace), ``_families`` (the candidates), ``_search`` (tracing, early
rejection, one compile per distinct program), ``programs`` (fingerprints, predicted and
measured times), ``_planner`` (:func:`plan`) and ``_plan`` (:class:`Plan`), ``_mixed`` (the
first-k assignments of the compile-everything search), the default search's ``_fast`` (its
per-region model and finalists), ``_costs`` (each region's recompute time under each
policy) and ``_assign`` (the exact per-region assignment), and ``_region_choices`` (each
region's choice and bytes). The machine's rates the predictions are priced at are
:mod:`remat.analysis.machine`'s.
"""
from __future__ import annotations

from remat._core.apply import region_paths
from remat.planner._candidate import PlanCandidate
from remat.planner._plan import Plan
from remat.planner._planner import plan
from remat.planner._region_choices import region_choices
from remat.planner.steering import AS_WRITTEN, Binomial

__all__ = ["AS_WRITTEN", "Binomial", "Plan", "PlanCandidate", "plan", "region_choices", "region_paths"]
