"""Benchmarks of remat against PyTorch's ``torch.utils.checkpoint``.

``python -m benchmarks.run [--quick] [--out DIR]`` measures the MLP and the transformer
of :mod:`models` at several depths, in JAX (eight checkpointing variants) and PyTorch
(three), and writes ``results.json``, ``results.md`` and ``memory_vs_time.png``.

* :mod:`benchmarks.measure`: the measurements (one (model, depth) at a time, all
  variants of both frameworks in one process, timed in interleaved rounds).
* :mod:`benchmarks.report`: overheads, JAX/PyTorch ratios, targets, Markdown and plot.
* :mod:`benchmarks.run`: the command line; runs each (model, depth) in a fresh
  subprocess.
* :mod:`benchmarks.xla_cpu`: what per-block checkpointing saves on XLA:CPU, JAX's and remat's.
"""
