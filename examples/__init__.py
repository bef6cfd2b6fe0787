"""The seed examples, mirrored in JAX (installed as ``remat.examples`` for ``remat demo``).

Each script runs on its own (``python examples/seed1_model.py``) and defines ``run()``,
which returns a dict: ``example``, ``jax`` (the JAX result), ``torch`` (PyTorch's result
on the same weights and data, or None without PyTorch), ``max_diff`` and ``ok``.
"""
