"""The training loop behind ``remat train``: tasks, data, sharding, save and resume.

Tasks (all data is made on the spot; nothing is downloaded):

* ``mlp`` (and ``seed-model``, ``seed-mymodel``): regression onto a fixed random teacher
  (a 2-layer tanh network drawn from a fixed seed, the same for every ``--seed``),
  inputs ``x ~ N(0, 1)``, mean-squared error.
* ``transformer``: character-level language modelling on ``models/data/corpus.txt``
  (public-domain prose and verse, ~9 KB). The vocabulary is the text's characters;
  each example is a random window of ``seq_len + 1`` characters, the loss the mean
  next-character cross-entropy.
* ``cnn``: 10-class synthetic images, each class a fixed smooth random 8x8x3 template,
  every image its class's template plus unit Gaussian noise; cross-entropy.
* ``path/to/file.py:factory``: the factory's ``(jax_model, torch_model, example_inputs)``;
  the NNX model is trained full-batch on its example inputs (PyTorch layout is
  converted: NCHW images go NHWC when the model has ``input_layout == "NHWC"``) to
  minimise ``train_loss(outputs, *inputs)`` when the factory's file defines it, otherwise
  the mean of the squared outputs.

Data order is a pure function of ``(seed, step)`` (``numpy.random.default_rng((seed,
step))``), so a resumed run sees exactly the batches the uninterrupted run saw, and its
losses are bitwise the same on CPU. The model is built directly from its config
(``MLP(config, rngs=nnx.Rngs(seed))``...): training needs no PyTorch.

Devices
-------
One step function for one CPU, one GPU or many: a 1-D ``jax.sharding.Mesh`` over the
devices with axis ``"data"``; the batch is sharded ``PartitionSpec("data")`` along its
leading axis, parameters, BatchNorm statistics and optimizer state are replicated
(``PartitionSpec()``), and ``jax.jit`` inserts the gradient all-reduce. ``--devices N``
on CPU sets ``jax_num_cpu_devices`` before JAX's backend starts (the same as
``XLA_FLAGS=--xla_force_host_platform_device_count=N``; flags already in XLA_FLAGS, such
as the XLA:CPU flag ``import remat`` adds, are kept).

Multi-host: start one process per host with ``--coordinator HOST:PORT --num-processes P
--process-id I`` (passed to ``jax.distributed.initialize``), or with ``REMAT_DISTRIBUTED=1``
on a cluster JAX recognizes (SLURM, Open MPI, Kubernetes...), where ``initialize()`` finds
them itself. The mesh spans ``jax.devices()``, every device of every process; ``--devices
N`` is the global count (on CPU each process makes ``N / P`` host devices). Every process
computes the same global batch from ``(seed, step)`` and feeds only its rows through
``jax.make_array_from_process_local_data``; the jitted step is the same program everywhere
and XLA's collectives (gloo on CPU) do the gradient all-reduce. Orbax coordinates the
saves across processes. A test runs two processes on one machine (2 CPU devices each),
saves half-way, resumes both, and checks their losses against the one-process run.

Save and resume
---------------
``--save-dir`` writes, every ``--every`` steps and at the end, one orbax checkpoint:
params, non-parameter state (BatchNorm statistics), optimizer state, and a JSON item with
the step, the seed (the data order's whole state), the loss history and the run's
identity (model, config, optimizer, lr, batch size). Orbax writes into a temporary
directory and renames it when complete, so a run killed mid-save leaves the previous
save intact; the last two saves are kept. ``--resume`` restores the latest save onto the
current mesh (any device count) and continues to ``--steps``.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.resources
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from remat.cli._common import EXIT_CHECK_FAILED, EXIT_OK, UsageError, print_json, print_table

TEACHER_SEED = 20240601  # fixed: every run regresses onto the same teacher
IMAGE_SEED = 20240602  # fixed: the CNN's class templates
MAX_HOST_DEVICES = 256  # a sanity bound for --devices on CPU
DISTRIBUTED_TIMEOUT_S = 120  # how long a process waits for the others to join
DEFAULT_SEQ_LEN = 32
CORPUS = "corpus.txt"  # in remat.models' data folder (see load_corpus)
FORMAT_VERSION = 1
DEFAULT_LR = {"sgd": 0.1, "adam": 3e-3, "adamw": 3e-3}


# --------------------------------------------------------------------------- devices

def _distributed(args: Any) -> bool:
    """Whether this run is one process of several (``--coordinator`` or ``REMAT_DISTRIBUTED=1``)."""
    return getattr(args, "coordinator", None) is not None or os.environ.get("REMAT_DISTRIBUTED") == "1"


def _start_distributed(args: Any) -> None:
    """Joins a multi-process run when asked to."""
    import jax

    if not _distributed(args):
        return
    if getattr(args, "coordinator", None) is not None:
        try:
            jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                       process_id=args.process_id, initialization_timeout=DISTRIBUTED_TIMEOUT_S)
        except Exception as e:  # a wrong address or a missing peer: say so in one line
            raise UsageError(f"--coordinator {args.coordinator}: could not join the {args.num_processes}-process "
                             f"run as process {args.process_id} ({type(e).__name__}: {str(e).splitlines()[0]}); "
                             "start every process with the same --coordinator and --num-processes") from None
    else:
        jax.distributed.initialize()  # REMAT_DISTRIBUTED=1: the cluster (SLURM, ...) says who is who


def setup_devices(n: int | None, args: Any = None) -> list[Any]:
    """The devices to train on; makes ``n`` CPU host devices when JAX has not started yet.

    ``n`` is the global device count: in a run of P processes each makes ``n / P``.
    """
    import jax

    from remat.analysis.process import jax_backend_started

    started = jax_backend_started()
    n_proc_asked = getattr(args, "num_processes", None) or 1
    if n is not None and n > 1 and not started:
        local = n // n_proc_asked
        if local > MAX_HOST_DEVICES:
            raise UsageError(f"--devices {n}: at most {MAX_HOST_DEVICES} devices can be made on a host")
        if jax.config.jax_num_cpu_devices < local:
            jax.config.update("jax_num_cpu_devices", local)
    _start_distributed(args)
    devices = jax.devices()
    if n is None:
        return devices
    if len(devices) < n:
        platform = devices[0].platform
        if started and platform == "cpu":
            raise UsageError(
                f"--devices {n}: JAX already started in this process with {len(devices)} CPU device(s) and "
                "cannot make more; run remat train in a fresh process")
        raise UsageError(f"--devices {n}: only {len(devices)} {platform} device(s) available; "
                         f"use --devices {len(devices)} or fewer")
    if jax.process_count() > 1 and n != len(devices):
        raise UsageError(f"--devices {n}: a multi-host run uses every device ({len(devices)})")
    return devices[:n]


# --------------------------------------------------------------------------- tasks

@dataclass
class Task:
    """What to train and on what: the model, a batch per step and the loss."""

    name: str
    kind: str
    data: str
    model: Any
    batch: Callable[[int], tuple[tuple[np.ndarray, ...], Any]]  # step -> (inputs, targets)
    loss: Callable[[Any, tuple, Any], Any]  # (outputs, inputs, targets) -> scalar
    batch_size: int
    identity: dict[str, Any] = field(default_factory=dict)  # what a resumed run must match
    policy: str = "-"


def _rng(seed: int, step: int, salt: int) -> np.random.Generator:
    return np.random.default_rng((seed, step, salt))


def _mse(out: Any, inputs: tuple, targets: Any) -> Any:
    import jax.numpy as jnp

    return jnp.mean((out - targets) ** 2)


def _xent(out: Any, inputs: tuple, targets: Any) -> Any:
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(out, targets).mean()


def regression_batches(in_dim: int, out_dim: int, batch: int, seed: int) -> Callable[[int], tuple]:
    """``step -> ((x,), y)`` with ``y = teacher(x)`` for a fixed random tanh teacher."""
    t = np.random.default_rng(TEACHER_SEED)
    hidden = 64
    w1 = t.standard_normal((in_dim, hidden)) / math.sqrt(in_dim)
    b1 = 0.1 * t.standard_normal(hidden)
    w2 = t.standard_normal((hidden, out_dim)) * (1.5 / math.sqrt(hidden))

    def make(step: int) -> tuple:
        x = _rng(seed, step, 0).standard_normal((batch, in_dim))
        y = np.tanh(x @ w1 + b1) @ w2
        return (x.astype(np.float32),), y.astype(np.float32)

    return make


def load_corpus() -> str:
    with (importlib.resources.files("remat.models") / "data" / CORPUS).open(encoding="utf-8") as f:
        return f.read()


def char_batches(text: str, seq_len: int, batch: int, seed: int) -> tuple[Callable[[int], tuple], list[str]]:
    """``step -> ((ids,), next_ids)`` over random windows of ``text``; also the vocabulary."""
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = np.array([index[c] for c in text], dtype=np.int32)
    if len(ids) <= seq_len + 1:
        raise UsageError(f"--seq-len {seq_len} is longer than the corpus ({len(ids)} characters)")
    offsets = np.arange(seq_len + 1)

    def make(step: int) -> tuple:
        starts = _rng(seed, step, 1).integers(0, len(ids) - seq_len - 1, size=batch)
        window = ids[starts[:, None] + offsets]
        return (window[:, :-1],), window[:, 1:]

    return make, chars


def image_batches(size: int, channels: int, classes: int, batch: int, seed: int) -> Callable[[int], tuple]:
    """``step -> ((images NHWC,), labels)``: a fixed smooth template per class plus noise."""
    t = np.random.default_rng(IMAGE_SEED).standard_normal((classes, size, size, channels))
    for axis in (1, 2):  # a 3-tap box blur along each spatial axis makes the templates smooth
        t = (np.roll(t, 1, axis) + t + np.roll(t, -1, axis)) / 3
    t /= t.std(axis=(1, 2, 3), keepdims=True)

    def make(step: int) -> tuple:
        r = _rng(seed, step, 2)
        labels = r.integers(0, classes, size=batch)
        x = t[labels] + r.standard_normal((batch, size, size, channels))
        return (x.astype(np.float32),), labels.astype(np.int32)

    return make


def remat_settings(args: argparse.Namespace) -> tuple[Any, str]:
    """``RematSettings`` from ``--policy`` / ``--budget``, and a label for reports."""
    from remat.models import RematSettings

    if args.budget is not None:
        from remat.analysis.budget import budget

        try:
            settings = RematSettings(policy=budget(args.budget))
        except (TypeError, ValueError) as e:
            raise UsageError(f"--budget {args.budget}: {e}") from None
        return settings, f"budget({args.budget})"
    if args.policy == "none":
        return RematSettings.none(), "none (no checkpoint)"
    policy = None if args.policy in (None, "nothing") else args.policy
    return RematSettings(policy=policy), args.policy or "nothing"


def _config_fields(config: Any) -> dict[str, Any]:
    """The config as JSON-able data, without its remat settings (a resume may change those)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "remat"}
    return json.loads(json.dumps(fields, default=str))


def builtin_task(name: str, args: argparse.Namespace) -> Task:
    from remat.models import MODELS

    entry = MODELS[name]
    settings, label = remat_settings(args)
    batch = args.batch_size or (16 if name == "transformer" else 32)
    overrides: dict[str, Any] = {"batch": batch}
    if args.seq_len is not None and name != "transformer":
        raise UsageError(f"--seq-len applies to the transformer only, not {name}")
    if name.startswith("seed-") and (args.depth is not None or args.width is not None):
        raise UsageError(f"--depth and --width do not apply to {name} (its sizes are the seed's)")
    if name in ("mlp", "transformer"):
        for key in ("depth", "width"):
            if getattr(args, key) is not None:
                overrides[key] = getattr(args, key)
    if name == "cnn" and (args.depth is not None or args.width is not None):
        depth = args.depth if args.depth is not None else len(entry.config.channels)
        width = args.width if args.width is not None else entry.config.channels[0]
        if 2 ** depth > entry.config.image_size:
            raise UsageError(f"--depth {depth}: the cnn pools 2x per block, so {entry.config.image_size}x"
                             f"{entry.config.image_size} images allow at most "
                             f"{int(math.log2(entry.config.image_size))} blocks")
        overrides["channels"] = tuple(width * 2 ** i for i in range(depth))
    text, chars = "", []
    if name == "transformer":
        text = load_corpus()
        chars = sorted(set(text))
        overrides.update(vocab=len(chars), seq_len=args.seq_len or DEFAULT_SEQ_LEN)
    try:
        config = entry.make_config(remat=settings, **overrides)
    except (TypeError, ValueError) as e:
        raise UsageError(f"{name}: {e}") from None

    from remat.models import cnn, mlp, seed, transformer

    if name == "mlp":
        cls = mlp.MLP
        make = regression_batches(config.in_dim, config.out_dim, batch, args.seed)
        kind, data, loss = "regression", f"fixed random tanh teacher, {config.in_dim} -> {config.out_dim}", _mse
    elif name in ("seed-model", "seed-mymodel"):
        cls = seed.Model if name == "seed-model" else seed.MyModel
        dims = (config.in_dim, config.out_dim) if name == "seed-model" else (config.size, config.size)
        make = regression_batches(*dims, batch, args.seed)
        kind, data, loss = "regression", f"fixed random tanh teacher, {dims[0]} -> {dims[1]}", _mse
    elif name == "transformer":
        cls = transformer.Transformer
        make, _ = char_batches(text, config.seq_len, batch, args.seed)
        kind, loss = "char-lm", _xent
        data = f"{CORPUS}: {len(text)} characters, vocab {len(chars)}, windows of {config.seq_len}"
    elif name == "cnn":
        cls = cnn.CNN
        make = image_batches(config.image_size, config.in_channels, config.num_classes, batch, args.seed)
        kind, loss = "images", _xent
        image_shape = f"{config.image_size}x{config.image_size}x{config.in_channels}"
        data = f"synthetic {config.num_classes}-class {image_shape} images"
    else:  # pragma: no cover - a model added to the registry but not here
        raise UsageError(f"remat train does not know how to train {name!r} yet")
    model = init_model(cls, config, args.seed)
    identity = {"model": name, "config": _config_fields(config)}
    return Task(name, kind, data, model, make, loss, batch, identity, label)


def init_model(cls: Any, config: Any, seed: int) -> Any:
    """``cls(config, rngs=nnx.Rngs(seed))``, initialised in one compiled program.

    Under ``nnx.jit`` (one compilation instead of one per parameter shape) and with JAX's
    non-partitionable threefry: on XLA:CPU (jax 0.10) the partitionable one takes 10-20 s
    to compile a normal draw of one 4-D conv-kernel shape, the other about 1 s. Both only
    change which random initial weights are drawn.
    """
    import jax
    from flax import nnx

    scope = getattr(jax, "threefry_partitionable", None)
    with scope(False) if scope is not None else contextlib.nullcontext():
        return nnx.jit(lambda: cls(config, rngs=nnx.Rngs(seed)))()


def factory_task(spec: str, args: argparse.Namespace) -> Task:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from remat.models import call_factory, load_factory

    for flag, value in (("--policy", args.policy), ("--budget", args.budget), ("--depth", args.depth),
                        ("--width", args.width), ("--seq-len", args.seq_len), ("--batch-size", args.batch_size)):
        if value is not None:
            raise UsageError(f"{flag} does not apply to a factory: its model trains as built, on its example inputs")
    try:
        factory = load_factory(spec)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        built, _ = call_factory(factory, seed=args.seed)
    except Exception as e:
        first_line = str(e).splitlines()[0] if str(e) else ""
        raise UsageError(f"{spec}: the factory raised {type(e).__name__}: {first_line}") from None
    if not (isinstance(built, tuple) and len(built) == 3 and isinstance(built[0], nnx.Module)):
        raise UsageError(f"{spec}: a factory must return (jax_model, torch_model, example_inputs) with an "
                         f"nnx.Module first, got {type(built).__name__}")
    model, _, inputs = built
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    nhwc = getattr(model, "input_layout", None) == "NHWC"
    arrays = []
    for x in inputs:
        x = np.asarray(x)
        if nhwc and x.ndim == 4:
            x = x.transpose(0, 2, 3, 1)
        if x.dtype == np.int64:
            x = x.astype(np.int32)
        elif x.dtype == np.float64:
            x = x.astype(np.float32)
        arrays.append(x)
    if not arrays or any(a.ndim == 0 for a in arrays):
        raise UsageError(f"{spec}: example_inputs must be arrays with a leading batch axis")
    batch = arrays[0].shape[0]
    module = sys.modules.get(getattr(factory, "__module__", ""), None)
    user_loss = getattr(module, "train_loss", None)

    if user_loss is not None:
        def loss(out: Any, ins: tuple, targets: Any) -> Any:
            return user_loss(out, *ins)
        how = "train_loss(outputs, *inputs)"
    else:
        def loss(out: Any, ins: tuple, targets: Any) -> Any:
            return sum(jnp.mean(jnp.square(o.astype(jnp.float32))) for o in jax.tree.leaves(out))
        how = "mean of squared outputs"
    fixed = tuple(arrays)
    shapes = [list(a.shape) for a in arrays]
    return Task(spec, "factory", f"the factory's example inputs {shapes}, loss = {how}", model,
                lambda step: (fixed, ()), loss, batch,
                {"model": spec, "inputs": [[*a.shape, str(a.dtype)] for a in arrays]}, "as built")


def make_task(args: argparse.Namespace) -> Task:
    from remat.models import MODELS

    if args.model in MODELS:
        return builtin_task(args.model, args)
    if ":" in args.model or args.model.endswith(".py"):
        return factory_task(args.model, args)
    raise UsageError(f"unknown model {args.model!r}; use one of {', '.join(MODELS)}, or path/to/file.py:factory")


# --------------------------------------------------------------------------- save / resume

def check_writable(directory: str, what: str) -> None:
    """Fails early when ``directory`` cannot be created or written (nothing is created here)."""
    path = os.path.abspath(directory)
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise UsageError(f"{what} {directory!r} is not writable ({probe!r} is a file); choose another directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"{what} {directory!r} is not writable (no write permission on {probe!r}); "
                         "choose another directory")


def make_dir(directory: str, what: str) -> None:
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".remat-write-test-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise UsageError(f"{what} {directory!r} is not writable ({e.strerror or e}); "
                         "choose another directory") from None


def _quiet_absl() -> None:
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:  # pragma: no cover
        pass


@contextlib.contextmanager
def _silent_absl() -> Any:
    """Orbax logs a damaged save at ERROR level before raising; we report it in one line."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


class Saver:
    """Atomic saves with orbax's ``CheckpointManager`` (tmp directory, then rename); keeps 2."""

    def __init__(self, directory: str) -> None:
        _quiet_absl()
        import orbax.checkpoint as ocp

        self.ocp = ocp
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True, cleanup_tmp_directories=True)
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))
        except Exception as e:
            raise UsageError(f"--save-dir {directory!r} cannot be used ({_one_line(e)}); "
                             "choose an empty directory") from None
        self.saved: list[int] = []

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, leaves: list[Any], meta: dict[str, Any]) -> None:
        ocp = self.ocp
        state = {f"{i:05d}": leaf for i, leaf in enumerate(leaves)}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         meta=ocp.args.JsonSave(meta)))
        self.saved.append(step)

    def restore_meta(self, step: int) -> tuple[dict[str, Any], str, str]:
        """The JSON item of save ``step``, its path, and what to do when it is damaged."""
        ocp = self.ocp
        path = os.path.join(self.directory, str(step))
        what = f"delete {path} to resume from the save before it, or pass a new --save-dir to start afresh"
        try:
            with _silent_absl():
                meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except Exception as e:
            raise UsageError(f"--resume: the save {path} is damaged ({_one_line(e)}); {what}") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION or "losses" not in meta:
            raise UsageError(f"--resume: {path} was not written by remat train (or is damaged); {what}")
        return meta, path, what

    def restore_state(self, step: int, abstract: list[Any], path: str, what: str) -> list[Any]:
        ocp = self.ocp
        target = {f"{i:05d}": a for i, a in enumerate(abstract)}
        previous = _ignore_late_reads()
        try:
            with _silent_absl():
                restore_args = ocp.args.Composite(state=ocp.args.StandardRestore(target))
                state = self.manager.restore(step, args=restore_args).state
            sys.unraisablehook = previous
            return [state[k] for k in sorted(target)]
        except Exception as e:  # the hook stays: reads still in flight report after this
            raise UsageError(f"--resume: the save {path} is damaged ({_one_line(e)}); {what}") from None

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _ignore_late_reads() -> Callable[[Any], None]:
    """After a failed restore, tensorstore's reads still in flight finish after orbax's event
    loop closed and report ``RuntimeError('Event loop is closed')`` as unraisable: harmless,
    and not something to show under a one-line error."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(unraisable.exc_value):
            return
        previous(unraisable)

    sys.unraisablehook = hook
    return previous


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    msg = f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
    return msg if len(msg) <= 160 else msg[:157] + "..."


def _to_saveable(leaf: Any) -> Any:
    import jax

    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(leaf)
    return leaf


def _from_saveable(saved: Any, template: Any) -> Any:
    import jax

    if jax.dtypes.issubdtype(template.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(saved, impl=jax.random.key_impl(template))
    return saved


def _signature(leaves: list[Any]) -> list[str]:
    return [f"{tuple(x.shape)}:{x.dtype}" for x in leaves]


# --------------------------------------------------------------------------- memory

def rss_bytes() -> int:
    """This process's resident set size now."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def device_peak_bytes(devices: list[Any]) -> int | None:
    """The largest ``peak_bytes_in_use`` over the devices (GPU/TPU), None where not reported."""
    peaks = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


# --------------------------------------------------------------------------- the loop

def make_optimizer(name: str, lr: float) -> Any:
    import optax

    return {"sgd": optax.sgd, "adam": optax.adam, "adamw": optax.adamw}[name](lr)


def _progress(total: int, initial: int, desc: str, disable: bool) -> Any:
    if disable:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True,
                mininterval=0.2)


def write_plot(path: str, losses: list[float], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    ax.plot(np.arange(1, len(losses) + 1), losses, lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if losses and all(math.isfinite(v) and v > 0 for v in losses):
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)


def main(args: argparse.Namespace) -> int:
    """``remat train``; returns the exit code (see :mod:`remat.cli.train` for the options)."""
    if not _distributed(args):
        return _main(args)
    with _native_stdout_to_stderr():
        return _main(args)


@contextlib.contextmanager
def _native_stdout_to_stderr() -> Any:
    """Sends what native code writes to file descriptor 1 to stderr; Python's stdout stays.

    Gloo (XLA:CPU's cross-process collectives) prints its connection messages to the C
    stdout, which would break ``--json``'s one-object output.
    """
    sys.stdout.flush()
    real = os.dup(1)
    os.dup2(2, 1)
    python_stdout = sys.stdout
    sys.stdout = open(real, "w", buffering=1, closefd=False)  # noqa: SIM115
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stdout = python_stdout
        os.dup2(real, 1)
        os.close(real)


def _main(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    if args.plot:
        parent = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise UsageError(f"--plot {args.plot!r}: directory {parent!r} does not exist or is not writable")
    if args.save_dir:
        if os.path.exists(args.save_dir) and not os.path.isdir(args.save_dir):
            raise UsageError(f"--save-dir {args.save_dir!r} is a file, not a directory; choose a directory")
        if args.resume and not os.path.isdir(args.save_dir):
            raise UsageError(f"--resume: {args.save_dir!r} does not exist; "
                             "run without --resume to start a new run there")
        check_writable(args.save_dir, "--save-dir")

    devices = setup_devices(args.devices, args)
    n_dev = len(devices)

    import jax
    import optax
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    task = make_task(args)
    if task.batch_size % n_dev:
        raise UsageError(f"batch size {task.batch_size} does not split evenly over {n_dev} devices; "
                         f"use a multiple of {n_dev} (--batch-size) or other --devices")
    mesh = Mesh(np.array(devices), ("data",))
    replicated = NamedSharding(mesh, P())
    sharded = NamedSharding(mesh, P("data"))

    lr = args.lr if args.lr is not None else DEFAULT_LR[args.optimizer]
    tx = make_optimizer(args.optimizer, lr)
    graphdef, params, rest = nnx.split(task.model, nnx.Param, ...)
    opt_state = jax.jit(tx.init)(params)  # one compilation, not one per parameter shape
    n_params = int(sum(x.size for x in jax.tree.leaves(params)))
    state = jax.device_put((params, rest, opt_state), replicated)
    identity = {**task.identity, "optimizer": args.optimizer, "lr": lr, "batch_size": task.batch_size,
                "seed": args.seed}

    saver = None
    losses: list[float] = []
    resumed_from = None
    if args.save_dir:
        make_dir(args.save_dir, "--save-dir")
        saver = Saver(args.save_dir)
        existing = saver.steps()
        if args.resume:
            if not existing:
                found = sorted(os.listdir(args.save_dir))
                listing = f" (found {', '.join(found[:5])}{', ...' if len(found) > 5 else ''})" if found else ""
                raise UsageError(f"--resume: {args.save_dir!r} holds no save to resume from{listing}; "
                                 "run without --resume to start a new run there")
            step = existing[-1]
            meta, path, what = saver.restore_meta(step)
            template, treedef = jax.tree.flatten(state)
            saved_sig = meta.get("signature")
            if meta.get("identity") != identity:
                theirs = meta.get("identity") or {}
                diff = sorted(k for k in set(theirs) | set(identity) if theirs.get(k) != identity.get(k))
                shown = ", ".join(f"{k} {theirs.get(k)!r}, now {identity.get(k)!r}" for k in diff)
                raise UsageError(f"--resume: {path} was saved by a different run ({shown}); pass the same "
                                 "options, or a new --save-dir to start afresh")
            if saved_sig != _signature([_to_saveable(x) for x in template]) or meta.get("step") != step \
                    or len(meta["losses"]) != step:
                raise UsageError(f"--resume: {path} does not match this model's state (or is damaged); {what}")
            abstract = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated)
                        for s in (_to_saveable(x) for x in template)]
            restored = saver.restore_state(step, abstract, path, what)
            state = jax.tree.unflatten(treedef, [_from_saveable(r, t) for r, t in zip(restored, template)])
            losses = [float(v) for v in meta["losses"]]
            resumed_from = step
        elif existing:
            raise UsageError(f"--save-dir {args.save_dir!r} already holds saves (last at step {existing[-1]}); "
                             "pass --resume to continue that run, or choose an empty directory")
        if resumed_from is not None and resumed_from > args.steps:
            raise UsageError(f"--resume: the save is at step {resumed_from}, past --steps {args.steps}; "
                             f"pass --steps {resumed_from} or more")

    loss_of = task.loss

    def train_step(state: Any, inputs: tuple, targets: Any) -> tuple[Any, Any]:
        params, rest, opt_state = state
        model = nnx.merge(graphdef, params, rest)
        # nnx.value_and_grad, not jax's: it lets checkpointed NNX regions (nnx.remat under
        # remat.checkpoint) update BatchNorm statistics of a model merged inside this trace.
        loss, grads = nnx.value_and_grad(lambda m: loss_of(m(*inputs), inputs, targets))(model)
        _, _, new_rest = nnx.split(model, nnx.Param, ...)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), new_rest, opt_state), loss

    step_fn = jax.jit(train_step, in_shardings=(replicated, sharded, sharded),
                      out_shardings=(replicated, replicated), donate_argnums=(0,))

    n_proc, pid = jax.process_count(), jax.process_index()

    def put(tree: Any) -> Any:
        def one(x: np.ndarray) -> Any:
            rows = x.shape[0] // n_proc
            return jax.make_array_from_process_local_data(sharded, x[pid * rows:(pid + 1) * rows], x.shape)

        return jax.tree.map(one, tree)

    def save(step: int) -> None:
        leaves = [_to_saveable(x) for x in jax.tree.leaves(state)]
        meta = {"format": FORMAT_VERSION, "step": step, "seed": args.seed, "losses": losses[:step],
                "identity": identity, "signature": _signature(leaves)}
        saver.save(step, leaves, meta)

    start = len(losses)
    bar = _progress(args.steps, start, task.name, args.json)
    t_first = None
    paused = 0.0  # time spent saving or in --step-delay, left out of steps/s
    nonfinite_at = None
    try:
        for step in range(start, args.steps):
            inputs, targets = task.batch(step)
            state, loss = step_fn(state, put(inputs), put(targets))
            value = float(loss)
            losses.append(value)
            if t_first is None:
                t_first = time.perf_counter()
            if nonfinite_at is None and not math.isfinite(value):
                nonfinite_at = step + 1
            if bar is not None:
                bar.set_postfix_str(f"loss={value:.4f} rss={rss_bytes() / 2**20:.0f}MiB", refresh=False)
                bar.update(1)
            t_pause = time.perf_counter()
            if saver is not None and ((step + 1) % args.every == 0 or step + 1 == args.steps):
                save(step + 1)
            if args.step_delay:
                time.sleep(args.step_delay)
            paused += time.perf_counter() - t_pause
        t_end = time.perf_counter()
    finally:
        if bar is not None:
            bar.close()
        if saver is not None:
            saver.close()  # waits for the last (asynchronous) save to be complete on disk
    ran = len(losses) - start
    if ran > 1:
        # without the first (compiling) step, the saves and the test hook's sleeps
        steps_per_s = (ran - 1) / max(t_end - t_first - paused, 1e-9)
    elif ran == 1:
        steps_per_s = 1 / max(t_end - t_start, 1e-9)
    else:
        steps_per_s = None

    if args.plot:
        write_plot(args.plot, losses, f"remat train {task.name} (policy {task.policy})")

    peak = peak_rss_bytes()
    dev_peak = device_peak_bytes(devices)
    result = {
        "model": task.name,
        "task": task.kind,
        "data": task.data,
        "config": identity,
        "policy": task.policy,
        "optimizer": args.optimizer,
        "lr": lr,
        "batch_size": task.batch_size,
        "parameters": n_params,
        "devices": n_dev,
        "platform": devices[0].platform,
        "processes": n_proc,
        "steps": args.steps,
        "resumed_from": resumed_from,
        "steps_run": ran,
        "losses": losses,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "steps_per_s": steps_per_s,
        "wall_s": time.perf_counter() - t_start,
        "peak_rss_mb": peak / 2**20,
        "device_peak_bytes": dev_peak,
        "save_dir": os.path.abspath(args.save_dir) if args.save_dir else None,
        "saved_steps": saver.steps() if saver is not None else [],
        "plot": os.path.abspath(args.plot) if args.plot else None,
    }
    if args.json:
        print_json(result)
    else:
        fmt = lambda v: "-" if v is None else f"{v:.4g}"  # noqa: E731
        rows = [
            ["model", f"{task.name} ({n_params:,} parameters)"],
            ["data", task.data],
            ["remat policy", task.policy],
            ["optimizer", f"{args.optimizer}, lr {lr:g}, batch {task.batch_size}"],
            ["devices", f"{n_dev} x {devices[0].platform}" + (f" over {n_proc} processes" if n_proc > 1 else "")],
            ["steps", f"{args.steps}" + (f" (resumed at {resumed_from})" if resumed_from is not None else "")],
            ["loss", f"{fmt(result['first_loss'])} -> {fmt(result['final_loss'])}"],
            ["steps/s", fmt(steps_per_s)],
            ["peak RSS", f"{peak / 2**20:.0f} MiB"],
        ]
        if dev_peak is not None:
            rows.append(["peak device memory", f"{dev_peak / 2**20:.1f} MiB"])
        if saver is not None:
            rows.append(["saves", f"{result['save_dir']} (steps {', '.join(map(str, result['saved_steps']))})"])
        if args.plot:
            rows.append(["loss curve", result["plot"]])
        print_table("remat train", ["", "value"], rows)
    if nonfinite_at is not None:
        print(f"remat: the loss became non-finite at step {nonfinite_at}; lower --lr", file=sys.stderr)
        return EXIT_CHECK_FAILED
    return EXIT_OK


def pure_step_loss(task: Task) -> tuple[Callable[..., Any], tuple]:
    """The task's loss as a pure function ``loss(params, inputs, targets)`` and its arguments.

    For the tools that compile and compare whole training steps (``remat plan``,
    ``remat profile``): the NNX model is split into its parameters, differentiated with
    respect to them, and merged back inside the function. A BatchNorm model runs in
    training mode (batch statistics), as in ``remat train``; the running averages it
    updates are left out of the result, so they are not part of what is compiled.
    """
    import jax.numpy as jnp
    from flax import nnx

    inputs, targets = task.batch(0)
    graphdef, params, rest = nnx.split(task.model, nnx.Param, ...)

    def loss(params: Any, inputs: tuple, targets: Any) -> Any:
        # copy=True: fresh Variables of this trace, so that BatchNorm may update its
        # statistics here (on the merged copy; the update is not part of the result)
        model = nnx.merge(graphdef, params, rest, copy=True)
        return task.loss(model(*inputs), inputs, targets)

    return loss, (params, tuple(jnp.asarray(x) for x in inputs), jnp.asarray(targets))
