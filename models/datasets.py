"""Training data for the built-in models, made on the spot from a seed: nothing is downloaded.

Each generator returns ``batch(step) -> (inputs, targets)``, ``inputs`` a tuple of NumPy
arrays with a leading batch axis. A batch is a pure function of ``(seed, step)``
(``numpy.random.default_rng((seed, step, salt))``), so a resumed run sees exactly the
batches the uninterrupted run saw.

* :func:`regression_batches`: ``x ~ N(0, 1)``, targets from a fixed random 2-layer tanh
  teacher (drawn from :data:`TEACHER_SEED`, the same for every ``seed``).
* :func:`char_batches`: random windows of ``seq_len + 1`` characters of a text (by default
  :func:`load_corpus`, ``models/data/corpus.txt``: public-domain prose and verse, ~9 KB);
  the inputs are the first ``seq_len`` characters' ids, the targets the next ones.
* :func:`image_batches`: one fixed smooth random template per class (drawn from
  :data:`IMAGE_SEED`), every image its class's template plus unit Gaussian noise, NHWC.

Example:
  >>> from remat.models.datasets import regression_batches
  >>> (x,), y = regression_batches(16, 8, batch=4, seed=0)(step=0)
  >>> x.shape, y.shape
  ((4, 16), (4, 8))
"""
from __future__ import annotations

import importlib.resources
import math
from collections.abc import Callable

import numpy as np

TEACHER_SEED = 20240601  # fixed: every run regresses onto the same teacher
IMAGE_SEED = 20240602  # fixed: the image classes' templates
CORPUS = "corpus.txt"  # in remat.models' data folder

Batches = Callable[[int], tuple[tuple[np.ndarray, ...], np.ndarray]]


def _rng(seed: int, step: int, salt: int) -> np.random.Generator:
    return np.random.default_rng((seed, step, salt))


def regression_batches(in_dim: int, out_dim: int, batch: int, seed: int) -> Batches:
    """``step -> ((x,), y)``, float32, with ``y = teacher(x)`` for the fixed random tanh teacher."""
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
    """The text of ``models/data/corpus.txt``, which ships with remat."""
    with (importlib.resources.files("remat.models") / "data" / CORPUS).open(encoding="utf-8") as f:
        return f.read()


def char_batches(text: str, seq_len: int, batch: int, seed: int) -> tuple[Batches, list[str]]:
    """``step -> ((ids,), next_ids)`` (int32) over random windows of ``text``, and the vocabulary.

    The vocabulary is the text's characters, sorted; a character's id is its index there.

    Raises:
      ValueError: the text is not longer than ``seq_len + 1`` characters.
    """
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = np.array([index[c] for c in text], dtype=np.int32)
    if len(ids) <= seq_len + 1:
        raise ValueError(f"seq_len {seq_len} is longer than the corpus ({len(ids)} characters)")
    offsets = np.arange(seq_len + 1)

    def make(step: int) -> tuple:
        starts = _rng(seed, step, 1).integers(0, len(ids) - seq_len - 1, size=batch)
        window = ids[starts[:, None] + offsets]
        return (window[:, :-1],), window[:, 1:]

    return make, chars


def image_batches(size: int, channels: int, classes: int, batch: int, seed: int) -> Batches:
    """``step -> ((images,), labels)``: float32 NHWC images, int32 labels in ``[0, classes)``."""
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


__all__ = ["CORPUS", "IMAGE_SEED", "TEACHER_SEED", "Batches", "char_batches", "image_batches", "load_corpus",
           "regression_batches"]
