"""A linear layer and cross-entropy in one, chunked over tokens so the full logits never exist."""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

#: HuggingFace's (and ``torch.nn.CrossEntropyLoss``'s) label of a token left out of the loss.
IGNORE_INDEX = -100


def chunked_cross_entropy(hidden: jax.Array, embedding: jax.Array, labels: jax.Array, *, chunk: int = 1024,
                          over: str = "tokens", ignore_index: int = IGNORE_INDEX) -> jax.Array:
    """Mean cross-entropy of the logits ``hidden @ embedding.T`` against ``labels``, never forming them.

    The same value and gradients as
    ``optax.softmax_cross_entropy_with_integer_labels(hidden @ embedding.T, labels)`` averaged
    over the labels that are not ``ignore_index``, but the logits are made a chunk at a time,
    in the forward and in the backward pass, instead of ``[tokens, vocab]`` and their
    gradient: what Liger's fused linear cross-entropy and Apple's cut-cross-entropy give
    PyTorch users. ``over="tokens"`` takes ``chunk`` tokens at a time against the whole
    vocabulary (``[chunk, vocab]`` logits; the backward sums the head's gradient over the
    chunks, a ``[vocab, width]`` float32 accumulator). ``over="vocab"`` takes ``chunk``
    vocabulary entries at a time against every token (``[tokens, chunk]`` logits, the
    log-sum-exp accumulated online); the backward writes each chunk's rows of the head's
    gradient once, with no accumulator, which suits few tokens and a large vocabulary. A
    ``jax.custom_vjp`` keeps only the inputs and each token's log-sum-exp for the backward,
    which recomputes each chunk's logits once. The logits are computed with
    ``preferred_element_type=float32`` and the softmax in float32 whatever the inputs' dtype,
    as ``torch.autocast`` runs the loss in float32.

    Args:
      hidden: ``(..., width)``, the LM head's input (e.g. a Llama's final norm's output).
      embedding: ``(vocab, width)``, the head's weight in PyTorch's layout (a tied embedding).
      labels: integer ``(...)``, the target of each token; ``ignore_index`` leaves one out.
      chunk: tokens (``over="tokens"``) or vocabulary entries (``over="vocab"``) per chunk;
        one that does not divide their number is padded (ignored tokens, or entries no
        label names that add nothing to the softmax), so any positive ``chunk`` works.
      over: ``"tokens"`` or ``"vocab"``, the axis cut into chunks.
      ignore_index: the label of tokens left out of the mean (HuggingFace's ``-100``).

    Returns:
      A float32 scalar; ``0.0`` when every label is ignored (PyTorch gives NaN).

    Raises:
      ValueError: one line, for a ``chunk`` below 1, an unknown ``over`` or shapes that do not fit.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from remat import ops
      >>> h, w = jnp.ones((2, 8, 4)), jnp.eye(16, 4)
      >>> labels = jnp.arange(16).reshape(2, 8) % 16
      >>> float(ops.chunked_cross_entropy(h, w, labels, chunk=4)) > 0
      True
    """
    if chunk < 1:
        raise ValueError(f"chunked_cross_entropy: chunk must be at least 1, got {chunk}")
    if over not in ("tokens", "vocab"):
        raise ValueError(f"chunked_cross_entropy: over must be 'tokens' or 'vocab', got {over!r}")
    if hidden.shape[-1] != embedding.shape[-1] or embedding.ndim != 2 or labels.shape != hidden.shape[:-1]:
        raise ValueError(f"chunked_cross_entropy: hidden {hidden.shape}, embedding {embedding.shape} and labels "
                         f"{labels.shape} must be (..., width), (vocab, width) and (...)")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1).astype(jnp.int32)
    if over == "vocab":
        vocab = embedding.shape[0]
        size = min(chunk, vocab)
        padded = -(-vocab // size) * size
        rows = jnp.pad(embedding, ((0, padded - vocab), (0, 0))).reshape(padded // size, size, -1)
        return _vocab_loss(ignore_index, vocab, flat_hidden, flat_labels, rows)
    tokens = flat_labels.shape[0]
    size = min(chunk, max(tokens, 1))
    padded = -(-tokens // size) * size
    flat_hidden = jnp.pad(flat_hidden, ((0, padded - tokens), (0, 0)))
    flat_labels = jnp.pad(flat_labels, (0, padded - tokens), constant_values=ignore_index)
    chunks = (flat_hidden.reshape(padded // size, size, -1), flat_labels.reshape(padded // size, size))
    return _loss(ignore_index, *chunks, embedding)


def _chunk_logits(h: jax.Array, embedding: jax.Array) -> jax.Array:
    return jnp.matmul(h, embedding.T, preferred_element_type=jnp.float32)


def _chunk_forward(ignore_index: int, embedding: jax.Array, xs: tuple[jax.Array, jax.Array]) -> tuple[Any, ...]:
    """One chunk's ``(summed loss, log-sum-exp per token)``."""
    h, y = xs
    logits = _chunk_logits(h, embedding)
    lse = jax.nn.logsumexp(logits, axis=-1)
    keep = y != ignore_index
    target = jnp.take_along_axis(logits, jnp.where(keep, y, 0)[:, None], axis=-1)[:, 0]
    return jnp.sum(jnp.where(keep, lse - target, 0.0)), lse


def _count(labels: jax.Array, ignore_index: int) -> jax.Array:
    return jnp.maximum(jnp.sum(labels != ignore_index), 1).astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _loss(ignore_index: int, hidden: jax.Array, labels: jax.Array, embedding: jax.Array) -> jax.Array:
    return _loss_fwd(ignore_index, hidden, labels, embedding)[0]


def _loss_fwd(ignore_index: int, hidden: jax.Array, labels: jax.Array, embedding: jax.Array) -> tuple[Any, Any]:
    sums, lse = jax.lax.map(functools.partial(_chunk_forward, ignore_index, embedding), (hidden, labels))
    return jnp.sum(sums) / _count(labels, ignore_index), (hidden, labels, embedding, lse)


def _loss_bwd(ignore_index: int, saved: Any, g: jax.Array) -> tuple[Any, None, Any]:
    """d loss / d logits = (softmax - onehot) * g / count per kept token; the logits' gradient of
    one chunk at a time, contracted at once into the hidden's and summed into the embedding's."""
    hidden, labels, embedding, lse = saved
    scale = g / _count(labels, ignore_index)

    def chunk_grads(d_embedding: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        h, y, chunk_lse = xs
        logits = _chunk_logits(h, embedding)
        keep = y != ignore_index
        onehot = jax.nn.one_hot(jnp.where(keep, y, -1), logits.shape[-1], dtype=logits.dtype)
        d_logits = (jnp.exp(logits - chunk_lse[:, None]) - onehot) * jnp.where(keep, scale, 0.0)[:, None]
        d_h = jnp.matmul(d_logits, embedding.astype(jnp.float32), preferred_element_type=jnp.float32)
        d_embedding = d_embedding + jnp.matmul(d_logits.T, h.astype(jnp.float32), preferred_element_type=jnp.float32)
        return d_embedding, d_h.astype(h.dtype)

    zeros = jnp.zeros(embedding.shape, jnp.float32)
    d_embedding, d_hidden = jax.lax.scan(chunk_grads, zeros, (hidden, labels, lse))
    return d_hidden, None, d_embedding.astype(embedding.dtype)


_loss.defvjp(_loss_fwd, _loss_bwd)


# --- over="vocab": every token against ``size`` vocabulary entries at a time --------------------

def _vocab_chunk_logits(vocab: int, hidden: jax.Array, rows: jax.Array, start: jax.Array) -> jax.Array:
    """``[tokens, size]`` logits of one chunk of rows; the padding past ``vocab`` is ``-inf``."""
    logits = _chunk_logits(hidden, rows)
    entry = start + jnp.arange(rows.shape[0])
    return jnp.where(entry[None, :] < vocab, logits, -jnp.inf)


def _starts(rows: jax.Array) -> jax.Array:
    return jnp.arange(rows.shape[0]) * rows.shape[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _vocab_loss(ignore_index: int, vocab: int, hidden: jax.Array, labels: jax.Array, rows: jax.Array) -> jax.Array:
    return _vocab_loss_fwd(ignore_index, vocab, hidden, labels, rows)[0]


def _vocab_loss_fwd(ignore_index: int, vocab: int, hidden: jax.Array, labels: jax.Array,
                    rows: jax.Array) -> tuple[Any, Any]:
    """The log-sum-exp over the chunks online (a running maximum and a sum rescaled to it)
    and each token's target logit, picked from the chunk that holds it."""
    def step(carry: tuple[jax.Array, ...], xs: tuple[jax.Array, jax.Array]) -> tuple[tuple[jax.Array, ...], None]:
        top, total, target = carry
        chunk_rows, start = xs
        logits = _vocab_chunk_logits(vocab, hidden, chunk_rows, start)
        new_top = jnp.maximum(top, jnp.max(logits, axis=-1))
        total = total * jnp.exp(top - new_top) + jnp.sum(jnp.exp(logits - new_top[:, None]), axis=-1)
        at = labels - start
        inside = (at >= 0) & (at < chunk_rows.shape[0])
        picked = jnp.take_along_axis(logits, jnp.clip(at, 0, chunk_rows.shape[0] - 1)[:, None], axis=-1)[:, 0]
        return (new_top, total, target + jnp.where(inside, picked, 0.0)), None

    tokens = labels.shape[0]
    start = (jnp.full((tokens,), -jnp.inf, jnp.float32), jnp.zeros((tokens,), jnp.float32),
             jnp.zeros((tokens,), jnp.float32))
    (top, total, target), _ = jax.lax.scan(step, start, (rows, _starts(rows)))
    lse = top + jnp.log(total)
    keep = labels != ignore_index
    loss = jnp.sum(jnp.where(keep, lse - target, 0.0)) / _count(labels, ignore_index)
    return loss, (hidden, labels, rows, lse)


def _vocab_loss_bwd(ignore_index: int, vocab: int, saved: Any, g: jax.Array) -> tuple[Any, None, Any]:
    """Each chunk's logits' gradient, contracted into its rows of the head's gradient (a scan
    output, written once) and summed into the hidden's (a ``[tokens, width]`` carry)."""
    hidden, labels, rows, lse = saved
    keep = labels != ignore_index
    weight = jnp.where(keep, g / _count(labels, ignore_index), 0.0)

    def step(d_hidden: jax.Array, xs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        chunk_rows, start = xs
        logits = _vocab_chunk_logits(vocab, hidden, chunk_rows, start)
        onehot = (labels - start)[:, None] == jnp.arange(chunk_rows.shape[0])[None, :]
        d_logits = (jnp.exp(logits - lse[:, None]) - onehot.astype(logits.dtype)) * weight[:, None]
        d_hidden = d_hidden + jnp.matmul(d_logits, chunk_rows.astype(jnp.float32), preferred_element_type=jnp.float32)
        d_rows = jnp.matmul(d_logits.T, hidden.astype(jnp.float32), preferred_element_type=jnp.float32)
        return d_hidden, d_rows.astype(rows.dtype)

    d_hidden, d_rows = jax.lax.scan(step, jnp.zeros(hidden.shape, jnp.float32), (rows, _starts(rows)))
    return d_hidden.astype(hidden.dtype), None, d_rows


_vocab_loss.defvjp(_vocab_loss_fwd, _vocab_loss_bwd)
