"""Whether JAX's backend has started in this process, asked without ever starting it."""
from __future__ import annotations

import sys


def jax_backend_started() -> bool:
    """True once a JAX backend exists (the first computation made it); never imports JAX.

    Settings read when a backend starts (host device counts, allocator arenas) can no
    longer take effect after that.
    """
    bridge = sys.modules.get("jax._src.xla_bridge")
    if bridge is None:  # JAX not imported: no backend can exist
        return False
    try:
        return bool(bridge.backends_are_initialized())
    except AttributeError:  # an older JAX: its backend cache
        return bool(getattr(bridge, "_backends", None))
