"""``remat train``'s saves with orbax: atomic writes, and a resume that checks it is the same run.

``--save-dir`` writes, every ``--every`` steps and at the end, one orbax checkpoint:
params, non-parameter state (BatchNorm statistics), optimizer state, and a JSON item with
the step, the seed (the data order's whole state), the loss history and the run's
identity (model, config, optimizer, lr, batch size). Orbax writes into a temporary
directory and renames it when complete, so a run killed mid-save leaves the previous
save intact; the last two saves are kept. ``--resume`` restores the latest save onto the
current mesh (any device count) and continues to ``--steps``. In a multi-process run
orbax coordinates the saves across processes.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from remat.cli._common import UsageError

FORMAT_VERSION = 1


def check_save_dir(args: Any) -> None:
    """Fails early, before JAX starts, on a ``--save-dir`` (and ``--resume``) that cannot work."""
    if os.path.exists(args.save_dir) and not os.path.isdir(args.save_dir):
        raise UsageError(f"--save-dir {args.save_dir!r} is a file, not a directory; choose a directory")
    if args.resume and not os.path.isdir(args.save_dir):
        raise UsageError(f"--resume: {args.save_dir!r} does not exist; run without --resume to start a new run there")
    check_writable(args.save_dir, "--save-dir")
    if os.path.isdir(args.save_dir):  # what the saves' own check finds after the build, found before it
        saved = sorted(int(name) for name in os.listdir(args.save_dir)
                       if name.isdigit() and os.path.isdir(os.path.join(args.save_dir, name)))
        _check_saves_present(args, saved)


def _check_saves_present(args: Any, saved: list[int]) -> None:
    """A ``--resume`` needs a save in ``--save-dir``; a new run needs none there."""
    if args.resume and not saved:
        found = sorted(os.listdir(args.save_dir))
        listing = f" (found {', '.join(found[:5])}{', ...' if len(found) > 5 else ''})" if found else ""
        raise UsageError(f"--resume: {args.save_dir!r} holds no save to resume from{listing}; "
                         "run without --resume to start a new run there")
    if not args.resume and saved:
        raise UsageError(f"--save-dir {args.save_dir!r} already holds saves (last at step {saved[-1]}); "
                         "pass --resume to continue that run, or choose an empty directory")


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
    """Creates ``directory`` and checks a file can be written there."""
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".remat-write-test-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise UsageError(f"{what} {directory!r} is not writable ({e.strerror or e}); "
                         "choose another directory") from None


def open_saves(args: Any, state: Any, identity: dict[str, Any], sharding: Any) -> tuple[Any, Any, list[float], Any]:
    """The :class:`Saver` of ``--save-dir``, and the state to start from.

    With ``--resume``: the latest save, checked against this run's ``identity`` and state
    structure and restored with ``sharding`` (one for every leaf of ``state``, or one for
    all). Without: ``state`` as given, and an error
    when the directory already holds saves.

    Returns:
      ``(saver, state, losses so far, the step resumed from or None)``.
    """
    import jax

    make_dir(args.save_dir, "--save-dir")
    saver = Saver(args.save_dir)
    existing = saver.steps()
    losses: list[float] = []
    resumed_from = None
    _check_saves_present(args, existing)
    if args.resume:
        step = existing[-1]
        meta, path, what = saver.restore_meta(step)
        template, treedef = jax.tree.flatten(state)
        if meta.get("identity") != identity:
            theirs = meta.get("identity") or {}
            diff = sorted(k for k in set(theirs) | set(identity) if theirs.get(k) != identity.get(k))
            shown = ", ".join(f"{k} {theirs.get(k)!r}, now {identity.get(k)!r}" for k in diff)
            raise UsageError(f"--resume: {path} was saved by a different run ({shown}); pass the same "
                             "options, or a new --save-dir to start afresh")
        if meta.get("signature") != _signature([_to_saveable(x) for x in template]) or meta.get("step") != step \
                or len(meta["losses"]) != step:
            raise UsageError(f"--resume: {path} does not match this model's state (or is damaged); {what}")
        shardings = jax.tree.leaves(sharding)  # one for every leaf, or one for all
        shardings = shardings if len(shardings) == len(template) else shardings * len(template)
        abstract = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh)
                    for s, sh in zip((_to_saveable(x) for x in template), shardings)]
        restored = saver.restore_state(step, abstract, path, what)
        state = jax.tree.unflatten(treedef, [_from_saveable(r, t) for r, t in zip(restored, template)])
        losses = [float(v) for v in meta["losses"]]
        resumed_from = step
    if resumed_from is not None and resumed_from > args.steps:
        raise UsageError(f"--resume: the save is at step {resumed_from}, past --steps {args.steps}; "
                         f"pass --steps {resumed_from} or more")
    return saver, state, losses, resumed_from


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

    def save_state(self, step: int, state: Any, seed: int, losses: list[float], identity: dict[str, Any]) -> None:
        """Saves the training state (any pytree of arrays) with what a resume checks."""
        import jax

        leaves = [_to_saveable(x) for x in jax.tree.leaves(state)]
        meta = {"format": FORMAT_VERSION, "step": step, "seed": seed, "losses": losses[:step],
                "identity": identity, "signature": _signature(leaves)}
        self.save(step, leaves, meta)

    def restore_meta(self, step: int) -> tuple[dict[str, Any], str, str]:
        """The JSON item of save ``step``, its path, and what to do when it is damaged."""
        ocp = self.ocp
        path = os.path.join(self.directory, str(step))
        what = f"delete {path} to resume from the save before it, or pass a new --save-dir to start afresh"
        try:
            with _silent_absl():
                meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
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
                state = self.manager.restore(step, args=restore_args)["state"]
            sys.unraisablehook = previous
            return [state[k] for k in sorted(target)]
        except Exception as e:  # the hook stays: reads still in flight report after this
            raise UsageError(f"--resume: the save {path} is damaged ({_one_line(e)}); {what}") from None

    def close(self) -> None:
        """Waits for the last (asynchronous) save to be complete on disk."""
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
    import jax.numpy as jnp

    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(leaf)
    return leaf


def _from_saveable(saved: Any, template: Any) -> Any:
    import jax
    import jax.numpy as jnp

    if jnp.issubdtype(template.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(saved, impl=jax.random.key_impl(template))
    return saved


def _signature(leaves: list[Any]) -> list[str]:
    return [f"{tuple(x.shape)}:{x.dtype}" for x in leaves]
