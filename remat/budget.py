"""Deprecated path of :mod:`remat.analysis.budget`, kept so that existing imports work."""
import warnings

from remat.analysis.budget import *  # noqa: F403
from remat.analysis.budget import __all__  # noqa: F401

warnings.warn("remat.budget is deprecated: import remat.analysis.budget", DeprecationWarning, stacklevel=2)
