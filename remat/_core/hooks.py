"""The core's two extension points: deciders that re-decide checkpointing, and per-region policies.

**Deciders.** A planner (:func:`remat.plan`) re-decides the checkpointing of a step while the
step is traced. It installs deciders with :func:`deciding`, and every checkpointing site asks
the decider of its kind, at trace time:

* ``region(opts) -> opts | None``: each ``remat.checkpoint`` region (``None``: run it
  without checkpoint);
* ``sequential(num_functions, segments) -> segments``: each ``checkpoint_sequential``;
* ``scan(depth, policy, groups) -> (policy, groups)``: each scan over layers.

Deciders live in a ``contextvars.ContextVar``, so concurrent traces never see each other's.

**Per-region policies.** A policy that picks what to keep region by region from the traced
inputs (a residual budget) subclasses :class:`RegionChooser`; the core calls
:meth:`RegionChooser.choose_policy` and never imports the chooser's module.
"""
from __future__ import annotations

import abc
import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

RegionDecider = Callable[[Any], Any]
SequentialDecider = Callable[[int, int], int]
ScanDecider = Callable[[int, Any, Any], tuple[Any, Any]]


@dataclasses.dataclass(frozen=True)
class Deciders:
    """The deciders in force; ``None``: the site keeps what its caller wrote."""

    region: RegionDecider | None = None
    sequential: SequentialDecider | None = None
    scan: ScanDecider | None = None


_NONE = Deciders()
_deciders: contextvars.ContextVar[Deciders | None] = contextvars.ContextVar("remat_deciders", default=None)


@contextlib.contextmanager
def deciding(*, region: RegionDecider | None = None, sequential: SequentialDecider | None = None,
             scan: ScanDecider | None = None) -> Iterator[None]:
    """Installs the given deciders for the code traced inside the ``with`` block.

    Example:
      >>> with deciding(sequential=lambda n, segments: 2):
      ...     pass  # every checkpoint_sequential traced here uses 2 segments
    """
    given = {"region": region, "sequential": sequential, "scan": scan}
    token = _deciders.set(dataclasses.replace(current(), **{k: v for k, v in given.items() if v}))
    try:
        yield
    finally:
        _deciders.reset(token)


def current() -> Deciders:
    """The deciders in force for the code being traced now."""
    return _deciders.get() or _NONE


class RegionChooser(abc.ABC):
    """A policy that decides per checkpointed region, from the region's traced inputs."""

    @abc.abstractmethod
    def choose_policy(self, remat_with: Callable[[Any], Callable[..., Any]], inputs: Sequence[Any]) -> Any:
        """The JAX policy for one region.

        Args:
          remat_with: ``policy -> checkpointed region``; the region takes ``inputs``.
          inputs: the region's traced inputs.
        """
