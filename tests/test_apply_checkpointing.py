"""``remat.apply_checkpointing``: checkpointing turned on from outside, in models written without remat.

The models come from ``tests/foreign_models`` (a package that never imports remat) and
from Flax itself (``nn.MultiHeadDotProductAttention``, ``nnx.MultiHeadAttention``).
"""
from __future__ import annotations

import copy
import functools
import pickle
import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_clean_error, assert_trees_close, count_remat_eqns
from flax import nnx
from foreign_models import (
    EncoderDecoder,
    LinenBlock,
    LinenEncoderDecoder,
    LinenMixer,
    LinenTiedLM,
    Mixer,
    MixerBlock,
    TiedLM,
)

import remat
from remat.analysis import compiled_memory

WIDTH, DEPTH, BATCH = 16, 4, 8


def _drawn(shapes: Any, seed: int = 0) -> Any:
    """Arrays of the shapes and dtypes of ``shapes`` (``jax.eval_shape`` of an init, an
    ``nnx.eval_shape``'d module's state) drawn by NumPy and put on the device as they are: run
    eagerly, the models' initialisers compile a program for each shape (a second or two at
    XLA's level 0). Weights scaled as LeCun's initialiser scales them, LayerNorm scales about 1."""
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        a = rng.standard_normal(leaf.shape)
        if len(leaf.shape) >= 2:
            a = a / np.sqrt(np.prod(leaf.shape[:-1]))
        else:
            a = (1.0 if "scale" in jax.tree_util.keystr(path) else 0.0) + 0.1 * a
        return jax.device_put(a.astype(leaf.dtype))

    return jax.tree_util.tree_map_with_path(draw, shapes)


def _built(make, seed: int = 0) -> Any:
    """``make()``, an NNX module, with its parameters :func:`_drawn` (the same seed, the same values)."""
    graphdef, state = nnx.split(nnx.eval_shape(make))
    return nnx.merge(graphdef, _drawn(state, seed))


@functools.cache
def _built_mixer(seed: int, width: int, depth: int) -> Mixer:
    return _built(lambda: Mixer(16, width, depth, 8, rngs=nnx.Rngs(seed)), seed)


def _mixer(seed: int = 0, width: int = WIDTH, depth: int = DEPTH) -> Mixer:
    """A fresh Mixer (a clone of one built once per size: tests change their models in place)."""
    return nnx.clone(_built_mixer(seed, width, depth))


def _x(batch: int = BATCH) -> jax.Array:
    # cast by NumPy and put on the device as it is (jnp.asarray's cast compiles a program)
    return jax.device_put(np.random.default_rng(0).standard_normal((batch, 16)).astype(np.float32))


def _pure_loss(model: nnx.Module, method: str = "__call__"):
    """``loss(state, x)`` of ``model.method`` split once: the graphdef carries the checkpointed classes."""
    graphdef, state = nnx.split(model)

    def loss(state, x):
        return jnp.mean(getattr(nnx.merge(graphdef, state), method)(x) ** 2)

    return loss, state


def _regions(model: nnx.Module, x: jax.Array, method: str = "__call__") -> int:
    loss, state = _pure_loss(model, method)
    return count_remat_eqns(jax.make_jaxpr(jax.grad(loss))(state, x))


def _grads_together(*pairs):
    """``jax.grad`` of each ``(loss, args)`` pair, all in one compiled program (one compile,
    not one per side: the checkpointed loss and its plain reference are compared)."""
    grads = jax.jit(lambda args: [jax.grad(loss)(*a) for (loss, _), a in zip(pairs, args)])
    return grads([a for _, a in pairs])


def _state_shapes(model: nnx.Module):
    return jax.tree.map(lambda v: (v.shape, v.dtype), nnx.state(model))


# --- NNX -------------------------------------------------------------------------------

# two blocks in the default run, the module's four (DEPTH) with the slow cases
@pytest.mark.parametrize("depth", [2, pytest.param(DEPTH, marks=pytest.mark.slow)])
def test_nnx_gradients_equal_and_one_region_per_selected_module(depth):
    model, plain, x = _mixer(depth=depth), _mixer(depth=depth), _x()
    before = _state_shapes(model)
    assert _regions(model, x) == 0
    assert remat.apply_checkpointing(model, MixerBlock) is model  # NNX: changed in place, and returned
    paths = [("blocks", i) for i in range(depth)]
    assert _state_shapes(model) == before  # the same nnx.state paths, shapes and dtypes
    assert _regions(model, x) == depth
    loss, state = _pure_loss(model)
    plain_loss, plain_state = _pure_loss(plain)
    grads, plain_grads = _grads_together((loss, (state, x)), (plain_loss, (plain_state, x)))
    assert_trees_close(grads, plain_grads, rtol=1e-6, atol=1e-7)
    assert remat.checkpointed(model) == [(p, None) for p in paths]  # the policy as asked: remat's default
    assert isinstance(model.blocks[0], MixerBlock) and type(model.blocks[0]).__name__ == "MixerBlock"


def test_nnx_idempotent_every_policy_and_reversible():
    model, x = _mixer(), _x()
    remat.apply_checkpointing(model, MixerBlock)
    first, cls = remat.checkpointed(model), type(model.blocks[0])
    assert remat.apply_checkpointing(model, MixerBlock) is model and remat.checkpointed(model) == first
    assert type(model.blocks[0]) is cls and _regions(model, x) == DEPTH  # not wrapped twice
    remat.apply_checkpointing(model, lambda path, m: isinstance(m, MixerBlock), policy="dots", every=2)
    # re-applying replaces: layers 1 and 3 keep nothing of the first call
    assert remat.checkpointed(model) == [(("blocks", 0), "dots"), (("blocks", 2), "dots")]
    assert type(model.blocks[1]) is MixerBlock and type(model.blocks[3]) is MixerBlock
    assert _regions(model, x) == DEPTH // 2  # and never nests
    assert remat.remove_checkpointing(model) is model
    assert remat.checkpointed(model) == [] and type(model.blocks[0]) is MixerBlock
    assert _regions(model, x) == 0


def test_nnx_pickle_and_deepcopy_keep_the_checkpoints():
    model, x = _mixer(), _x()
    remat.apply_checkpointing(model, MixerBlock, policy="dots", every=2)
    forward = nnx.jit(lambda m, x: m(x))  # compiled once: the copies have the model's graphdef
    for copied in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert remat.checkpointed(copied) == remat.checkpointed(model)
        assert type(copied.blocks[0]) is type(model.blocks[0]) and type(copied.blocks[1]) is MixerBlock
        np.testing.assert_array_equal(forward(copied, x), forward(model, x))


def test_nnx_torch_style_check_fn_and_paths():
    model = _mixer()
    # torch's apply_activation_checkpointing passes only the module
    remat.apply_checkpointing(model, lambda m: isinstance(m, nnx.Linear))
    assert [p for p, _ in remat.checkpointed(model)] == [
        ("blocks", i, name) for i in range(DEPTH) for name in ("down", "up")] + [("inp",), ("out",)]
    remat.apply_checkpointing(model, lambda path, m: path[-1:] == ("up",))
    assert [p for p, _ in remat.checkpointed(model)] == [("blocks", i, "up") for i in range(DEPTH)]


@pytest.mark.slow
def test_nnx_jit_grad_optimizer_match_the_plain_model():
    model, plain, x = _mixer(), _mixer(), _x()
    remat.apply_checkpointing(model, MixerBlock)

    @nnx.jit
    def step(m, opt, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(m)
        opt.update(m, grads)
        return loss

    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    plain_opt = nnx.Optimizer(plain, optax.adam(1e-2), wrt=nnx.Param)
    losses = [float(step(model, opt, x)) for _ in range(3)]
    plain_losses = [float(step(plain, plain_opt, x)) for _ in range(3)]
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
    assert_trees_close(nnx.state(model, nnx.Param), nnx.state(plain, nnx.Param), rtol=1e-5, atol=1e-6)
    # the optimizer's state has the paths it had before apply_checkpointing
    assert jax.tree.structure(nnx.state(opt)) == jax.tree.structure(nnx.state(plain_opt))


def test_nnx_shared_module_and_split_merge():
    class Twice(nnx.Module):
        def __init__(self, rngs):
            self.block = MixerBlock(WIDTH, rngs=rngs)
            self.again = self.block  # the same submodule, referenced twice
            self.inp = nnx.Linear(16, WIDTH, rngs=rngs)

        def __call__(self, x):
            return self.again(self.block(self.inp(x))).sum(-1)

    model, plain, x = _built(lambda: Twice(nnx.Rngs(0))), _built(lambda: Twice(nnx.Rngs(0))), _x()
    remat.apply_checkpointing(model, MixerBlock)
    assert remat.checkpointed(model) == [(("again",), None)]  # one module, listed once
    assert model.block is model.again and type(model.block) is type(model.again)
    assert _regions(model, x) == 2  # called twice: two regions
    loss, state = _pure_loss(model)
    plain_loss, plain_state = _pure_loss(plain)
    grads, plain_grads = _grads_together((loss, (state, x)), (plain_loss, (plain_state, x)))
    assert_trees_close(grads, plain_grads, rtol=1e-6, atol=1e-7)
    graphdef, state = nnx.split(model)
    merged = nnx.merge(graphdef, state)
    assert merged.block is merged.again and remat.checkpointed(merged) == [(("again",), None)]


@pytest.mark.slow
def test_nnx_scan_over_stacked_blocks():
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
        return MixerBlock(WIDTH, rngs=nnx.Rngs(key))

    keys = jax.random.split(jax.random.key(0), DEPTH)
    stacked, plain = make(keys), make(keys)
    remat.apply_checkpointing(stacked, MixerBlock)

    def run(block, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def body(layer, h):
            return layer(h)
        return jnp.mean(body(block, x) ** 2)

    x = _x()[:, :1] * jnp.ones((1, WIDTH))
    grads = nnx.jit(nnx.grad(run))(stacked, x)
    assert_trees_close(grads, nnx.jit(nnx.grad(run))(plain, x), rtol=1e-5, atol=1e-6)
    graphdef, state = nnx.split(stacked)
    jaxpr = jax.make_jaxpr(jax.grad(lambda s, x: run(nnx.merge(graphdef, s), x)))(state, x)
    assert count_remat_eqns(jaxpr) == 1  # one region, in the scan's body


@pytest.mark.slow
def test_flax_attention_from_another_package():
    attention = nnx.MultiHeadAttention(num_heads=2, in_features=16, qkv_features=16, decode=False,
                                       rngs=nnx.Rngs(0))
    plain = nnx.clone(attention)
    x = jnp.ones((2, 5, 16)) * jnp.arange(16) / 16
    remat.apply_checkpointing(attention, nnx.LinearGeneral)
    assert [p for p, _ in remat.checkpointed(attention)] == [("key",), ("out",), ("query",), ("value",)]

    def loss(m):
        return jnp.sum(m(x) ** 2)

    assert_trees_close(nnx.jit(nnx.grad(loss))(attention), nnx.jit(nnx.grad(loss))(plain), rtol=1e-6, atol=1e-7)


# --- Linen -----------------------------------------------------------------------------

def _linen_loss(model: nn.Module, deterministic: bool = False):
    def loss(params, x):
        out = model.apply(params, x, deterministic, rngs={"dropout": jax.random.key(1)})
        return jnp.mean(out ** 2)
    return loss


# two blocks in the default run, LinenMixer's four with the slow cases
@pytest.mark.parametrize("depth", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_linen_gradients_equal_names_kept_and_one_region_per_block(depth):
    model, x = LinenMixer(width=WIDTH, depth=depth), _x()
    params = _drawn(jax.eval_shape(lambda x: model.init(jax.random.key(0), x), x))  # the key traced too
    checkpointed = remat.apply_checkpointing(model, LinenBlock)
    assert type(checkpointed).__name__ == "LinenMixer" and checkpointed.width == model.width
    shapes = jax.eval_shape(lambda x: checkpointed.init(jax.random.key(0), x), x)
    assert jax.tree.structure(shapes) == jax.tree.structure(params)
    assert remat.checkpointed(checkpointed) == [((f"LinenBlock_{i}",), None) for i in range(depth)]
    loss, plain_loss = _linen_loss(checkpointed), _linen_loss(model)
    # dropout on: the recomputation draws the same mask
    grads, plain_grads = _grads_together((loss, (params, x)), (plain_loss, (params, x)))
    assert_trees_close(grads, plain_grads, rtol=1e-6, atol=1e-7)
    assert count_remat_eqns(jax.make_jaxpr(jax.grad(loss))(params, x)) == depth
    assert count_remat_eqns(jax.make_jaxpr(jax.grad(plain_loss))(params, x)) == 0
    assert remat.remove_checkpointing(checkpointed) == model


def test_linen_class_every_and_paths():
    x = _x()
    cls = remat.apply_checkpointing(LinenMixer, LinenBlock, every=2, policy="dots")
    assert isinstance(cls, type) and issubclass(cls, LinenMixer) and cls.__name__ == "LinenMixer"
    model = cls(width=WIDTH, depth=4)
    params = jax.eval_shape(model.init, jax.random.key(0), x)  # traced, not run: only regions are counted
    assert count_remat_eqns(jax.make_jaxpr(jax.grad(_linen_loss(model)))(params, x)) == 2
    assert remat.checkpointed(model) == [(("LinenBlock_0",), "dots"), (("LinenBlock_2",), "dots")]
    only_dense = remat.apply_checkpointing(model, lambda path, m: isinstance(m, nn.Dense) and len(path) == 2)
    assert count_remat_eqns(jax.make_jaxpr(jax.grad(_linen_loss(only_dense)))(params, x)) == 8
    assert remat.remove_checkpointing(cls) is LinenMixer


def test_linen_attention_from_flax():
    attention = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)
    x = jax.device_put((np.ones((2, 5, 16)) * np.arange(16) / 16).astype(np.float32))
    params = _drawn(jax.eval_shape(lambda x: attention.init(jax.random.key(0), x), x))
    checkpointed = remat.apply_checkpointing(attention, nn.DenseGeneral, policy="dots")

    def loss(module):
        return lambda p: jnp.sum(module.apply(p, x) ** 2)

    grads, plain_grads = _grads_together((loss(checkpointed), (params,)), (loss(attention), (params,)))
    assert_trees_close(grads, plain_grads, rtol=1e-6, atol=1e-7)
    assert count_remat_eqns(jax.make_jaxpr(jax.grad(loss(checkpointed)))(params)) == 4
    assert sorted(p for p, _ in remat.checkpointed(checkpointed)) == [("key",), ("out",), ("query",), ("value",)]


# --- every method of a selected module, whatever calls it ------------------------------

def _linen_regions_and_grads(model: nn.Module, params, x, method: Any = None):
    def loss(p):
        return jnp.mean(model.apply(p, x, method=method) ** 2)
    traced = jax.jit(jax.grad(loss)).trace(params)  # one trace: counted, then compiled
    return count_remat_eqns(traced.jaxpr), traced.lower().compile()(params)


def _linen_regions(model: nn.Module, params, x, method: Any = None) -> int:
    def loss(p):
        return jnp.mean(model.apply(p, x, method=method) ** 2)
    return count_remat_eqns(jax.make_jaxpr(jax.grad(loss))(params))


@pytest.mark.slow
def test_nnx_entry_points_and_methods_other_than_call():
    model, plain, x = EncoderDecoder(WIDTH, 2, rngs=nnx.Rngs(0)), EncoderDecoder(WIDTH, 2, rngs=nnx.Rngs(0)), _x()
    remat.apply_checkpointing(model, MixerBlock)
    assert _regions(model, x, "encode") == 2 and _regions(model, x) == 4
    for method in ("encode", "__call__"):
        loss, state = _pure_loss(model, method)
        plain_loss, plain_state = _pure_loss(plain, method)
        assert_trees_close(jax.jit(jax.grad(loss))(state, x), jax.jit(jax.grad(plain_loss))(plain_state, x),
                           rtol=1e-6, atol=1e-7)
    # the root selected: its __call__ is one region, and encode/decode run inside it as they are
    remat.apply_checkpointing(model, lambda path, m: path == ())
    assert _regions(model, x) == 1 and _regions(model, x, "encode") == 1
    # a selected module's other methods are regions too: nnx.Embed's lookup and its attend
    lm, plain_lm = TiedLM(32, WIDTH, rngs=nnx.Rngs(0)), TiedLM(32, WIDTH, rngs=nnx.Rngs(0))
    remat.apply_checkpointing(lm, nnx.Embed)
    ids = jnp.arange(6).reshape(2, 3)
    assert _regions(lm, ids) == 2 and remat.checkpointed(lm) == [(("embed",), None)]
    (loss, state), (plain_loss, plain_state) = _pure_loss(lm), _pure_loss(plain_lm)
    assert_trees_close(jax.jit(jax.grad(loss))(state, ids), jax.jit(jax.grad(plain_loss))(plain_state, ids),
                       rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_linen_entry_points_and_methods_other_than_call():
    plain, x = LinenEncoderDecoder(width=WIDTH), _x()
    params = jax.jit(plain.init)(jax.random.key(0), x)
    model = remat.apply_checkpointing(plain, LinenBlock)
    for method, regions in (("encode", 2), (None, 4), (lambda m, x: m.decode(m.encode(x)), 4)):
        n, grads = _linen_regions_and_grads(model, params, x, method)
        assert n == regions, method
        assert_trees_close(grads, _linen_regions_and_grads(plain, params, x, method)[1], rtol=1e-6, atol=1e-7)
    model.apply(params, x, method="encode")
    assert remat.checkpointed(model) == [(("encoder_0",), None), (("encoder_1",), None)]
    # the root selected: whichever entry point, one region, its own methods running inside it
    root = remat.apply_checkpointing(plain, lambda path, m: path == ())
    assert [_linen_regions(root, params, x, m) for m in ("encode", None)] == [1, 1]
    # a selected module's other methods are regions too: nn.Embed's lookup and its attend
    lm, ids = LinenTiedLM(), jnp.arange(6).reshape(2, 3)
    lm_params = jax.jit(lm.init)(jax.random.key(0), ids)
    applied = remat.apply_checkpointing(lm, nn.Embed, policy="dots")
    n, grads = _linen_regions_and_grads(applied, lm_params, ids)
    assert n == 2 and remat.checkpointed(applied) == [(("Embed_0",), "dots")]
    assert_trees_close(grads, _linen_regions_and_grads(lm, lm_params, ids)[1], rtol=1e-6, atol=1e-7)


def test_checkpointed_lists_the_policy_as_asked():
    model = _mixer()
    for policy in (None, "nothing", "dots", ["a", "b"], ("a", "b")):
        remat.apply_checkpointing(model, MixerBlock, policy=policy)
        assert remat.checkpointed(model) == [(("blocks", i), policy) for i in range(DEPTH)]


# --- memory ----------------------------------------------------------------------------

class HandWrittenMixer(Mixer):
    """The same model with its blocks checkpointed by hand, the way remat.checkpoint is written."""

    def __call__(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = remat.checkpoint(block, x)
        return self.out(x)


MEMORY_SIZES = {"width": 128, "depth": 8, "batch": 512}


def _temp_bytes(model: nnx.Module, x: jax.Array) -> int:
    loss, state = _pure_loss(model)
    return compiled_memory(loss, state, x).temp_bytes


@pytest.mark.slow
def test_compiled_temp_memory_drops_as_much_as_hand_written():
    """The table of docs/apply_checkpointing.md; with ``-m slow -k compiled_temp -s`` it prints the numbers."""
    w, d, b = MEMORY_SIZES["width"], MEMORY_SIZES["depth"], MEMORY_SIZES["batch"]
    x = _x(b)
    plain = _mixer(width=w, depth=d)
    applied = _mixer(width=w, depth=d)
    remat.apply_checkpointing(applied, MixerBlock)
    hand = HandWrittenMixer(16, w, d, 8, rngs=nnx.Rngs(0))
    none_b, applied_b, hand_b = _temp_bytes(plain, x), _temp_bytes(applied, x), _temp_bytes(hand, x)
    mib = 2 ** 20
    print(f"\nNNX mixer {d} blocks, width {w}, batch {b}: compiled temp MiB: no checkpoint {none_b / mib:.1f}, "
          f"remat.checkpoint by hand {hand_b / mib:.1f}, apply_checkpointing {applied_b / mib:.1f}")
    assert applied_b == hand_b
    assert applied_b < 0.5 * none_b


class HandWrittenLinenMixer(LinenMixer):
    @nn.compact
    def __call__(self, x, deterministic=True):
        x = nn.Dense(self.width)(x)
        for _ in range(self.depth):
            x = remat.checkpoint(LinenBlock, static_argnums=(2,))(self.width)(x, deterministic)
        return nn.Dense(self.out_dim)(jnp.tanh(x))


@pytest.mark.slow
def test_linen_compiled_temp_memory_drops_as_much_as_hand_written():
    w, d, b = MEMORY_SIZES["width"], MEMORY_SIZES["depth"], MEMORY_SIZES["batch"]
    x = _x(b)
    plain = LinenMixer(width=w, depth=d)
    params = plain.init(jax.random.key(0), x)
    hand = HandWrittenLinenMixer(width=w, depth=d)
    assert jax.tree.structure(hand.init(jax.random.key(0), x)) == jax.tree.structure(params)
    sizes = [compiled_memory(_linen_loss(m, deterministic=True), params, x).temp_bytes
             for m in (plain, hand, remat.apply_checkpointing(plain, LinenBlock))]
    mib = 2 ** 20
    print(f"\nLinen mixer {d} blocks, width {w}, batch {b}: compiled temp MiB: no checkpoint {sizes[0] / mib:.1f}, "
          f"remat.checkpoint(LinenBlock) {sizes[1] / mib:.1f}, apply_checkpointing {sizes[2] / mib:.1f}")
    assert sizes[2] == sizes[1]
    assert sizes[2] < 0.5 * sizes[0]


# --- errors ----------------------------------------------------------------------------

def test_no_match_warns_with_the_classes_seen_and_changes_nothing():
    model = _mixer()
    with pytest.warns(UserWarning, match="matched no submodule.*LayerNorm, Linear, List, Mixer, MixerBlock"):
        assert remat.apply_checkpointing(model, nnx.Conv) is model
    assert remat.checkpointed(model) == [] and type(model.blocks[0]) is MixerBlock


@pytest.mark.parametrize("call, fragments", [
    (lambda m: remat.apply_checkpointing(lambda x: x, MixerBlock), ["NNX module", "remat.checkpoint"]),
    # how Flax's ImageNet example exports ResNet18 = partial(ResNet, ...): the fix is to build the model
    (lambda m: remat.apply_checkpointing(functools.partial(LinenMixer, depth=2), LinenBlock),
     ["functools.partial(LinenMixer, ...)", "build the Linen module first"]),
    (lambda m: remat.apply_checkpointing(functools.partial(Mixer, 16), MixerBlock),
     ["functools.partial(Mixer, ...)", "build the NNX module first"]),
    (lambda m: remat.apply_checkpointing(Mixer, MixerBlock), ["the NNX class Mixer", "build the model first"]),
    (lambda m: remat.apply_checkpointing({"params": 1}, MixerBlock), ["got dict"]),
    (lambda m: remat.apply_checkpointing(m, MixerBlock, every=0), ["every=0", ">= 1"]),
    (lambda m: remat.apply_checkpointing(m, MixerBlock, policy="dots_no_batches"), ["dots_no_batches"]),
    (lambda m: remat.apply_checkpointing(m, "MixerBlock"), ["check_fn", "class"]),
    (lambda m: remat.apply_checkpointing(m, MixerBlock, context_fn=object()), ["policy="]),
    (lambda m: remat.apply_checkpointing(m, MixerBlock, polcy="dots"), ["'polcy'", "prevent_cse"]),
])
def test_bad_input_is_one_line_and_leaves_the_model_alone(call, fragments):
    model = _mixer()
    with pytest.raises((TypeError, ValueError)) as e:
        call(model)
    assert_clean_error(e, *fragments)
    assert remat.checkpointed(model) == [] and type(model.blocks[0]) is MixerBlock


def test_a_module_without_call_is_refused_before_any_change():
    class Holder(nnx.Module):
        def __init__(self, rngs):
            self.block = MixerBlock(WIDTH, rngs=rngs)

    class Outer(nnx.Module):
        def __init__(self, rngs):
            self.holder = Holder(rngs)
            self.block = MixerBlock(WIDTH, rngs=rngs)

    model = _built(lambda: Outer(nnx.Rngs(0)))
    with pytest.raises(TypeError) as e:
        remat.apply_checkpointing(model, (Holder, MixerBlock))
    assert_clean_error(e, "Holder defines no method to checkpoint")
    assert remat.checkpointed(model) == []


def test_linen_no_match_warns_at_trace_time():
    model = remat.apply_checkpointing(LinenMixer(width=WIDTH, depth=1), nn.Conv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.eval_shape(model.init, jax.random.key(0), _x(2))
    assert any("Dense, Dropout, LayerNorm, LinenBlock, LinenMixer" in str(w.message) for w in caught)


# --- planner ---------------------------------------------------------------------------

def test_region_paths_name_the_applied_modules_in_trace_order():
    from remat.planner import region_paths

    model, x = _mixer(), _x()
    remat.apply_checkpointing(model, MixerBlock, every=2)
    loss, state = _pure_loss(model)
    assert region_paths(loss, state, x) == [("blocks", 0), ("blocks", 2)]
    hand = _built(lambda: HandWrittenMixer(16, WIDTH, DEPTH, 8, rngs=nnx.Rngs(0)))
    hand_loss, hand_state = _pure_loss(hand)
    assert region_paths(hand_loss, hand_state, x) == [None] * DEPTH  # written by hand: no module path



class _HandInside(nnx.Module):
    """A block with a region written by hand inside its own body."""

    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return remat.checkpoint(lambda h: jnp.tanh(self.lin(h)), x) + x


class _TwoHandInside(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.first, self.second = _HandInside(rngs), _HandInside(rngs)

    def __call__(self, x):
        return self.second(self.first(x))


def test_region_paths_mark_a_hand_region_inside_an_applied_one_as_written_by_hand():
    from remat.planner import region_paths

    model = remat.apply_checkpointing(_built(lambda: _TwoHandInside(nnx.Rngs(0))), lambda path, m: path == ("first",))
    loss, state = _pure_loss(model)
    # the applied region, then the hand-written one it calls (not a second region of "first"),
    # then the hand-written region of the unselected second block
    assert region_paths(loss, state, np.ones((2, 4), np.float32)) == [("first",), None, None]

@pytest.mark.slow
def test_plan_redecides_applied_regions_as_hand_written_ones_and_picks_modules():
    from remat.planner import plan, region_paths
    from remat.policies import NO_CHECKPOINT as NONE

    x = _x(256)
    applied, hand = _mixer(width=128), HandWrittenMixer(16, 128, DEPTH, 8, rngs=nnx.Rngs(0))
    remat.apply_checkpointing(applied, MixerBlock)
    # the compile-everything search, whose candidate families (budgets, "first k") are checked below
    kwargs = dict(memory_budget=0.5, measure=False, policies=("nothing", "dots"), budget_fractions=(0.5,),
                  exhaustive=True)
    loss, state = _pure_loss(applied)
    planned = plan(loss, state, x, **kwargs)
    hand_loss, hand_state = _pure_loss(hand)
    by_hand = plan(hand_loss, hand_state, x, **kwargs)
    # the same candidates, compiled to the same memory: the planner cannot tell them apart
    assert planned.num_regions == by_hand.num_regions == DEPTH
    assert {c.label: c.temp_bytes for c in planned.candidates} == {c.label: c.temp_bytes for c in by_hand.candidates}
    labels = {c.label for c in planned.candidates}
    assert {"all: nothing", "all: dots", "all: residual_budget(0.5)"} <= labels  # a policy or a budget per module
    assert any(label.startswith("first ") for label in labels)  # which modules: some left unchecked
    # the chosen plan, module by module
    choice = dict(zip(region_paths(loss, state, x), planned.chosen.policies))
    assert set(choice) == {("blocks", i) for i in range(DEPTH)}
    grads = jax.jit(jax.grad(planned.apply(loss)))(state, x)
    assert_trees_close(grads, jax.jit(jax.grad(loss))(state, x), rtol=1e-5, atol=1e-6)
    prefix = next(c for c in planned.candidates if c.label.startswith("first "))
    assert NONE in prefix.policies or "dots" in prefix.policies
    # the default search, region by region, decides the applied regions as the hand-written ones
    fast = plan(loss, state, x, memory_budget=0.5, measure=False, policies=("nothing", "dots"))
    fast_by_hand = plan(hand_loss, hand_state, x, memory_budget=0.5, measure=False, policies=("nothing", "dots"))
    assert fast.chosen.policies == fast_by_hand.chosen.policies
    assert fast.chosen.temp_bytes == fast_by_hand.chosen.temp_bytes <= fast.limit_bytes


# --- the PyTorch twins -----------------------------------------------------------------

@pytest.mark.slow
def test_torch_twin_checkpointed_the_same_way_gives_the_same_gradients():
    pytest.importorskip("torch")
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from remat.crosscheck import compare_gradients, load_torch_state
    from remat.models import mlp
    from remat.models._twin import apply_checkpointing_pair

    config = mlp.MLPConfig(depth=3, remat=remat.models.RematSettings.none())
    jax_model, torch_model, (x,) = mlp.build(config)
    before, plain_twin = _state_shapes(jax_model), copy.deepcopy(torch_model)
    paths = apply_checkpointing_pair(jax_model, torch_model, mlp.Block, every=2)
    assert paths == [("blocks", 0), ("blocks", 2)]
    assert [isinstance(b, CheckpointWrapper) for b in torch_model.blocks] == [True, False, True]
    assert _state_shapes(jax_model) == before
    load_torch_state(jax_model, plain_twin)  # the NNX model's paths are those it had
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the wrapped twin's owners (nn.Linear) are found: no layout guess
        load_torch_state(jax_model, torch_model)
    # torch's wrapper puts _checkpoint_wrapped_module. into parameter names; the bridge reads through it
    report = compare_gradients(jax_model, torch_model, (x,), dtype="float64")
    assert report.ok, report
    assert _regions(jax_model, jnp.asarray(x)) == 2


@pytest.mark.slow
def test_torch_twin_lacking_a_path_is_refused_before_any_change():
    pytest.importorskip("torch")
    from remat.models import mlp
    from remat.models._twin import apply_checkpointing_pair

    jax_model, torch_model, _ = mlp.build(mlp.MLPConfig(depth=2, remat=remat.models.RematSettings.none()))
    with pytest.raises(ValueError, match="no submodule"):
        apply_checkpointing_pair(jax_model, torch_model, lambda path, m: path == ())
    assert remat.checkpointed(jax_model) == []


# --- command line ----------------------------------------------------------------------

@pytest.mark.slow
def test_cli_checkpoint_flags(capsys):
    import json

    from remat.cli import main

    assert main(["profile", "mlp", "--depth", "4", "--checkpoint", "Block", "--every", "2",
                 "--policies", "no_checkpoint,nothing", "--steps", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["regions"] == 2 and out["checkpoint"] == ["Block"]
    temp = {r["policy"]: r["temp_bytes"] for r in out["results"]}
    assert set(temp) == {"no_checkpoint", "nothing"} and temp["nothing"] < temp["no_checkpoint"]
    assert main(["train", "mlp", "--steps", "2", "--checkpoint", "Block", "--checkpoint-every", "2",
                 "--policy", "dots", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "dots on 1 Block (apply_checkpointing)" and len(out["losses"]) == 2
    assert main(["train", "mlp", "--steps", "1", "--checkpoint", "Blok"]) == 2
    assert "Blok: mlp has no module of that class; its classes are Block, Linear, MLP" in capsys.readouterr().err
    assert main(["plan", "mlp", "--budget", "0.9", "--depth", "4", "--checkpoint", "Block", "--repeat", "1",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [m["path"] for m in out["modules"]] == [f"blocks.{i}" for i in range(4)]
    assert [m["policy"] for m in out["modules"]] == [str(p) for p in out["chosen"]["policies"]]


@pytest.mark.slow
def test_cli_crosscheck_checkpoints_both_twins_from_outside(capsys):
    import json

    pytest.importorskip("torch")
    from remat.cli import main

    assert main(["crosscheck", "transformer", "--checkpoint", "Block", "--every", "2", "--dtype", "float64",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["remat"].startswith("apply_checkpointing on 1 Block")
    assert out["gradients"]["rtol"] == 1e-10


def test_train_every_alone_is_still_the_save_interval(capsys, tmp_path):
    from remat.cli import main

    args = ["train", "mlp", "--steps", "2", "--depth", "2", "--width", "8", "--batch-size", "4", "--json"]
    assert main([*args, "--every", "1", "--save-dir", str(tmp_path / "run")]) == 0
    assert "--every 1 without --checkpoint is read as the save interval" in capsys.readouterr().err
    assert main([*args, "--every", "1", "--save-every", "1", "--save-dir", str(tmp_path / "b")]) == 2
    assert "the save interval is --save-every K" in capsys.readouterr().err


def test_cli_checkpoint_every_needs_checkpoint(capsys):
    from remat.cli import main

    assert main(["plan", "mlp", "--budget", "0.5", "--every", "2"]) == 2
    assert "needs --checkpoint CLASSNAME" in capsys.readouterr().err
    assert main(["train", "mlp", "--checkpoint", "Block", "--checkpoint-every", "0"]) == 2
    assert "--checkpoint-every must be at least 1" in capsys.readouterr().err
