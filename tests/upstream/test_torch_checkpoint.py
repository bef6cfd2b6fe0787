"""PyTorch's own activation-checkpoint tests, translated to JAX and run against remat.

Sources (pytorch/pytorch as stored in the search index):

* ``test/test_utils.py``, class ``TestCheckpoint``: every test;
* ``test/test_autograd.py``: every test that calls ``torch.utils.checkpoint`` -- in
  ``TestAutograd`` (``test_checkpoint*``, ``test_checkpointing*``,
  ``test_save_on_cpu_and_checkpoint``, ``test_custom_autograd_ac_early_stop``,
  ``test_forward_traceback_preserves_exception_with_checkpoint``),
  ``TestAutogradDeviceType.test_cross_device_reentrant_autograd``, and the classes
  ``TestNestedCheckpoint`` and ``TestSelectiveActivationCheckpoint`` (the selective
  activation checkpoint tests live there).

Translation conventions:

* ``x.requires_grad_()`` + ``.backward()`` / ``torch.autograd.grad`` become ``jax.grad``,
  ``jax.vjp`` or ``nnx.grad`` with ``argnums`` naming exactly the inputs that required grad.
* ``torch.nn.Sequential`` of ``Linear``/``ReLU`` becomes an ``nnx.Sequential`` of
  ``nnx.Linear`` and ``nnx.relu`` (or the list of its layers).
* Counting forward calls: PyTorch re-runs the Python forward to recompute. JAX traces a
  checkpointed function once and the backward pass replays the traced program, so the
  Python-level count is 1 for the forward pass and 0 for the backward pass. Where torch
  counts calls, these tests assert that (``_python_calls``) and then check the
  recomputation itself in the jaxpr of ``jax.grad``: the primitives
  that appear in the checkpointed gradient but not in the plain one are exactly what
  the backward pass recomputes (``_recomputed``), and the regions the backward pass runs
  rematerialized are the ``remat`` equations with ``differentiated=True``.
* Memory: ``remat.analysis.saved_residuals`` lists what the backward pass keeps.
* Where torch's contract and remat's documented one differ on purpose (docs/pytorch.md table
  "PyTorch <-> remat"), the test asserts remat's and says so.
"""
from __future__ import annotations

import collections
import copy
import functools
import random
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import remat
from remat.analysis import saved_residuals
from remat.policies import CheckpointPolicy, selective

try:  # PyTorch is an optional extra: it only adds cross-checks and op objects
    import torch
except ImportError:  # pragma: no cover - torch is installed in the test extras
    torch = None

REPO = Path(__file__).resolve().parents[2]
_REMAT_PRIMS = ("checkpoint", "remat", "remat2")
_HAS_GPU = any(d.platform == "gpu" for d in jax.devices())


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


# Inputs and weights are drawn with NumPy: jax.random would compile one XLA program per
# shape, which on 2 cores costs more than the tests themselves. They are cast by NumPy and put on
# the device as they are (jnp.asarray compiles its staging and its cast per shape and dtype).


def _randn(i, *shape, dtype=jnp.float32):
    """``torch.randn(*shape)``"""
    return jax.device_put(np.random.default_rng(i).standard_normal(shape).astype(dtype))


def _rand(i, *shape, dtype=jnp.float32):
    """``torch.rand(*shape)``"""
    return jax.device_put(np.random.default_rng(i).uniform(size=shape).astype(dtype))


def _np_rng(seed=0):
    return np.random.default_rng(seed)


def _linear(in_features, out_features, rng, use_bias=True):
    """``nn.Linear(in_features, out_features, bias=use_bias)`` as an ``nnx.Linear``, with
    torch's default initialization U(-1/sqrt(in), 1/sqrt(in)) drawn from ``rng``."""
    bound = 1.0 / np.sqrt(in_features)
    kernel = rng.uniform(-bound, bound, (in_features, out_features)).astype(np.float32)
    bias = rng.uniform(-bound, bound, (out_features,)).astype(np.float32)
    return nnx.Linear(
        in_features, out_features, use_bias=use_bias, rngs=nnx.Rngs(0),
        kernel_init=lambda *_: jax.device_put(kernel), bias_init=lambda *_: jax.device_put(bias),
    )


def _close(a, b, rtol=1e-6, atol=1e-6):
    """``self.assertEqual`` on pytrees of arrays (torch's float32 default tolerances)."""
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb, f"tree structures differ: {ta} vs {tb}"
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def _sub_jaxprs(eqn):
    for v in eqn.params.values():
        for s in v if isinstance(v, (list, tuple)) else (v,):
            if hasattr(s, "eqns"):
                yield s
            elif hasattr(s, "jaxpr") and hasattr(s.jaxpr, "eqns"):
                yield s.jaxpr


def _prims(jaxpr, counter=None) -> collections.Counter:
    """Every primitive in ``jaxpr`` and its sub-jaxprs, with multiplicity."""
    counter = collections.Counter() if counter is None else counter
    for eqn in jaxpr.eqns:
        counter[eqn.primitive.name] += 1
        for sub in _sub_jaxprs(eqn):
            _prims(sub, counter)
    return counter


def _remat_regions(jaxpr, differentiated=True) -> list:
    """The inner jaxprs of the remat equations (with ``differentiated`` as given)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _REMAT_PRIMS and bool(eqn.params.get("differentiated")) == differentiated:
            found.append(eqn.params["jaxpr"])
        for sub in _sub_jaxprs(eqn):
            found.extend(_remat_regions(sub, differentiated))
    return found


def _grad_prims(loss, *args, argnums=0) -> collections.Counter:
    return _prims(jax.make_jaxpr(jax.grad(loss, argnums=argnums))(*args).jaxpr)


def _recomputed(loss_ckpt, loss_plain, *args, argnums=0) -> collections.Counter:
    """Primitives the checkpointed gradient runs beyond the plain gradient: the recomputation."""
    extra = _grad_prims(loss_ckpt, *args, argnums=argnums) - _grad_prims(loss_plain, *args, argnums=argnums)
    for name in _REMAT_PRIMS:
        extra.pop(name, None)
    return extra


def _python_calls(loss, counter, *args):
    """(forward, backward) Python-level calls of the function ``counter`` counts.

    torch's counters see forward + recomputation. In JAX the forward pass traces the
    function (remat may serve a repeated call from its trace cache: at most once), and
    the backward pass must not call it again: it replays the traced program.
    """
    counter[0] = 0
    out, vjp = jax.vjp(loss, *args)
    forward = counter[0]
    vjp(jnp.ones_like(out))
    return forward, counter[0] - forward


def _mlp(seed=0):
    """``nn.Sequential(Linear(100, 50), ReLU(), Linear(50, 20), ReLU(), Linear(20, 5), ReLU())``."""
    rngs = _np_rng(seed)
    return nnx.Sequential(
        _linear(100, 50, rngs), nnx.relu,
        _linear(50, 20, rngs), nnx.relu,
        _linear(20, 5, rngs), nnx.relu,
    )


def _torch_twin(layers):
    """The PyTorch module with the same weights as a list of nnx.Linear / nnx.relu layers."""
    mods = []
    for layer in layers:
        if isinstance(layer, nnx.Linear):
            lin = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(np.asarray(layer.kernel[...]).T.copy()))
                if layer.bias is not None:
                    lin.bias.copy_(torch.from_numpy(np.asarray(layer.bias[...]).copy()))
            mods.append(lin)
        else:
            mods.append(torch.nn.ReLU())
    return torch.nn.Sequential(*mods)


# --------------------------------------------------------------------------------------
# test/test_utils.py  TestCheckpoint
# --------------------------------------------------------------------------------------


def _check_checkpoint_sequential(model, module_lists_to_compare, num_chunks, input, use_reentrant):
    """``TestCheckpoint._check_checkpoint_sequential``: outputs, input grads and parameter
    grads of ``checkpoint_sequential`` equal those of the un-checkpointed model.

    ``module_lists_to_compare`` holds selectors ``model -> functions`` (the list of
    children, the container itself): under ``nnx.grad`` the model inside the loss is the
    one being differentiated, so the list must be taken from it, not from the outer one.
    """

    def plain(m, x):
        out = m(x)
        return out.sum(), out

    (g_model, g_input), out_not_checkpointed = nnx.grad(plain, argnums=(0, 1), has_aux=True)(model, input)
    for select in module_lists_to_compare:

        def checkpointed(m, x, select=select):
            out = remat.checkpoint_sequential(select(m), num_chunks, x, use_reentrant=use_reentrant)
            return out.sum(), out

        grad_fn = nnx.grad(checkpointed, argnums=(0, 1), has_aux=True)
        (c_model, c_input), out_checkpointed = grad_fn(model, input)
        _close(out_checkpointed, out_not_checkpointed)
        _close(c_input, g_input)
        _close(nnx.state(c_model, nnx.Param), nnx.state(g_model, nnx.Param))
    return out_not_checkpointed, g_model, g_input


# remat.checkpoint and checkpoint_sequential accept use_reentrant= and early_stop= and run the
# same code either way (docs/pytorch.md): of upstream's two cases, use_reentrant=False (what
# PyTorch asks its users to pass) and early_stop=True (PyTorch's default) stay fast; the other
# is slow (CI runs it)
USE_REENTRANT = [pytest.param(True, marks=pytest.mark.slow), False]
EARLY_STOP = [True, pytest.param(False, marks=pytest.mark.slow)]

class TestCheckpoint:
    # torch test/test_utils.py TestCheckpoint.test_checkpoint_trigger
    @pytest.mark.parametrize("use_reentrant", USE_REENTRANT)
    def test_checkpoint_trigger(self, use_reentrant):
        class Net:
            def __init__(self) -> None:
                self.counter = 0

            def __call__(self, input_var):
                self.counter += 1
                return input_var * jnp.asarray(2.0)

        modules = [Net() for _ in range(10)]
        for m in modules:
            assert m.counter == 0
        input_var = _randn(0, 3, 4)

        def loss(x):
            return remat.checkpoint_sequential(modules, 2, x, use_reentrant=use_reentrant).sum()

        out, vjp = jax.vjp(loss, input_var)  # forward
        for m in modules:
            assert m.counter == 1
        vjp(jnp.ones_like(out))  # backward
        # torch: modules[:5] count 2 here (recomputed by calling Python again), modules[5:]
        # stay at 1. JAX replays the traced program instead, so every count stays 1 ...
        for m in modules:
            assert m.counter == 1
        # ... and the equivalent structural fact is in the gradient's jaxpr: the backward
        # pass of modules[:5] runs as one rematerialized region holding their five ops,
        # modules[5:] as plain operations (use_reentrant=True rematerializes too: docs/pytorch.md).
        regions = _remat_regions(jax.make_jaxpr(jax.grad(loss))(input_var).jaxpr)
        assert len(regions) == 1
        assert _prims(regions[0])["mul"] == 5

    # torch test/test_utils.py TestCheckpoint.test_checkpoint_valid
    # slow (second order, op by op: seconds); tests/test_checkpoint.py differentiates twice in the fast suite
    @pytest.mark.slow
    @pytest.mark.parametrize("use_reentrant", USE_REENTRANT)
    def test_checkpoint_valid(self, use_reentrant):
        model = _mlp()
        input_var = _randn(1, 1, 100)
        chunks = 2
        modules = list(model.layers)
        # torch.autograd.grad(outputs=[out], grad_outputs=[ones(1, 5)], inputs=[input_var],
        # create_graph=True) is jax.vjp with respect to the input, the model held fixed.
        # torch raises "torch.utils.checkpoint is incompatible" for use_reentrant=True
        # here; remat documents that True and False both give exact gradients (docs/pytorch.md
        # table), so both values must work and agree with the un-checkpointed model.

        def plain(x):
            return model(x)

        def checkpointed(x):
            return remat.checkpoint_sequential(modules, chunks, x, use_reentrant=use_reentrant)

        def out_and_grads(f, x):
            out, vjp = jax.vjp(f, x)
            grads = vjp(jnp.ones((1, 5)))
            # create_graph=True: the gradient itself is differentiable
            second = jax.grad(lambda x: jax.vjp(f, x)[1](jnp.ones((1, 5)))[0].sum())(x)
            return out, grads, second

        out, grads_no_checkpoint, second_no_checkpoint = out_and_grads(plain, input_var)
        out_checkpoint, grads_checkpoint, second_checkpoint = out_and_grads(checkpointed, input_var)
        _close(out_checkpoint, out)
        _close(grads_checkpoint, grads_no_checkpoint)
        _close(second_checkpoint, second_no_checkpoint)

    # torch test/test_utils.py TestCheckpoint.test_checkpoint
    @pytest.mark.parametrize("use_reentrant", USE_REENTRANT)
    def test_checkpoint(self, use_reentrant):
        model = _mlp()
        # In addition to running checkpoint_sequential on the nn.Sequential instance, we
        # also run the function on the list of functions within the module.
        x = _randn(2, 1, 100)
        out, g_model, g_input = _check_checkpoint_sequential(
            model, [lambda m: list(m.layers), lambda m: m], 2, x, use_reentrant=use_reentrant
        )
        if torch is None:
            return
        # extra: the same gradients from PyTorch itself, on the same weights
        t_model = _torch_twin(model.layers)
        t_x = torch.from_numpy(np.asarray(x).copy()).requires_grad_()
        t_out = torch.utils.checkpoint.checkpoint_sequential(
            list(t_model.children()), 2, t_x, use_reentrant=use_reentrant
        )
        t_out.sum().backward()
        _close(out, t_out.detach().numpy(), rtol=1e-5, atol=1e-6)
        _close(g_input, t_x.grad.numpy(), rtol=1e-5, atol=1e-6)
        for i in (0, 2, 4):
            _close(g_model.layers[i].kernel[...], t_model[i].weight.grad.numpy().T, rtol=1e-5, atol=1e-6)
            _close(g_model.layers[i].bias[...], t_model[i].bias.grad.numpy(), rtol=1e-5, atol=1e-6)

    # torch test/test_utils.py TestCheckpoint.test_checkpoint_module_list
    @pytest.mark.parametrize("use_reentrant", USE_REENTRANT)
    def test_checkpoint_module_list(self, use_reentrant):
        class ModuleListNet(nnx.Module):
            def __init__(self, rngs) -> None:
                self.module_list = nnx.List([
                    _linear(100, 50, rngs), nnx.relu,
                    _linear(50, 20, rngs), nnx.relu,
                    _linear(20, 5, rngs), nnx.relu,
                ])

            def __call__(self, input):
                for layer in self.module_list:
                    input = layer(input)
                return input

        model = ModuleListNet(_np_rng(0))
        # Compare uncheckpointed model with its checkpointed counterparts.
        _check_checkpoint_sequential(
            model,
            [lambda m: list(m.module_list), lambda m: m.module_list],
            2,
            _randn(3, 1, 100),
            use_reentrant=use_reentrant,
        )

    # torch test/test_utils.py TestCheckpoint.test_checkpoint_sequential_deprecated_multiple_args
    @pytest.mark.parametrize("use_reentrant", USE_REENTRANT)
    def test_checkpoint_sequential_deprecated_multiple_args(self, use_reentrant):
        class Two(nnx.Module):
            def __call__(self, a, b):
                return a, b

        model = nnx.Sequential(Two())
        a = _randn(0, 1, 100)
        b = _randn(1, 1, 100)
        with pytest.raises(TypeError):
            remat.checkpoint_sequential(model, 1, a, b)  # type: ignore[arg-type]

    # torch test/test_utils.py TestCheckpoint.test_checkpoint_sequential_deprecated_no_args
    @pytest.mark.parametrize("use_reentrant", USE_REENTRANT)
    def test_checkpoint_sequential_deprecated_no_args(self, use_reentrant):
        class Noop(nnx.Module):
            def __call__(self):
                pass

        model = nnx.Sequential(Noop())
        with pytest.raises(TypeError):
            remat.checkpoint_sequential(model, 1)  # type: ignore[call-arg]

    @staticmethod
    def _dropout_grads(inp, seed, use_checkpoint, **ckpt_kwargs):
        """phase1 = Dropout(); phase2 = Dropout(); out = checkpoint(phase2, phase1(inp)).

        ``torch.get_rng_state()`` / ``torch.set_rng_state(state)`` become the same seed
        for the ``nnx.Rngs`` stream both Dropouts draw from.
        """

        def loss(inp):
            rngs = nnx.Rngs(dropout=seed)
            phase1 = nnx.Dropout(0.5, rngs=rngs)
            phase2 = nnx.Dropout(0.5, rngs=rngs)

            def run_fn(input):
                return phase2(input)

            out = phase1(inp)
            out = remat.checkpoint(run_fn, out, **ckpt_kwargs) if use_checkpoint else run_fn(out)
            return out.sum()

        return jax.grad(loss)(inp)

    # torch test/test_utils.py TestCheckpoint.test_checkpoint_rng_cpu
    # slow (five dropout sizes, op by op); test_checkpoint_not_preserve_rng_state_and_without_reentrant
    # and tests/test_checkpoint.py check the recomputed randomness in the fast suite
    @pytest.mark.slow
    def test_checkpoint_rng_cpu(self):
        for i in range(5):
            inp = _randn(i, 20000)
            grad_with_checkpointing = self._dropout_grads(inp, i, True, use_reentrant=True)
            grad_no_checkpointing = self._dropout_grads(inp, i, False)
            # the masks are real (some zeroed, some scaled by 1/(1-p)^2), and identical
            assert 0 < int((grad_no_checkpointing == 0).sum()) < inp.size
            _close(grad_with_checkpointing, grad_no_checkpointing, rtol=0, atol=0)

    # torch test/test_utils.py TestCheckpoint.test_checkpoint_rng_gpu
    @pytest.mark.skipif(
        not _HAS_GPU,
        reason=(
            "torch-only here: needs an accelerator (JAX GPU backend); the CPU variant is "
            "test_checkpoint_rng_cpu"
        ),
    )
    def test_checkpoint_rng_gpu(self):  # pragma: no cover - no GPU in CI
        gpu = next(d for d in jax.devices() if d.platform == "gpu")
        with jax.default_device(gpu):
            for i in range(5):
                inp = _randn(i, 20000)
                grad_with_checkpointing = self._dropout_grads(inp, i, True, use_reentrant=True)
                _close(grad_with_checkpointing, self._dropout_grads(inp, i, False), rtol=0, atol=0)

    # torch test/test_utils.py TestCheckpoint.test_checkpoint_not_preserve_rng_state_and_without_reentrant
    def test_checkpoint_not_preserve_rng_state_and_without_reentrant(self):
        # torch runs this on an accelerator only; JAX has one RNG semantics on every
        # device, so it runs here. "This should run without error" -- and remat documents
        # that preserve_rng_state=False cannot change results (docs/pytorch.md table), so the
        # gradient equals the preserve_rng_state=True one and the un-checkpointed one.
        inp = _randn(0, 2)
        g_false = self._dropout_grads(inp, 7, True, use_reentrant=False, preserve_rng_state=False)
        g_true = self._dropout_grads(inp, 7, True, use_reentrant=False, preserve_rng_state=True)
        g_plain = self._dropout_grads(inp, 7, False)
        _close(g_false, g_true, rtol=0, atol=0)
        _close(g_false, g_plain, rtol=0, atol=0)

    # torch test/test_utils.py TestCheckpoint.test_checkpoint_non_tensor
    def test_checkpoint_non_tensor(self):
        def run_fn(tensor1, tensor2):
            if tensor2 is None:
                return tensor1
            return tensor1 + tensor2

        input_var = _randn(0, 1, 100)
        g = jax.grad(lambda x: remat.checkpoint(run_fn, x, None, use_reentrant=True).sum())(input_var)
        _close(g, jnp.ones_like(input_var))

    # torch test/test_utils.py TestCheckpoint.test_checkpoint_non_tensor_inputs_outputs
    def test_checkpoint_non_tensor_inputs_outputs(self):
        def foo(t1, t2, scale, t3):
            t4 = t1 + t2 * t3
            t5 = t1 * t2 + t3
            t4 = t4 * scale  # t4 *= scale
            t5 = t5 * scale
            return scale, t4, None, True, t5, "bar", t1

        t1 = _rand(1, 10)
        t2 = _rand(2, 10)
        t3 = _rand(3, 10)  # requires_grad=False: not differentiated
        scale = random.Random(0).randint(0, 10)
        res = remat.checkpoint(foo, t1, t2, scale, t3, use_reentrant=True)
        assert scale == res[0]
        _close((t1 + t2 * t3) * scale, res[1])
        assert res[2] is None
        assert res[3] is True
        _close((t1 * t2 + t3) * scale, res[4])
        assert res[5] == "bar"
        _close(t1, res[6])

        # Validate running backward: res[1], res[4], res[6] each backpropagated. (torch
        # also checks "Trying to backward through the graph a second time": a torch-only
        # graph-lifetime rule; a JAX pullback is a pure function.)
        def loss(fn, t1, t2):
            r = fn(t1, t2, scale, t3)
            return r[1].sum() + r[4].sum() + r[6].sum()

        ckpt = functools.partial(remat.checkpoint, foo, use_reentrant=True)
        t_grads = jax.grad(functools.partial(loss, ckpt), argnums=(0, 1))(t1, t2)
        # Run without checkpoint and validate we receive same grads.
        ref = jax.grad(functools.partial(loss, foo), argnums=(0, 1))(t1, t2)
        _close(t_grads, ref)

    # torch test/test_utils.py TestCheckpoint.test_checkpoint_no_tensors
    def test_checkpoint_no_tensors(self):
        def foo(t1, t2, scale, t3):
            t4 = t1 + t2 * t3
            t5 = t1 * t2 + t3
            t4 *= scale
            t5 *= scale
            return scale, t4, None, True, t5, "bar", t1

        rng = random.Random(0)
        t1, t2, t3 = rng.random(), rng.random(), rng.random()
        scale = rng.randint(0, 10)
        res = remat.checkpoint(foo, t1, t2, scale, t3, use_reentrant=True)
        assert scale == res[0]
        assert (t1 + t2 * t3) * scale == pytest.approx(float(res[1]))
        assert res[2] is None
        assert res[3] is True
        assert (t1 * t2 + t3) * scale == pytest.approx(float(res[4]))
        assert res[5] == "bar"
        assert t1 == pytest.approx(float(res[6]))

    # torch test/test_utils.py TestCheckpoint.test_checkpoint_partial_grad
    def test_checkpoint_partial_grad(self):
        def run_fn(tensor1, tensor2):
            # tensor 2 is used for other application logic
            return tensor1, tensor2

        input_var = _randn(0, 1, 4)
        input_var2 = _randn(1, 1, 4)  # requires_grad=False
        g = jax.grad(lambda a: remat.checkpoint(run_fn, a, input_var2, use_reentrant=True)[0].sum())(input_var)
        _close(g, jnp.ones_like(input_var))

        def run_fn2(tensor1, tensor2):
            return tensor1

        input_var = _randn(2, 1, 4)  # requires_grad=False
        input_var2 = _randn(3, 1, 4)  # requires_grad=True
        # torch's reentrant variant raises "none of output has requires_grad=True, this
        # checkpoint() is not necessary". remat documents that use_reentrant=True is the
        # same exact mechanism as False (docs/pytorch.md table), so the gradient with respect to
        # the unused input is simply zero.
        g2 = jax.grad(lambda b: remat.checkpoint(run_fn2, input_var, b, use_reentrant=True).sum())(input_var2)
        _close(g2, jnp.zeros_like(input_var2))

    # torch test/test_utils.py TestCheckpoint.test_checkpointing_without_reentrant_early_free
    @pytest.mark.skip(
        reason=(
            "torch-only: tensor hooks reading accelerator memory stats at each backward step "
            "(eager buffer freeing of the autograd graph)"
        ),
    )
    def test_checkpointing_without_reentrant_early_free(self):
        pass

    # torch test/test_utils.py TestCheckpoint.test_get_device_states_recursive
    @pytest.mark.skip(reason="torch-only: per-device CUDA RNG states (get_device_states) across two GPUs")
    def test_get_device_states_recursive(self):
        pass

    # torch test/test_utils.py TestCheckpoint.test_infer_device_state_recursive_meta
    @pytest.mark.skip(reason="torch-only: the meta device and torch.utils.checkpoint._infer_device_type")
    def test_infer_device_state_recursive_meta(self):
        pass

    # torch test/test_utils.py TestCheckpoint.test_infer_device_state_recursive_multi_gpu
    @pytest.mark.skip(reason="torch-only: _infer_device_type warnings over tensors on several CUDA/meta devices")
    def test_infer_device_state_recursive_multi_gpu(self):
        pass

    # torch test/test_utils.py TestCheckpoint.test_checkpoint_preserves_device_context
    @pytest.mark.skip(
        reason=(
            "torch-only: the torch.device() default-device context re-entered during "
            "recomputation on an accelerator; JAX replays the traced program, whose placement"
            " is fixed at trace time"
        ),
    )
    def test_checkpoint_preserves_device_context(self):
        pass


# --------------------------------------------------------------------------------------
# test/test_autograd.py  TestAutograd (the checkpoint cases)
# --------------------------------------------------------------------------------------


def _stack_mean(feats):
    """``torch.stack(feats).mean()``, summed piecewise: one stack of 2000 operands (and its
    transpose) costs XLA about a minute to compile on 2 cores."""
    total = feats[0].sum()
    for f in feats[1:]:
        total = total + f.sum()
    return total / (len(feats) * feats[0].size)


def _proxy_net(rngs):
    """small proxy network for some complex reasoning we want to do per input"""
    nz_inp, nz_bottleneck = 10, 1000
    return nnx.Sequential(
        _linear(nz_inp, nz_bottleneck, rngs), nnx.relu, _linear(nz_bottleneck, nz_inp, rngs)
    )


class TestAutograd:
    # torch test/test_autograd.py TestAutograd.test_custom_autograd_ac_early_stop
    @pytest.mark.skip(
        reason=(
            "torch-only: weak references to tensors a custom autograd.Function saved, freed "
            "after backward under gc"
        ),
    )
    def test_custom_autograd_ac_early_stop(self):
        pass

    # torch test/test_autograd.py TestAutograd.test_checkpoint_compile_no_recompile
    def test_checkpoint_compile_no_recompile(self):
        # torch: a torch.compile'd function inside checkpoint does not recompile when
        # backward runs (CUDA-gated there only for its default-device half, which is
        # torch-only and left out: JAX keys its caches on the default device). JAX
        # equivalent: a jitted function inside remat.checkpoint is traced once across
        # repeated gradient evaluations.
        traces = [0]

        @jax.jit
        def fn(x):
            traces[0] += 1
            return jnp.cos(jnp.sin(x))

        x = _rand(0, 10, 10)
        grad = jax.grad(lambda x: remat.checkpoint(fn, x, use_reentrant=False).sum())
        g1 = grad(x)
        g2 = grad(x)
        assert traces[0] == 1
        _close(g1, g2)
        _close(g1, jax.grad(lambda x: fn(x).sum())(x))

    # torch test/test_autograd.py TestAutograd.test_checkpoint_device_context_fn
    @pytest.mark.skip(reason="torch-only: a context_fn entering a CUDA default-device context for the recomputation")
    def test_checkpoint_device_context_fn(self):
        pass

    # torch test/test_autograd.py TestAutograd.test_forward_traceback_preserves_exception_with_checkpoint
    @pytest.mark.skip(
        reason=(
            "torch-only: CUDA memory-history recording and the C++ forward traceback of a "
            "custom library op"
        ),
    )
    def test_forward_traceback_preserves_exception_with_checkpoint(self):
        pass

    # torch test/test_autograd.py TestAutograd.test_checkpointing
    @pytest.mark.slow
    def test_checkpointing(self):
        num_inp = 2000
        module = _proxy_net(_np_rng(0))
        rng = _np_rng(1)
        # data_r = torch.empty(1, nz_inp).uniform_(); data_r.requires_grad = True
        rows = rng.uniform(size=(num_inp, 1, 10)).astype(np.float32)
        data = [jnp.asarray(r) for r in rows]

        def loss(module, data):
            feat_combined = [remat.checkpoint(module, data_r, use_reentrant=True) for data_r in data]
            # compute mean as a proxy for some joint reasoning
            return _stack_mean(feat_combined)

        g = nnx.grad(loss, argnums=(0, 1))(module, data)  # mean_combined.backward()
        # extra (torch only runs backward): the gradients equal those of the same network
        # applied to all inputs at once, without checkpoint
        ref = nnx.grad(lambda m, d: m(d).mean(), argnums=(0, 1))(module, jnp.asarray(rows))
        _close(nnx.state(g[0], nnx.Param), nnx.state(ref[0], nnx.Param), rtol=1e-4, atol=1e-7)
        _close(np.stack(g[1]), ref[1], rtol=1e-4, atol=1e-9)

    # torch test/test_autograd.py TestAutograd.test_checkpointing_non_reentrant_autocast_cpu
    @pytest.mark.parametrize("enabled", [True, False])
    def test_checkpointing_non_reentrant_autocast_cpu(self, enabled):
        # JAX has no autocast: the precision is part of the traced program. The autocast
        # of torch.mm to bfloat16 is written into foo; the test's point -- the
        # recomputation runs in the same precision as the forward pass -- is checked on
        # the recomputed matmuls in the gradient's jaxpr.
        expected_dtype = jnp.bfloat16 if enabled else jnp.float32

        def foo(x, y, z):
            if enabled:  # torch.mm is on autocast's list of ops that run in bfloat16
                x, y, z = (t.astype(jnp.bfloat16) for t in (x, y, z))
            x = x @ y
            y = x @ z
            z = z @ z
            assert z.dtype == expected_dtype
            return z

        x, y, z = _randn(0, 3, 3), _randn(1, 3, 3), _randn(2, 3, 3)

        def loss(x, y, z):
            return remat.checkpoint(foo, x, y, z, use_reentrant=False).sum()

        grads = jax.grad(loss, argnums=(0, 1, 2))(x, y, z)  # triggers recomputation
        ref = jax.grad(lambda x, y, z: foo(x, y, z).sum(), argnums=(0, 1, 2))(x, y, z)
        _close(grads, ref)
        regions = _remat_regions(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, y, z).jaxpr)
        dots = [e for r in regions for e in r.eqns if e.primitive.name == "dot_general"]
        assert dots, "the backward pass recomputes the matmuls"
        assert all(e.outvars[0].aval.dtype == expected_dtype for e in dots)

    # torch test/test_autograd.py TestAutograd.test_checkpointing_non_reentrant_autocast_gpu
    @pytest.mark.skip(
        reason=(
            "torch-only: CUDA autocast with bf16 support; the JAX translation (precision is "
            "part of the traced program, on any device) is "
            "test_checkpointing_non_reentrant_autocast_cpu"
        ),
    )
    def test_checkpointing_non_reentrant_autocast_gpu(self):
        pass

    # torch test/test_autograd.py TestAutograd.test_checkpointing_without_reentrant_memory_savings
    def test_checkpointing_without_reentrant_memory_savings(self):
        # torch measures torch.cuda.max_memory_allocated (and pre-allocates .grad so the
        # difference is activations only). The JAX equivalent of "activation memory" is
        # what the backward pass keeps beyond the inputs: saved_residuals().residual_bytes.
        class MyModel(nnx.Module):
            def __init__(self, n, use_checkpoint, use_reentrant, rngs):
                self.n = n
                self.use_checkpoint = use_checkpoint
                self.use_reentrant = use_reentrant
                self.layers = nnx.List([
                    nnx.Sequential(
                        _linear(256, 256, rngs), _linear(256, 256, rngs), _linear(256, 256, rngs)
                    )
                    for _ in range(n)
                ])

            def __call__(self, x):
                for i in range(self.n):
                    if not self.use_checkpoint:
                        x = self.layers[i](x)
                    else:
                        x = remat.checkpoint(self.layers[i], x, use_reentrant=self.use_reentrant)
                return x

        x = _randn(0, 100, 256)

        def activation_bytes(use_checkpoint, use_reentrant):
            model = MyModel(8, use_checkpoint, use_reentrant, _np_rng(0))
            graphdef, state = nnx.split(model)

            def loss(state, x):
                return nnx.merge(graphdef, state)(x).sum()

            return saved_residuals(loss, state, x).residual_bytes

        mem_no_checkpoint = activation_bytes(False, False)
        mem_reentrant_checkpoint = activation_bytes(True, True)
        mem_no_reentrant_checkpoint = activation_bytes(True, False)
        assert mem_reentrant_checkpoint < mem_no_checkpoint
        assert mem_no_reentrant_checkpoint < mem_no_checkpoint
        # remat: both use_reentrant values rematerialize the same way (docs/pytorch.md table)
        assert mem_reentrant_checkpoint == mem_no_reentrant_checkpoint

    # torch test/test_autograd.py TestAutograd.test_checkpointing_without_reentrant_custom_function_works
    def test_checkpointing_without_reentrant_custom_function_works(self):
        # torch.autograd.Function -> jax.custom_vjp. torch's backward also checks that
        # reading ctx.saved_tensors twice raises ("Unpack is being triggered for a tensor
        # that was already unpacked once"): a torch-only rule of its saved-tensor hooks.
        @jax.custom_vjp
        def my_func(x, y, z):
            w = x * y * z
            return w + w

        def my_func_fwd(x, y, z):
            w = x * y * z
            out = w + w
            return out, (x, y, z, w, out)

        def my_func_bwd(saved, grad_out):
            x, y, z, w, out = saved
            return x, y, z

        my_func.defvjp(my_func_fwd, my_func_bwd)

        x, y, z = jnp.float32(1.0), jnp.float32(2.0), jnp.float32(3.0)

        def foo(x, y, z):
            x = x * y * z
            y = y * y * z
            z = z * z
            out = my_func(x, y, z)
            return out

        def loss(x, y, z):
            return remat.checkpoint(foo, x, y, z, use_reentrant=False).sum()

        g = jax.grad(loss, argnums=(0, 1, 2))(x, y, z)
        ref = jax.grad(lambda x, y, z: foo(x, y, z).sum(), argnums=(0, 1, 2))(x, y, z)
        _close(g, ref)

    # torch test/test_autograd.py TestAutograd.test_checkpointing_without_reentrant_with_context_fn
    def test_checkpointing_without_reentrant_with_context_fn(self):
        # torch records the dispatched operators through TorchDispatchModes returned by
        # context_fn. remat documents that context_fn itself raises a TypeError that
        # points to policy= (docs/pytorch.md table), for either use_reentrant value (torch raises
        # for use_reentrant=True too: "only supported when use_reentrant=False").
        x = jnp.float32(1.0)

        def context_fn():
            return None, None

        with pytest.raises(TypeError, match="policy="):
            remat.checkpoint(jnp.exp, x, use_reentrant=False, context_fn=context_fn)
        with pytest.raises(TypeError, match="policy="):
            remat.checkpoint(jnp.sin, x, use_reentrant=True, context_fn=context_fn)

    # torch test/test_autograd.py TestAutograd.test_checkpoint_warns_if_use_reentrant_not_passed_explcitly
    def test_checkpoint_warns_if_use_reentrant_not_passed_explcitly(self):
        a = _randn(0, 1)
        # Passing explicitly should not warn
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            remat.checkpoint(lambda x: x, a, use_reentrant=False)
        assert not [m for m in w if "use_reentrant" in str(m.message)]
        # torch warns when use_reentrant is left out, because its default is going to
        # change. remat has one mechanism and documents None as the default (docs/pytorch.md
        # table, checkpoint docstring), so leaving it out has nothing to warn about.
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            remat.checkpoint(lambda x: x, a)
        assert not [m for m in w if "use_reentrant" in str(m.message)]

    # torch test/test_autograd.py TestAutograd.test_checkpoint_sequential_warns_if_use_reentrant_not_passed_explcitly
    def test_checkpoint_sequential_warns_if_use_reentrant_not_passed_explcitly(self):
        a = _randn(0, 3)
        rngs = _np_rng(0)
        modules_list = [_linear(3, 3, rngs), _linear(3, 3, rngs), _linear(3, 3, rngs)]
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            remat.checkpoint_sequential(modules_list, 3, a, use_reentrant=False)
        assert not [m for m in w if "use_reentrant" in str(m.message)]
        # as above: remat's default (None) is documented, not deprecated
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            remat.checkpoint_sequential(modules_list, 3, a)
        assert not [m for m in w if "use_reentrant" in str(m.message)]

    # torch test/test_autograd.py TestAutograd.test_checkpoint_graph_execution_group
    @pytest.mark.skip(
        reason=(
            "torch-only: torch.utils.checkpoint.GraphExecGroup, grouping several partial "
            "torch.autograd.grad calls into one recomputation"
        ),
    )
    def test_checkpoint_graph_execution_group(self):
        pass

    # torch test/test_autograd.py TestAutograd.test_checkpoint_detects_non_determinism
    def test_checkpoint_detects_non_determinism(self, capsys):
        # torch raises when the recomputation saves a different number, shape or dtype of
        # tensors than the forward pass. remat documents (docs/pytorch.md table,
        # determinism_check) that the recomputation replays the very program traced for
        # the forward pass: a Python function that changes between calls cannot make the
        # two differ, so nothing raises, the function is traced once, and the gradient is
        # that of the forward pass actually run.
        def save_3_tensors(x):
            out = jnp.exp(jnp.sin(x))
            out = jnp.sin(out)
            return out

        def save_2_tensors(x):
            return jnp.exp(jnp.sin(x))

        def save_2_tensors_alt(x):
            return jnp.sin(x) * jnp.array([1.0, 2.0])

        def get_non_det_fn(orig_fn, recompute_fn):
            counter = [0]

            def fn(x):
                if counter[0] == 0:
                    counter[0] += 1
                    return orig_fn(x)
                else:
                    return recompute_fn(x)

            return fn, counter

        a = _randn(0, 1)

        def run(orig_fn, recompute_fn, **kwargs):
            fn, counter = get_non_det_fn(orig_fn, recompute_fn)
            out, g = jax.value_and_grad(lambda a: remat.checkpoint(fn, a, use_reentrant=False, **kwargs).sum())(a)
            return out, g, counter

        cases = [
            (save_3_tensors, save_2_tensors, {}),  # saves fewer tensors during recompute
            (save_2_tensors, save_3_tensors, {"early_stop": False}),  # more, no early stop
            (save_2_tensors, save_3_tensors, {}),  # more, early stop
            (save_2_tensors, save_2_tensors_alt, {}),  # same number, different shape
            (save_2_tensors, save_2_tensors_alt, {"determinism_check": "none"}),
        ]
        for orig_fn, recompute_fn, kwargs in cases:
            out, g, counter = run(orig_fn, recompute_fn, **kwargs)
            assert counter[0] == 1
            _close(out, orig_fn(a).sum())
            _close(g, jax.grad(lambda a, orig_fn=orig_fn: orig_fn(a).sum())(a))

        # debug=True: torch turns the error into a detailed one ("You are seeing this
        # error because you passed `debug=True`"). remat's debug=True prints, at trace
        # time, what the backward pass keeps (docs/pytorch.md table); still nothing raises, and
        # the gradient belongs to the forward pass that was run. (set_checkpoint_debug_enabled
        # has no remat counterpart; the per-call flag is the only switch.)
        capsys.readouterr()
        out, g, _ = run(save_2_tensors, save_2_tensors_alt, debug=True)
        assert "remat.checkpoint(debug=True)" in capsys.readouterr().err
        consistent = [
            f for f in (save_2_tensors, save_2_tensors_alt)
            if np.allclose(out, f(a).sum()) and np.allclose(g, jax.grad(lambda a, f=f: f(a).sum())(a))
        ]
        assert consistent, "the gradient is that of the forward pass that produced the output"

    # torch test/test_autograd.py TestAutograd.test_access_saved_tensor_twice_without_recomputation_works
    @pytest.mark.skip(
        reason=(
            "torch-only: reading grad_fn._saved_result outside backward, which recomputes on "
            "each access and frees afterwards"
        ),
    )
    def test_access_saved_tensor_twice_without_recomputation_works(self):
        pass

    # torch test/test_autograd.py TestAutograd.test_checkpointing_without_reentrant
    @pytest.mark.slow
    @pytest.mark.parametrize("input_requires_grad", [True, False])
    def test_checkpointing_without_reentrant(self, input_requires_grad):
        """Basic test for checkpoint without reentrant autograd."""
        num_inp = 2000
        nz_inp = 10

        # Module holder for testing activation checkpointing with no_reentrant supports kwargs.
        class MyModule(nnx.Module):
            def __init__(self, mod):
                self.module = mod

            def __call__(self, data):
                return self.module(data)

        module = MyModule(mod=_proxy_net(_np_rng(0)))
        # Run model with and without checkpointing and verify gradients are equivalent,
        # regardless of if inputs require grads or not. (deepcopy(module): the JAX
        # functions below do not mutate the module, so one module serves both.)
        rows = _np_rng(1).uniform(size=(num_inp, 1, nz_inp)).astype(np.float32)
        data = [jnp.asarray(r) for r in rows]
        argnums = (0, 1) if input_requires_grad else 0

        def loss_ckpt(module, data):
            feat = [remat.checkpoint(module, data=data_r, use_reentrant=False) for data_r in data]
            # compute mean as a proxy for some joint reasoning
            return _stack_mean(feat)

        def loss_plain(module, data):
            # feat_r_no_checkpoint = module_copy(data_r), for all inputs at once
            return module(data).mean()

        g = nnx.grad(loss_ckpt, argnums=argnums)(module, data)
        ref = nnx.grad(loss_plain, argnums=argnums)(module, jnp.asarray(rows))
        if input_requires_grad:
            _close(np.stack(g[1]), ref[1], rtol=1e-4, atol=1e-9)
            g, ref = g[0], ref[0]
        _close(nnx.state(g, nnx.Param), nnx.state(ref, nnx.Param), rtol=1e-4, atol=1e-7)

    # torch test/test_autograd.py TestAutograd.test_checkpoint_valid_reset_on_error
    def test_checkpoint_valid_reset_on_error(self):
        a = _randn(0, 2, 2)
        # torch: torch.autograd.grad through a reentrant checkpoint raises
        # "torch.utils.checkpoint is incompatible", and the error must not leave state
        # behind for the next backward. remat documents that use_reentrant=True gives
        # exact gradients under any JAX transformation (docs/pytorch.md table): jax.grad (the
        # torch.autograd.grad call) works, and so does the next one.
        g1 = jax.grad(lambda a: remat.checkpoint(jnp.exp, a, use_reentrant=True).sum())(a)
        g2 = jax.grad(lambda a: remat.checkpoint(jnp.exp, a, use_reentrant=True).sum())(a)
        _close(g1, jnp.exp(a))
        _close(g2, jnp.exp(a))

    # torch test/test_autograd.py TestAutograd.test_checkpointing_without_reentrant_detached_tensor
    @pytest.mark.parametrize("use_reentrant", USE_REENTRANT)
    def test_checkpointing_without_reentrant_detached_tensor(self, use_reentrant):
        class NoGradModule(nnx.Module):
            def __init__(self, rngs) -> None:
                self.linear = _linear(2, 2, rngs, use_bias=False)
                self.lin2 = _linear(2, 2, rngs, use_bias=False)

            def __call__(self, x):
                # with torch.no_grad(): ...
                return jax.lax.stop_gradient(self.lin2(self.linear(x)))

        module = NoGradModule(_np_rng(0))
        graphdef, state = nnx.split(module)
        a = _randn(1, 2, 2)
        # torch's reentrant variant raises "none of output has requires_grad=True"; remat
        # documents one exact mechanism for both values (docs/pytorch.md table), so both run.
        for _ in range(3):

            def loss(a):
                # out does not require grad
                out = remat.checkpoint(nnx.merge(graphdef, state), a, use_reentrant=use_reentrant)
                # Make loss require grad
                out = out + a
                return out.sum()

            _close(jax.grad(loss)(a), jnp.ones_like(a))

    # torch test/test_autograd.py TestAutograd.test_checkpointing_without_reentrant_saved_object_identity
    @pytest.mark.skip(reason="torch-only: object identity of a tensor saved with ctx.save_for_backward (assertIs)")
    def test_checkpointing_without_reentrant_saved_object_identity(self):
        pass

    # torch test/test_autograd.py TestAutograd.test_checkpointing_without_reentrant_correct_grad
    def test_checkpointing_without_reentrant_correct_grad(self):
        """Correct gradients for checkpoint without reentrant autograd, for both
        backward() and autograd.grad() (in JAX: jax.grad and jax.vjp)."""
        a = _randn(0, 2, 2)
        b_grad = jax.grad(lambda a: jnp.exp(a).sum())(a)
        c_grad = jax.grad(lambda a: remat.checkpoint(jnp.exp, a, use_reentrant=False).sum())(a)
        d, vjp = jax.vjp(lambda a: remat.checkpoint(jnp.exp, a, use_reentrant=False).sum(), a)
        (d_grad,) = vjp(jnp.ones_like(d))
        _close(b_grad, c_grad)
        _close(b_grad, d_grad)

    # torch test/test_autograd.py TestAutograd.test_checkpointing_without_reentrant_dataparallel
    def test_checkpointing_without_reentrant_dataparallel(self):
        """Gradient correctness when checkpoint without reentrant autograd is used with
        DataParallel (in JAX: the batch sharded over every device, the module replicated)."""

        class LinearModule(nnx.Module):
            def __init__(self, rngs) -> None:
                self.linear = _linear(2, 2, rngs, use_bias=False)

            def __call__(self, inp):
                return self.linear(inp)

        a = _randn(0, 2, 2)
        model = LinearModule(_np_rng(0))
        graphdef, state = nnx.split(model)
        b_grad = jax.grad(lambda a: nnx.merge(graphdef, state)(a).sum())(a)

        n = 2 if len(jax.devices()) >= 2 else 1
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("data",))
        a_sharded = jax.device_put(a, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
        state = jax.device_put(state, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))

        @jax.jit
        def c_grad_fn(state, a):
            return jax.grad(lambda a: remat.checkpoint(nnx.merge(graphdef, state), a, use_reentrant=False).sum())(a)

        _close(c_grad_fn(state, a_sharded), b_grad)

    # torch test/test_autograd.py TestAutograd.test_checkpointing_without_reentrant_parameter_used_in_an_out
    def test_checkpointing_without_reentrant_parameter_used_in_an_out(self):
        # torch counts calls of a gradient hook on w (once per tensor). JAX has no hooks;
        # the equivalent fact is that w, used both outside and (closed over) inside the
        # checkpoint, receives exactly one correctly accumulated gradient.
        w = _randn(0, 10, 10)
        x = _rand(1, 10, 10)

        def loss(w, x, use_checkpoint):
            h = w * x  # Using w outside the checkpoint
            def inner(x):
                return w * x  # Using w inside the checkpoint

            out = remat.checkpoint(inner, h, use_reentrant=False) if use_checkpoint else inner(h)
            return out.sum()

        g = jax.grad(loss, argnums=(0, 1))(w, x, True)
        ref = jax.grad(loss, argnums=(0, 1))(w, x, False)
        _close(g, ref)
        _close(g[0], 2 * w * x, rtol=1e-5)

    # torch test/test_autograd.py TestAutograd.test_checkpointing_without_reentrant_arbitrary_input_output
    def test_checkpointing_without_reentrant_arbitrary_input_output(self):
        """Checkpointing works with functions with arbitrary input/output structures."""

        class MyModel(nnx.Module):
            def __init__(self, rngs) -> None:
                self.layer = _linear(5, 5, rngs, use_bias=False)

            def __call__(self, dict_input):
                tensor = dict_input["tensor"]
                return {"result": self.layer(tensor)}

        model_no_checkpoint = MyModel(_np_rng(0))
        model_checkpoint_without_reentrant = copy.deepcopy(model_no_checkpoint)
        inp = {"tensor": _randn(1, 5, 5)}

        def loss_plain(m):
            return m(inp)["result"].sum()

        def loss_ckpt(m):
            return remat.checkpoint(m, inp, use_reentrant=False)["result"].sum()

        out_no_checkpoint, g_plain = nnx.value_and_grad(loss_plain)(model_no_checkpoint)
        out_checkpoint, g_ckpt = nnx.value_and_grad(loss_ckpt)(model_checkpoint_without_reentrant)
        _close(out_checkpoint, out_no_checkpoint)
        _close(nnx.state(g_ckpt, nnx.Param), nnx.state(g_plain, nnx.Param))

    # torch test/test_autograd.py TestAutograd.test_save_on_cpu_and_checkpoint
    def test_save_on_cpu_and_checkpoint(self):
        # torch.autograd.graph.save_on_cpu is a saved-tensor hook (offload what is saved
        # to host memory). On XLA:CPU device and host memory are one (remat.policies.
        # offload_names documents this), so the translation keeps the nesting of
        # checkpoint regions and asserts the gradients are unchanged by it.
        a = _randn(0, 2, 2)

        def b_loss(a):
            return ((((a**2) ** 2) ** 2) ** 2).sum()  # a.pow(2).pow(2).pow(2).pow(2)

        b_grad = jax.grad(b_loss)(a)

        def c_loss(a):
            h = a**2
            h = remat.checkpoint(lambda x: (x**2) ** 2, h, use_reentrant=False)
            c = h**2
            return c.sum()

        c_grad = jax.grad(c_loss)(a)

        def f(a):
            h = a**2
            h = (h**2) ** 2  # inside save_on_cpu
            return h**2

        d_grad = jax.grad(lambda a: remat.checkpoint(f, a, use_reentrant=False).sum())(a)
        _close(b_grad, c_grad, rtol=1e-5)
        _close(b_grad, d_grad, rtol=1e-5)


class TestAutogradDeviceType:
    # torch test/test_autograd.py TestAutogradDeviceType.test_cross_device_reentrant_autograd
    @pytest.mark.skip(
        reason=(
            "torch-only: CUDA-only; a reentrant checkpoint whose last AccumulateGrad runs on "
            "the CPU thread for the GPU thread's ready queue"
        ),
    )
    def test_cross_device_reentrant_autograd(self):
        pass


# --------------------------------------------------------------------------------------
# test/test_autograd.py  TestNestedCheckpoint
# --------------------------------------------------------------------------------------


class TestNestedCheckpoint:
    # torch sets early stopping with the torch.utils.checkpoint.set_checkpoint_early_stop
    # context manager; remat has no global switch, so the parametrized value goes to each
    # call's early_stop= keyword (accepted, docs/pytorch.md table).

    @staticmethod
    def grad(fn):
        # wrapper(x): torch.autograd.grad(fn(x), x, create_graph=True) -- jax.grad
        return jax.grad(fn)

    @staticmethod
    def sum(fn):
        def wrapped(x):
            return fn(x).sum()

        return wrapped

    @staticmethod
    def checkpoint(fn, early_stop=True):
        def wrapped(*args, **kwargs):
            return remat.checkpoint(fn, *args, use_reentrant=False, early_stop=early_stop, **kwargs)

        return wrapped

    def get_tests(self, fn, early_stop):
        grad = self.grad
        c = functools.partial(self.checkpoint, early_stop=early_stop)

        tests = (
            # function <> tuple of function arbitrarily wrapped in checkpoint in various ways
            (fn, (c(fn), c(c(fn)))),
            (grad(fn), (grad(c(fn)), grad(c(c(fn))))),
            (
                grad(grad(fn)),
                (grad(c(grad(fn))), c(grad(grad(c(fn)))), grad(c(grad(c(fn))))),
            ),
            (
                grad(grad(grad(fn))),
                (grad(c(grad(grad(c(fn))))), grad(c(grad(c(grad(c(fn))))))),
            ),
        )
        return tests

    # torch's check_graph_dies (the autograd graph is freed after use) is torch-only: JAX
    # builds no graph objects that could outlive a call.

    # torch test/test_autograd.py TestNestedCheckpoint.test_nested_checkpoint
    @pytest.mark.parametrize("early_stop", EARLY_STOP)
    def test_nested_checkpoint(self, early_stop):
        x = _randn(0)

        def f(x):
            out = jnp.sin(jnp.exp(jnp.sin(x)))
            return out

        def g(x):
            a = lambda x: jnp.sin(jnp.exp(jnp.sin(x)))  # noqa: E731
            b = lambda x: jnp.sin(jnp.exp(jnp.sin(x)))  # noqa: E731
            ga = jax.grad(a)(x)  # (ga,) = torch.autograd.grad(a, x)
            gb = jax.grad(b)(x)
            del ga, gb
            return jnp.sin(x)

        for fn in (f, g):
            for expected_fn, actual_fns in self.get_tests(fn, early_stop):
                expected = expected_fn(x)
                for actual_fn in actual_fns:
                    actual = actual_fn(x)
                    assert jnp.allclose(expected, actual)

    # torch test/test_autograd.py TestNestedCheckpoint.test_nested_checkpoint_two_children
    @pytest.mark.parametrize("early_stop", EARLY_STOP)
    def test_nested_checkpoint_two_children(self, early_stop):
        grad, sum = self.grad, self.sum
        c = functools.partial(self.checkpoint, early_stop=early_stop)

        def f(x):
            return jnp.sin(jnp.exp(jnp.sin(x)))

        def g(x):
            return jnp.exp(jnp.sin(jnp.cos(x)))

        def hc(x):
            return c(g)(c(f)(x))

        def h(x):
            return g(f(x))

        a = _randn(0, 3, 3)
        expected = grad(sum(grad(sum(h))))(a)
        actual = grad(sum(grad(sum(c(hc)))))(a)
        assert jnp.allclose(expected, actual)

        actual = grad(sum(c(grad(sum(c(hc))))))(a)
        assert jnp.allclose(expected, actual)

    # torch test/test_autograd.py TestNestedCheckpoint.test_nested_checkpoint_non_tensor_inputs_and_outputs
    @pytest.mark.parametrize("early_stop", EARLY_STOP)
    def test_nested_checkpoint_non_tensor_inputs_and_outputs(self, early_stop):
        def fn(k, a, b, f):
            return f(k * a * jnp.exp(b)), 1, "abcd"

        k = 3
        a = jnp.float32(2.0)
        b = jnp.float32(3.0)

        def f(x):
            return jnp.sin(x)

        def out_ckpt(a, b):
            out, unused1, unused2 = remat.checkpoint(fn, k, a, b, f, use_reentrant=False, early_stop=early_stop)
            assert (unused1, unused2) == (1, "abcd")
            return out

        actual_grads = jax.grad(out_ckpt, argnums=(0, 1))(a, b)
        expected_grads = jax.grad(lambda a, b: fn(k, a, b, f)[0], argnums=(0, 1))(a, b)
        for actual, expected in zip(actual_grads, expected_grads):
            assert jnp.allclose(actual, expected)

    # torch test/test_autograd.py TestNestedCheckpoint.test_nested_checkpoint_kwargs
    @pytest.mark.parametrize("early_stop", EARLY_STOP)
    def test_nested_checkpoint_kwargs(self, early_stop):
        def fn(a, blah=None):
            out = jnp.exp(jnp.sin(a))
            if blah is not None:
                out = out * blah
            return jnp.exp(jnp.sin(out))

        a = jnp.float32(2.0)
        b = jnp.float32(3.0)
        actual_grads = jax.grad(
            lambda a, b: remat.checkpoint(fn, a, blah=b, use_reentrant=False, early_stop=early_stop), argnums=(0, 1)
        )(a, b)
        expected_grads = jax.grad(lambda a, b: fn(a, blah=b), argnums=(0, 1))(a, b)
        for actual, expected in zip(actual_grads, expected_grads):
            assert jnp.allclose(actual, expected)

    # torch test/test_autograd.py TestNestedCheckpoint.test_nested_checkpoint_same_graph
    @pytest.mark.skip(reason="torch-only: a hook registered on a grad_fn node of the original graph must fire once")
    @pytest.mark.parametrize("early_stop", EARLY_STOP)
    def test_nested_checkpoint_same_graph(self, early_stop):
        pass

    # torch test/test_autograd.py TestNestedCheckpoint.test_nested_checkpoint_reentrant_backwards
    @pytest.mark.skip(
        reason=(
            "torch-only: a grad_fn hook that runs a second backward (retain_graph) while the "
            "first is in flight"
        ),
    )
    @pytest.mark.parametrize("early_stop", EARLY_STOP)
    def test_nested_checkpoint_reentrant_backwards(self, early_stop):
        pass

    # torch test/test_autograd.py TestNestedCheckpoint.test_nested_checkpoint_set_early_stop
    def test_nested_checkpoint_set_early_stop(self):
        counter = [0]

        def make_fn():  # a new function for each case, so that each is traced afresh
            def clone(x):
                counter[0] += 1
                return jnp.copy(x)

            def fn(x):
                # Since clone does not save anything, it is not recomputed iff early stop is enabled.
                return clone(jnp.cos(jnp.sin(x)))

            return fn

        a = jnp.float32(1.0)
        # torch: counter 1 with early stopping (default, early_stop=True), 2 without
        # (early_stop=False; the set_checkpoint_early_stop context manager and its
        # nesting/precedence have no remat counterpart). remat documents that XLA removes
        # any recomputation the backward pass does not need, whatever early_stop says
        # (docs/pytorch.md table, checkpoint docstring): the clone is never recomputed.
        for kwargs in ({}, {"early_stop": False}, {"early_stop": True}):
            fn = make_fn()

            def ckpt(a, kwargs=kwargs, fn=fn):
                return remat.checkpoint(fn, a, use_reentrant=False, **kwargs)

            # traced once by the forward pass, never called by the backward pass
            assert _python_calls(ckpt, counter, a) == (1, 0)
            _close(jax.grad(ckpt)(a), jax.grad(fn)(a))
            recomputed = _recomputed(ckpt, fn, a)
            assert recomputed["copy"] == 0, recomputed  # the clone: not recomputed
            assert recomputed == collections.Counter({"sin": 1}), recomputed  # only sin(x), for cos'

    # torch test/test_autograd.py TestNestedCheckpoint.test_nested_checkpoint_set_early_stop_no_recompution_needed
    def test_nested_checkpoint_set_early_stop_no_recompution_needed(self):
        # Case 1: We have one tensor saved and its the input. torch counts Python calls
        # (2: forward + the recomputation's entry) and dispatched sin ops (1 with early
        # stopping, 2 without). JAX: Python is called once, and the sin primitive is never
        # recomputed -- its derivative needs only the input -- with either early_stop.
        counter = [0]
        a = jnp.float32(1.0)
        for early_stop in (True, False):

            def fn(x):
                counter[0] += 1
                return jnp.sin(x)

            def ckpt(a, early_stop=early_stop, fn=fn):
                return remat.checkpoint(fn, a, use_reentrant=False, early_stop=early_stop)

            assert _python_calls(ckpt, counter, a) == (1, 0)
            assert _recomputed(ckpt, fn, a) == collections.Counter()

        # Case 2: Forward saves no tensors: nothing is recomputed, whether or not early
        # stop is enabled (torch's counter is 1 in both cases too).
        for early_stop in (True, False):

            def fn2(x):
                counter[0] += 1
                return jnp.copy(x)

            def ckpt2(a, early_stop=early_stop, fn2=fn2):
                return remat.checkpoint(fn2, a, use_reentrant=False, early_stop=early_stop)

            assert _python_calls(ckpt2, counter, a) == (1, 0)
            assert _recomputed(ckpt2, fn2, a) == collections.Counter()


# --------------------------------------------------------------------------------------
# test/test_autograd.py  TestSelectiveActivationCheckpoint
# --------------------------------------------------------------------------------------


class TestSelectiveActivationCheckpoint:
    # create_selective_checkpoint_contexts(ops_or_policy_fn) -> remat.policies.selective(...)
    # (passed as policy=, docs/pytorch.md table). A policy function gets the JAX primitive's name
    # instead of (ctx, torch op): torch.ops.aten.mm.default is "dot_general" there.

    # torch test/test_autograd.py TestSelectiveActivationCheckpoint.test_flops_and_mem
    def test_flops_and_mem(self):
        # torch measures CUDA memory ("requested_bytes") and FlopCounterMode, normalized
        # so that one 512x512 float32 matmul is 1 (MiB, or flops). JAX equivalents:
        # activation memory = saved_residuals(...).residual_bytes in MiB; backward flops =
        # the 512^3 matmuls the gradient runs beyond the forward's one.
        x = _randn(0, 512, 512)
        y = _randn(1, 512, 512)

        def get_act_mem(f):
            return saved_residuals(f, x, y).residual_bytes / (1024 * 1024)

        def get_bw_flops(f):
            fwd = _prims(jax.make_jaxpr(f)(x, y).jaxpr)["dot_general"]
            total = _grad_prims(f, x, y, argnums=(0, 1))["dot_general"]
            return total - fwd

        def fn(x, y):
            return jnp.sin(jnp.matmul(jnp.cos(x), y)).sum()

        def fn_ac(x, y):
            return remat.checkpoint(fn, x, y, use_reentrant=False)

        def make_fn_sac(ops):
            def fn_sac(x, y):
                return remat.checkpoint(fn, x, y, use_reentrant=False, policy=selective(ops))

            return fn_sac

        def policy_fn(op, *args, **kwargs):
            if op == "dot_general":  # op == torch.ops.aten.mm.default
                return CheckpointPolicy.MUST_SAVE
            else:
                return CheckpointPolicy.PREFER_RECOMPUTE

        def fn_sac2(x, y):
            return remat.checkpoint(fn, x, y, use_reentrant=False, policy=selective(policy_fn))

        def policy_fn_bool(op, *args, **kwargs):
            return op == "dot_general"

        def fn_sac3(x, y):
            return remat.checkpoint(fn, x, y, use_reentrant=False, policy=selective(policy_fn_bool))

        act_mem_noac = get_act_mem(fn)
        bw_flops_noac = get_bw_flops(fn)
        # torch keeps 2.0 (cos(x) and the matmul); JAX autodiff also keeps sin(x) for
        # cos's derivative where torch keeps x, an input: 3.0. Not remat's business.
        assert act_mem_noac >= 2.0
        assert bw_flops_noac == 2.0

        act_mem_ac = get_act_mem(fn_ac)
        bw_flops_ac = get_bw_flops(fn_ac)
        assert act_mem_ac == 0.0
        assert bw_flops_ac == 3.0

        fn_sac = make_fn_sac(["mm"])  # [torch.ops.aten.mm.default], by the op's name
        act_mem_sac = get_act_mem(fn_sac)
        bw_flops_sac = get_bw_flops(fn_sac)
        assert act_mem_sac == 1.0
        assert bw_flops_sac == 2.0

        act_mem_sac2 = get_act_mem(fn_sac2)
        bw_flops_sac2 = get_bw_flops(fn_sac2)
        assert act_mem_sac2 == 1.0
        assert bw_flops_sac2 == 2.0

        act_mem_sac3 = get_act_mem(fn_sac3)
        bw_flops_sac3 = get_bw_flops(fn_sac3)
        assert act_mem_sac3 == 1.0
        assert bw_flops_sac3 == 2.0

        if torch is not None:
            # the original's list itself, [torch.ops.aten.mm.default]: remat maps PyTorch
            # op names, and its _op_names reads "torch.ops.aten.mm.default and friends"
            fn_sac = make_fn_sac([torch.ops.aten.mm.default])
            got = (get_act_mem(fn_sac), get_bw_flops(fn_sac))
            assert got == (1.0, 2.0), f"selective([torch.ops.aten.mm.default]) gives (MiB kept, bw matmuls) = {got}"

    # torch test/test_autograd.py TestSelectiveActivationCheckpoint.test_output_already_has_autograd_meta
    def test_output_already_has_autograd_meta(self):
        # View of tensor of non-differentiable dtype still has AutogradMeta
        def fn(x, y):
            return x.reshape(-1), jnp.cos(jnp.sin(y))

        x = jnp.array([1, 2, 3], dtype=jnp.int32)  # torch.int64 (JAX runs 32-bit by default)
        y = _randn(0, 3)
        # [torch.ops.aten.view.default]: a view is JAX's reshape primitive
        policy = selective([jax.lax.reshape_p])
        out = remat.checkpoint(fn, x, y, use_reentrant=False, policy=policy)
        np.testing.assert_array_equal(out[0], x)
        g = jax.grad(lambda y: remat.checkpoint(fn, x, y, use_reentrant=False, policy=policy)[1].sum())(y)
        _close(g, -jnp.sin(jnp.sin(y)) * jnp.cos(y), rtol=1e-5)

    # torch test/test_autograd.py TestSelectiveActivationCheckpoint.test_subclass_dispatching_sizes
    @pytest.mark.skip(
        reason=(
            "torch-only: a wrapper tensor subclass dispatching on sizes (aten.sym_size) under"
            " the SAC caching dispatch mode"
        ),
    )
    def test_subclass_dispatching_sizes(self):
        pass

    # torch test/test_autograd.py TestSelectiveActivationCheckpoint.test_bad_inputs, its
    # fresh-interpreter half: create_selective_checkpoint_contexts can be called on its own; so
    # must selective() be, straight after `import remat` (docs/policies.md builds a policy
    # before any checkpoint call). A fresh interpreter shows it: in this process other imports
    # have long been made. Slow (a child interpreter, ~2 s): the default run makes the same two
    # calls right after `import remat` in tests/test_lowering.py's one child interpreter
    # (test_import_remat_changes_nothing_observable_and_imports_nothing_heavy).
    @pytest.mark.slow
    def test_bad_inputs_selective_right_after_import(self):
        code = (
            "import remat, jax\n"
            "remat.policies.selective(['mm'])\n"
            "remat.policies.selective([jax.lax.sin_p])\n"
        )
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, "selective() right after `import remat` fails:\n" + proc.stderr[-800:]

    # torch test/test_autograd.py TestSelectiveActivationCheckpoint.test_bad_inputs, in this
    # process (the fresh-interpreter half is the test above)
    def test_bad_inputs(self):
        problems = []  # every check runs; the test reports all that fail
        bad_op_list1 = [2]
        # torch: ValueError "Expected op in `op_list` to be an OpOverload"; remat may
        # choose ValueError or TypeError, but must not silently save nothing.
        try:
            selective(bad_op_list1)
        except (ValueError, TypeError):
            pass
        else:
            problems.append("selective([2]) was accepted (its policy saves nothing) instead of raising")

        if torch is not None:
            # [torch.ops.aten.sin]: torch wants a specific overload (sin.default).
            # JAX primitives have no overloads, so remat's documented PyTorch-name mapping
            # accepts the packet: its policy saves the sin outputs.
            policy = selective([torch.ops.aten.sin])
            kept = saved_residuals(
                lambda x: remat.checkpoint(lambda x: jnp.exp(jnp.sin(x)), x, policy=policy), _randn(0, 3)
            )
            assert [r.primitive for r in kept if not r.is_argument] == ["sin"]

        # torch: TypeError "either a function or a list of ops."
        with pytest.raises(TypeError):
            selective(2)
        assert not problems, "\n".join(problems)

    # torch test/test_autograd.py TestSelectiveActivationCheckpoint.test_policy_with_state
    def test_policy_with_state(self):
        # If I have a stateful callable, state is shared between the original forward and
        # the recompute (torch: counters == [1, 2, 3, 1, 2]: three forward consultations,
        # reset by ctx.is_recompute, then two recompute ones thanks to early stop).
        # remat's policy functions get no ctx: JAX consults a policy once per operation
        # of the region while tracing and never during the recomputation, so the shared
        # counter is never reset and each forward sin is consulted exactly once.
        counters = []
        ops = []

        class Policy:
            def __init__(self) -> None:
                self.counter = [0]
                self.recompute_counter = [0]

            def __call__(self, func, *args, **kwargs):
                counter = self.counter
                counter[0] += 1
                counters.append(counter[0])
                ops.append(func)
                if counter == 1 and func == "dot_general":
                    return CheckpointPolicy.MUST_SAVE
                return CheckpointPolicy.PREFER_RECOMPUTE

        def fn(x):
            return jnp.sin(jnp.sin(jnp.sin(x)))

        x = _randn(0, 3)
        policy = selective(Policy())
        g = jax.grad(lambda x: remat.checkpoint(fn, x, use_reentrant=False, policy=policy).sum())(x)
        _close(g, jax.grad(lambda x: fn(x).sum())(x))
        assert ops.count("sin") == 3
        assert counters == list(range(1, len(counters) + 1))

    # torch test/test_autograd.py TestSelectiveActivationCheckpoint.test_storage_lifetime
    @pytest.mark.skip(
        reason=(
            "torch-only: lifetime of the SAC caching dispatch mode's storage (weakrefs, "
            "reference cycles, retain_graph)"
        ),
    )
    def test_storage_lifetime(self):
        pass

    # torch test/test_autograd.py TestSelectiveActivationCheckpoint.test_version_counter
    def test_version_counter(self):
        # torch: 1) saving sin's output and then mutating it in place (mul_) raises "has
        # been mutated" -- JAX arrays are immutable, x.sin().mul_(2) is x.sin() * 2 and
        # there is nothing to detect; 2) with allow_cache_entry_mutation=True it runs.
        # The translation keeps 2): the policy saves sin, and the gradient is exact.
        def policy_fn(op, *args, **kwargs):
            if op == "sin":
                return CheckpointPolicy.MUST_SAVE
            else:
                return CheckpointPolicy.PREFER_RECOMPUTE

        def fn(x):
            return jnp.exp(jnp.cos(jnp.sin(x) * 2))

        x = _randn(0, 3)
        policy = selective(policy_fn)
        g = jax.grad(lambda x: remat.checkpoint(fn, x, use_reentrant=False, policy=policy).sum())(x)
        _close(g, jax.grad(lambda x: fn(x).sum())(x))
        kept = saved_residuals(lambda x: remat.checkpoint(fn, x, use_reentrant=False, policy=policy), x)
        assert "sin" in [r.primitive for r in kept if not r.is_argument]

    # torch test/test_autograd.py TestSelectiveActivationCheckpoint.test_function_with_more_than_one_output
    def test_function_with_more_than_one_output(self):
        # torch.var_mean is one op with two outputs, saved by MUST_SAVE, and its policy
        # is consulted twice (forward + recompute). JAX has no var_mean primitive: var and
        # mean are built from reduce_sum ops, and the policy is consulted once per
        # reduction, at trace time.
        counter = [0]

        def policy_fn(op, *args, **kwargs):
            if op == "reduce_sum":  # op == torch.ops.aten.var_mean.correction
                counter[0] += 1
                return CheckpointPolicy.MUST_SAVE
            else:
                return CheckpointPolicy.PREFER_RECOMPUTE

        def var_mean(x):  # torch.var_mean: unbiased variance (correction=1) and mean
            return jnp.var(x, ddof=1), jnp.mean(x)

        # var_mean has two outputs
        def fn(x):
            a, b = var_mean(x)
            return a * b

        x = _randn(0, 3)
        policy = selective(policy_fn)
        x_grad = jax.grad(lambda x: remat.checkpoint(fn, x, use_reentrant=False, policy=policy).sum())(x)
        x_grad_ref = jax.grad(lambda x: fn(x).sum())(x)
        _close(x_grad, x_grad_ref, rtol=1e-5)
        assert counter[0] == _prims(jax.make_jaxpr(fn)(x).jaxpr)["reduce_sum"]

    # torch test/test_autograd.py TestSelectiveActivationCheckpoint.test_function_with_non_tensor_output
    def test_function_with_non_tensor_output(self):
        # When SAC is enabled, the op is not computed a second time. torch registers a
        # custom op "mylib::sin_with_extra" returning (tensor, int) and saves it by op.
        # In JAX an operation of one's own is identified by a checkpoint_name, and
        # policy=[names] saves values so named (docs/policies.md table).
        counter = [0]

        def sin_with_extra(x):
            counter[0] += 1
            return remat.checkpoint_name(jnp.sin(x), "sin_with_extra"), 2

        def fn(x):
            return jnp.sin(sin_with_extra(x)[0] * jnp.exp(jnp.sin(x)))

        x = _randn(0, 3)

        def ckpt(x, policy):
            return remat.checkpoint(fn, x, use_reentrant=False, policy=policy).sum()

        x_grad = jax.grad(ckpt)(x, ["sin_with_extra"])
        assert counter[0] == 1
        x_grad_ref = jax.grad(lambda x: fn(x).sum())(x)
        _close(x_grad, x_grad_ref, rtol=1e-5)
        # not computed a second time: with the op saved, the backward recomputes one sin
        # fewer than with nothing saved, and the saved value is the named one
        plain = lambda x: fn(x).sum()  # noqa: E731
        saved = _recomputed(lambda x: ckpt(x, ["sin_with_extra"]), plain, x)["sin"]
        nothing = _recomputed(lambda x: ckpt(x, None), plain, x)["sin"]
        assert saved == nothing - 1, (saved, nothing)
        kept = saved_residuals(lambda x: ckpt(x, ["sin_with_extra"]), x)
        assert "sin_with_extra" in kept.named()

    # torch test/test_autograd.py TestSelectiveActivationCheckpoint.test_can_only_trigger_recompute_once
    @pytest.mark.skip(
        reason=(
            "torch-only: a second backward over a retained graph (retain_graph=True) through "
            "the SAC cache; a JAX pullback is a pure function"
        ),
    )
    def test_can_only_trigger_recompute_once(self):
        pass
