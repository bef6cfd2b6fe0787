"""``remat.crosscheck``: PyTorch cross-checks; the public path of the bridge, :mod:`remat.torch`."""
import sys

from remat import torch as _bridge

sys.modules[__name__] = _bridge  # one module under both names, private helpers included
