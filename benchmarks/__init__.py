"""Benchmarks of remat against PyTorch's ``torch.utils.checkpoint`` and ``torch.compile``.

``python -m benchmarks.run [--quick] [--out DIR]`` measures the MLP and the transformer
of :mod:`remat.models` at several depths, in JAX and PyTorch (the variants of
:mod:`benchmarks.cases`), and writes ``results.json``, ``results.md`` and
``memory_vs_time.png``.

* :mod:`benchmarks.cases`: the models, sizes and variants measured.
* :mod:`benchmarks.jax_programs` / :mod:`benchmarks.torch_programs`: each variant as a
  training step through the model's own code, and what its backward keeps.
* :mod:`benchmarks.measure`: the measurements (one (model, depth) at a time, all
  variants of both frameworks in one process, timed in interleaved rounds), through
  remat's measuring kernel (:mod:`remat.analysis`).
* :mod:`benchmarks.report`: overheads, JAX/PyTorch ratios, targets, Markdown and plot.
* :mod:`benchmarks.frontier`: each framework's Pareto frontier of saved bytes against step
  time, remat against every ``torch.compile`` point (``benchmarks.run --frontier``).
* :mod:`benchmarks.run`: the command line; runs each (model, depth) in a fresh
  subprocess.
* :mod:`benchmarks.plans`: ``remat.plan`` against the fixed named policies.
* :mod:`benchmarks.xla_cpu`: what per-block checkpointing saves on XLA:CPU, JAX's and remat's.
"""
