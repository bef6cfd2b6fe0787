"""Steering a traced step: which regions, scans and sequentials a candidate plan changes, and how."""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from remat import scan as _scan
from remat._core import hooks
from remat._core.apply_selected import take_entering_path
from remat._core.checkpoint import checkpoint
from remat._core.options import CheckpointOptions
from remat._core.residuals import names_in_jaxpr
from remat.planner import _foreign
from remat.planner._foreign import AS_WRITTEN
from remat.planner._segments import Segments, split_step
from remat.policies import is_no_checkpoint, policy_name, resolve_policy


class PlanMismatch(ValueError):
    """A plan applied to a step whose regions are not those it was made for."""


@contextlib.contextmanager
def _region_policies(policies: Sequence[Any], beyond: Any = AS_WRITTEN, paths: list[Any] | None = None,
                     expected: Sequence[Any] | None = None, positions: Sequence[int] = ()) -> Iterator[list[int]]:
    """Makes the i-th checkpointed region traced in this context use ``policies[i]`` (past
    their end, ``beyond``); appends each region's module path to ``paths``; with
    ``expected`` (the paths a saved plan was made for), a region whose path differs is a
    one-line ValueError, raised while tracing, before the region is applied. In a step
    with foreign regions too, ``positions`` are the remat regions' places among all, which
    the errors name."""
    seen = [0]
    at = _Positions(positions)

    def override(opts: CheckpointOptions) -> CheckpointOptions | None:
        i = seen[0]
        seen[0] += 1
        path = take_entering_path()
        if paths is not None:
            paths.append(path)
        if expected is not None:
            _check_region(i, path, expected, at)
        spec = policies[i] if i < len(policies) else beyond
        if spec == AS_WRITTEN:
            return opts
        if is_no_checkpoint(spec):
            return None
        return dataclasses.replace(opts, policy=resolve_policy(spec), policy_label=policy_name(spec))

    with hooks.deciding(region=override):
        yield seen
    if expected is not None and seen[0] < len(expected):
        raise PlanMismatch(f"the plan does not match this step: it has {len(expected)} {at.kind}, the step "
                         f"{seen[0]}; region {at(seen[0])} ({_path_text(expected[seen[0]])}) is missing")


@dataclasses.dataclass(frozen=True)
class _Positions:
    """The place among all the step's regions of its i-th ``remat.checkpoint`` region (all of
    them, where ``positions`` is empty: a step without foreign regions)."""

    positions: Sequence[int]

    def __call__(self, i: int) -> int:
        return self.positions[i] if i < len(self.positions) else i

    @property
    def kind(self) -> str:
        return "remat.checkpoint regions" if self.positions else "regions"


def _check_region(i: int, path: Any, expected: Sequence[Any], at: _Positions) -> None:
    """A ValueError naming region ``i`` where its ``path`` is not the plan's."""
    if i >= len(expected):
        raise PlanMismatch(f"the plan does not match this step: it has {len(expected)} {at.kind}, and the step "
                         f"reaches region {at(i)} ({_path_text(path)}) beyond them")
    if path != expected[i]:
        raise PlanMismatch(f"the plan does not match this step: region {at(i)} is {_path_text(path)} here, "
                         f"{_path_text(expected[i])} in the plan")


def _path_text(path: Any) -> str:
    return "a region written by hand" if path is None else "module " + ".".join(map(str, path))


def _foreign_policies(step_fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], policies: Sequence[Any],
                      positions: Sequence[int], expected: Sequence[Any] | None) -> Any:
    """``step_fn(*args, **kwargs)`` with its k-th foreign region (written with
    ``jax.checkpoint``, ``nnx.remat`` or ``nn.remat``; region ``positions[k]`` of the step)
    run with ``policies[k]``: the step traced to a jaxpr, those regions rewritten
    (:mod:`remat.planner._foreign`), the result evaluated here. With ``expected`` (each
    one's path, as the plan was made for), a region that differs is a :class:`PlanMismatch`,
    raised before anything is evaluated."""
    closed, run = _foreign.traced(step_fn, args, kwargs)
    found: list[Any] = []

    def decide(eqn: Any) -> Any:
        k = len(found)
        found.append(_foreign.region_path(eqn))
        if expected is not None:
            _check_foreign(k, found[-1], expected, positions)
        return _foreign.choice(policies[k] if k < len(policies) else AS_WRITTEN)(eqn)

    jaxpr = _foreign.rewrite(closed.jaxpr, decide)
    if expected is not None and len(found) < len(expected):
        raise PlanMismatch(f"the plan does not match this step: it has {len(expected)} regions written with "
                           f"jax.checkpoint or Flax's remat, the step {len(found)}; region {positions[len(found)]} "
                           f"({_foreign.path_text(expected[len(found)])}) is missing")
    return run(jaxpr)


def _check_foreign(k: int, path: Any, expected: Sequence[Any], positions: Sequence[int]) -> None:
    """A :class:`PlanMismatch` naming the step's k-th foreign region where its ``path`` is not the plan's."""
    if k >= len(expected):
        raise PlanMismatch(f"the plan does not match this step: it has {len(expected)} regions written with "
                           f"jax.checkpoint or Flax's remat, and the step has more: {_foreign.path_text(path)}")
    if tuple(path) != tuple(expected[k]):
        raise PlanMismatch(f"the plan does not match this step: region {positions[k]} is "
                           f"{_foreign.path_text(path)} here, {_foreign.path_text(expected[k])} in the plan")


@dataclasses.dataclass(frozen=True)
class Binomial:
    """Scan groups: each scan nested by :func:`remat.scan.binomial_schedule` ``(depth, levels)``."""

    levels: int

    def __str__(self) -> str:
        return f"binomial(levels={self.levels})"


@contextlib.contextmanager
def _scan_choice(choice: tuple[Any, Any] | None) -> Iterator[list[int]]:
    """Makes every scan over layers traced in this context use ``choice`` ``(policy, groups)``.

    ``groups``: None (flat), ``k`` equal groups, a schedule tuple, or :class:`Binomial`.
    """
    depths: list[int] = []

    def override(depth: int, policy: Any, groups: Any) -> tuple[Any, Any]:
        depths.append(depth)
        if choice is None:
            return policy, groups
        new_policy, new_groups = choice
        if isinstance(new_policy, Segments) and new_policy.length != depth:
            raise PlanMismatch(f"the plan does not match this step: it splits a scan over layers into {new_policy} "
                               f"({new_policy.length} layers), and the step's has {depth}")
        if isinstance(new_groups, Binomial):
            schedule = _scan.binomial_schedule(depth, new_groups.levels)
            new_groups = None if isinstance(schedule, int) else schedule
        return (policy if new_policy == AS_WRITTEN else new_policy), new_groups

    with hooks.deciding(scan=override):
        yield depths


@contextlib.contextmanager
def _sequential_choice(segments: int | None) -> Iterator[list[int]]:
    """Makes every ``checkpoint_sequential`` traced here use ``segments`` (at most its length)."""
    lengths: list[int] = []

    def override(num_functions: int, as_written: int) -> int:
        lengths.append(num_functions)
        return as_written if segments is None else min(segments, num_functions)

    with hooks.deciding(sequential=override):
        yield lengths


def apply_policies(step_fn: Callable[..., Any], policies: Sequence[Any],
                   scan: tuple[Any, Any] | None = None,
                   sequential: int | None = None, whole_step: bool = False,
                   paths: Sequence[Any] | None = None, foreign: Sequence[int] = ()) -> Callable[..., Any]:
    """``step_fn`` whose i-th checkpointed region uses ``policies[i]`` (``NO_CHECKPOINT``: no checkpoint).

    ``scan=(policy, groups)`` also re-decides every :func:`remat.scan.scan_layers` in the
    step: its per-layer policy (``NO_CHECKPOINT``: no checkpoint) and ``groups`` checkpointed
    groups (None: one flat scan). ``sequential=k`` runs every
    :func:`remat.checkpoint_sequential` with ``k`` segments (at most its length; the
    regions it makes keep the options written). ``whole_step=True`` checkpoints the whole
    step once more, around all that (policy ``"nothing"``): its backward pass keeps only
    the step's inputs and recomputes everything else, its regions checkpointed as
    ``policies`` say. With ``paths`` (each region's module path, as the plan was made
    for), a trace whose regions differ raises a ValueError naming the first that does.
    ``foreign``: the positions of the regions written with ``jax.checkpoint``, ``nnx.remat``
    or ``nn.remat`` (:attr:`Survey.foreign`), which the step's jaxpr shows rather than remat
    (:func:`_foreign_policies`); the others are ``remat.checkpoint`` regions, in order.
    A region's :class:`remat.planner._segments.Segments` runs its scan as consecutive
    scans, one per part (:func:`remat.planner._segments.split_step`).
    """
    policies = tuple(policies)
    splits = {i: p for i, p in enumerate(policies) if isinstance(p, Segments)}
    if splits:
        def uniform(options: dict[int, Any]) -> Callable[..., Any]:
            return apply_policies(step_fn, tuple(options.get(i, p) for i, p in enumerate(policies)), scan,
                                  sequential, paths=paths, foreign=foreign)

        planned_split = split_step(uniform, splits, PlanMismatch)
        planned_split.__name__ = getattr(step_fn, "__name__", "step")
        return checkpoint(planned_split, policy="nothing") if whole_step else planned_split
    theirs = tuple(foreign)
    own = [i for i in range(max(len(policies), len(paths or ()))) if i not in set(theirs)]
    own_policies = tuple(policies[i] for i in own if i < len(policies))
    own_paths = None if paths is None else [paths[i] for i in own if i < len(paths)]
    their_policies = [policies[i] if i < len(policies) else AS_WRITTEN for i in theirs]
    their_paths = None if paths is None else [paths[i] for i in theirs]

    def planned(*args: Any, **kwargs: Any) -> Any:
        with _region_policies(own_policies, expected=own_paths, positions=own if theirs else ()), \
                _scan_choice(scan), _sequential_choice(sequential):
            if not theirs or (their_paths is None and all(p == AS_WRITTEN for p in their_policies)):
                return step_fn(*args, **kwargs)  # nothing to rewrite, nothing to check
            return _foreign_policies(step_fn, args, kwargs, their_policies, theirs, their_paths)

    planned.__name__ = getattr(step_fn, "__name__", "step")
    if whole_step:
        # made outside the hooks above, so this region is not one of the step's own
        return checkpoint(planned, policy="nothing")
    return planned


def count_regions(step_fn: Callable[..., Any], *args: Any) -> int:
    """How many checkpointed regions one trace of ``step_fn(*args)`` goes through."""
    return survey(step_fn, *args).regions


def scan_depths(step_fn: Callable[..., Any], *args: Any) -> list[int]:
    """The depth of every scan over layers one trace of ``step_fn(*args)`` runs."""
    return survey(step_fn, *args).scan_depths


@dataclasses.dataclass(frozen=True)
class Survey:
    """What one trace of the step goes through."""

    regions: int  # checkpointed regions (checkpoint_sequential's segments among them)
    scan_depths: list[int]  # the depth of every scan over layers
    sequential_lengths: list[int]  # the number of functions of every checkpoint_sequential
    names: list[str]  # the checkpoint_name tags
    jaxpr: Any  # the step, every region checkpointed with policy "nothing"
    paths: list[Any] = dataclasses.field(default_factory=list)  # each region's module path (None: by hand)
    # the positions of the regions written with jax.checkpoint, nnx.remat or nn.remat (their
    # paths: remat.planner._foreign.region_path); the others are remat.checkpoint regions
    foreign: tuple[int, ...] = ()


def survey(step_fn: Callable[..., Any], *args: Any) -> Survey:
    """What one trace of ``step_fn(*args)`` goes through (:class:`Survey`)."""
    # every region "nothing": the trace counts the regions, and shows each one's body for
    # the planner's region costs (remat.planner._costs), whatever policy it was written with
    paths: list[Any] = []
    with _region_policies((), "nothing", paths), _scan_choice(None) as depths, \
            _sequential_choice(None) as lengths:
        # a fresh function each time: JAX caches traces per function, and a cached trace
        # would not run the Python code whose regions are being counted
        jaxpr = jax.make_jaxpr(lambda *a: step_fn(*a))(*args)
    regions, foreign = _with_foreign(jaxpr.jaxpr, paths)
    return Survey(len(regions), depths, lengths, names_in_jaxpr(jaxpr), jaxpr, regions, foreign)


def _with_foreign(jaxpr: Any, paths: list[Any]) -> tuple[list[Any], tuple[int, ...]]:
    """The paths of every region in trace order, the foreign regions' among remat's own
    (``paths``, from the deciders), and the positions of the foreign ones. Where the jaxpr
    does not show remat's own regions as the deciders counted them (one inside a ``while``
    loop or inside a foreign region, say), the foreign regions' places among them are not
    known, and only remat's own are planned: ``(paths, ())``."""
    found: list[Any] = []

    def note(eqn: Any) -> Any:
        found.append(_foreign.region_path(eqn) if _foreign.is_foreign(eqn) else None)
        return eqn

    _foreign.rewrite(jaxpr, note, remat_too=True)
    foreign = tuple(i for i, path in enumerate(found) if path is not None)
    if len(found) - len(foreign) != len(paths):
        return paths, ()
    own = iter(paths)
    return [path if path is not None else next(own) for path in found], foreign

