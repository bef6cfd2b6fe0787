"""Deprecated path of :mod:`remat.analysis`, kept so that existing imports work."""
import warnings

from remat.analysis import *  # noqa: F403
from remat.analysis import __all__  # noqa: F401

warnings.warn("remat.memory is deprecated: import remat.analysis", DeprecationWarning, stacklevel=2)
