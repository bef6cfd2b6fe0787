"""remat.ops.chunked_cross_entropy against optax on the full logits: values, gradients, memory."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from remat import ops


@functools.cache  # drawn once per shape
def _problem(batch: int, seq: int, width: int, vocab: int, ignored: int = 0, seed: int = 0):
    # drawn by NumPy: jax.random's threefry compiles for every shape (1.5-3 s of CPU a shape)
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((batch, seq, width), np.float32)
    embedding = rng.standard_normal((vocab, width), np.float32) * np.float32(width ** -0.5)
    labels = rng.integers(0, vocab, (batch, seq), np.int32)
    labels[0, :ignored] = -100
    return jax.device_put((hidden, embedding, labels))  # as they are (jnp.asarray compiles a program per array)


def _reference(hidden, embedding, labels):
    """optax on the full logits, averaged over the labels that are not -100 (HuggingFace's loss)."""
    keep = labels != -100
    losses = optax.softmax_cross_entropy_with_integer_labels(hidden @ embedding.T, jnp.where(keep, labels, 0))
    return jnp.sum(jnp.where(keep, losses, 0.0)) / jnp.sum(keep)


# one jitted reference for the module: the chunk parameters below share its compiled program
# (the labels, their ignored entries included, are an argument)
_reference_value_and_grads = jax.jit(jax.value_and_grad(_reference, (0, 1)))


def _rel(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)  # by NumPy: in jnp, each eager operation compiles alone
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


# the default run: over tokens, 10 does not divide 2*24 tokens, with ignored labels; over the
# vocabulary, 64 exceeds its 50 entries, with none ignored. The other chunk sizes and ignore counts
# (a chunk that exceeds the tokens, one that does not divide the vocabulary) are slow (a chunk
# that divides: test_compiled_step_never_holds_the_full_logits)
FAST_CHUNKS = {("tokens", 10, 5), ("vocab", 64, 0)}


@pytest.mark.parametrize(("over", "chunk", "ignored"), [
    pytest.param(o, c, i, marks=() if (o, c, i) in FAST_CHUNKS else pytest.mark.slow)
    for o in ("tokens", "vocab") for c in (1, 7, 8, 10, 64, 1000) for i in (0, 5)])
def test_value_and_gradients_equal_optax_on_full_logits(over, chunk, ignored):
    hidden, embedding, labels = _problem(2, 24, 16, 50, ignored)
    loss = jax.jit(lambda h, w: ops.chunked_cross_entropy(h, w, labels, chunk=chunk, over=over))
    expected, (g_h, g_w) = _reference_value_and_grads(hidden, embedding, labels)
    got, (c_h, c_w) = jax.jit(jax.value_and_grad(loss, (0, 1)))(hidden, embedding)
    assert abs(float(got) - float(expected)) <= 1e-6 * abs(float(expected))
    assert _rel(c_h, g_h) < 1e-5 and _rel(c_w, g_w) < 1e-5  # float32 rounding, different summation order
    if ignored:
        assert float(np.max(np.abs(np.asarray(c_h)[0, :ignored]))) == 0.0  # ignored tokens get no gradient


def test_gradient_scales_with_the_incoming_cotangent():
    hidden, embedding, labels = _problem(2, 24, 16, 50)
    def loss(h):
        return ops.chunked_cross_entropy(h, embedding, labels, chunk=5)

    # compiled: the pullback in one program instead of one per operation
    chunked = jax.jit(lambda h, t: jax.vjp(loss, h)[1](t)[0])(hidden, np.float32(3.0))
    # three times the reference's gradient (the module's compiled reference, these shapes)
    assert _rel(chunked, 3.0 * np.asarray(_reference_value_and_grads(hidden, embedding, labels)[1][0])) < 1e-5


@pytest.mark.parametrize("over", ["tokens", "vocab"])
def test_all_ignored_is_zero_not_nan(over):
    hidden, embedding, labels = _problem(2, 24, 16, 50)
    labels = jax.device_put(np.full(labels.shape, -100, np.int32))
    loss, grad = jax.jit(jax.value_and_grad(
        lambda h: ops.chunked_cross_entropy(h, embedding, labels, chunk=3, over=over)))(hidden)
    assert float(loss) == 0.0 and float(np.max(np.abs(np.asarray(grad)))) == 0.0


# over the vocabulary (its own custom VJP) by default; over tokens with -m slow
@pytest.mark.parametrize("over", [pytest.param("tokens", marks=pytest.mark.slow), "vocab"])
def test_bfloat16_inputs_give_a_float32_loss_close_to_float32(over):
    hidden, embedding, labels = _problem(2, 24, 16, 50)
    exact = _reference_value_and_grads(hidden, embedding, labels)[0]  # the module's compiled reference
    h16, w16 = (jax.device_put(np.asarray(a).astype(jnp.bfloat16)) for a in (hidden, embedding))  # cast by NumPy
    # the loss and its gradients from one compiled program
    low, (grad_h, grad_w) = jax.jit(jax.value_and_grad(
        lambda h, w: ops.chunked_cross_entropy(h, w, labels, chunk=8, over=over), (0, 1)))(h16, w16)
    assert low.dtype == jnp.float32 and grad_h.dtype == grad_w.dtype == jnp.bfloat16
    assert abs(float(low) - float(exact)) < 2e-2 * float(exact)


@pytest.mark.parametrize("bad", [{"chunk": 0}, {"labels_shape": (2, 5)}, {"over": "batch"}])
def test_bad_arguments_are_one_line_errors(bad):
    hidden, embedding, labels = _problem(2, 24, 16, 50)
    if "labels_shape" in bad:
        labels = jnp.zeros(bad["labels_shape"], jnp.int32)
    with pytest.raises(ValueError, match="chunked_cross_entropy") as info:
        ops.chunked_cross_entropy(hidden, embedding, labels, chunk=bad.get("chunk", 4), over=bad.get("over", "tokens"))
    assert "\n" not in str(info.value)


def test_compiled_step_never_holds_the_full_logits():
    """jit(grad) of the plain loss holds [tokens, vocab] logits and their gradient; chunked, far less."""
    hidden, embedding, labels = _problem(2, 512, 32, 4096)
    logits_bytes = 2 * 512 * 4096 * 4

    def temp_and_value(loss):  # one compiled step: its temp, and the loss it returns
        compiled = jax.jit(jax.value_and_grad(loss, (0, 1))).lower(hidden, embedding, labels).compile()
        return compiled.memory_analysis().temp_size_in_bytes, float(compiled(hidden, embedding, labels)[0])

    plain, plain_value = temp_and_value(_reference)
    chunked, chunked_value = temp_and_value(lambda h, w, y: ops.chunked_cross_entropy(h, w, y, chunk=64))
    assert plain >= logits_bytes  # the full logits (or their gradient) are there
    # a chunk's logits are 1/16 of them; jax 0.8.1 also holds their gradient beside them (1/8)
    assert chunked < logits_bytes / 4
    np.testing.assert_allclose(chunked_value, plain_value, rtol=1e-6)


def test_over_the_vocabulary_the_heads_gradient_needs_no_accumulator():
    """Few tokens, a large vocabulary (a 135M Llama's head at 256 tokens, narrowed): chunked over
    tokens, the backward sums the head's [vocab, width] gradient in a buffer of its own; chunked
    over the vocabulary, each chunk writes its rows once, and the temp holds about a chunk's logits."""
    tokens, width, vocab, chunk = 256, 64, 16384, 512
    hidden, embedding, labels = _problem(1, tokens, width, vocab)

    def temp(loss):
        compiled = jax.jit(jax.grad(loss, (0, 1))).lower(hidden, embedding, labels).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    head_bytes, chunk_logits = vocab * width * 4, tokens * chunk * 4
    over_tokens = temp(lambda h, w, y: ops.chunked_cross_entropy(h, w, y, chunk=64))
    over_vocab = temp(lambda h, w, y: ops.chunked_cross_entropy(h, w, y, chunk=chunk, over="vocab"))
    assert over_tokens >= head_bytes  # the accumulator
    # no [vocab, width] buffer, and a few chunks' logits (XLA's temp differs between JAX releases)
    assert over_vocab < head_bytes / 2 and over_vocab < 4 * chunk_logits
