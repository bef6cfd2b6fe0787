"""Deprecated path of :mod:`remat._core.sequential`, kept so that existing imports work."""
import warnings

from remat._core.sequential import *  # noqa: F403
from remat._core.sequential import __all__  # noqa: F401

warnings.warn("remat.sequential is deprecated: import remat._core.sequential", DeprecationWarning, stacklevel=2)
