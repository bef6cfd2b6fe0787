"""checkpoint_sequential: PyTorch's segmentation, every kind of layer list, PyTorch parity."""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_clean_error, assert_trees_close, nonarg_residuals, remat_count
from flax import nnx

from remat import checkpoint_sequential
from remat._core.sequential import segment_bounds


def torch_reference_bounds(n: int, segments: int) -> list[tuple[int, int]]:
    """The loop of torch.utils.checkpoint.checkpoint_sequential, transcribed."""
    segment_size = n // segments
    out = []
    for start in range(0, segment_size * (segments - 1), segment_size):
        end = start + segment_size - 1
        out.append((start, end + 1))
    return out


PAIRS = [(n, s) for n in range(1, 14) for s in range(1, n + 1)]


@pytest.mark.parametrize("n,segments", PAIRS, ids=[f"{n}-{s}" for n, s in PAIRS])
def test_segment_bounds_match_pytorch(n, segments):
    bounds = segment_bounds(n, segments)
    assert bounds == torch_reference_bounds(n, segments)
    assert len(bounds) == segments - 1
    # contiguous from 0, equal chunks, the not-checkpointed tail at least as long
    size = n // segments
    assert all(e - s == size for s, e in bounds)
    last = bounds[-1][1] if bounds else 0
    assert n - last >= size


def test_segment_bounds_examples():
    assert segment_bounds(10, 3) == [(0, 3), (3, 6)]
    assert segment_bounds(4, 4) == [(0, 1), (1, 2), (2, 3)]
    assert segment_bounds(7, 2) == [(0, 3)]
    assert segment_bounds(5, 1) == []


# --- plain functions ------------------------------------------------------------------------

# drawn with NumPy: jax.random, eager, compiles a program per shape
_RNG = np.random.default_rng(0)
WS = [jax.device_put((_RNG.standard_normal((4, 4)) * 0.5).astype(np.float32)) for _ in range(6)]
X = jax.device_put(np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32))


def _layer(w):
    return lambda x: jnp.tanh(x @ w)


LAYERS = [_layer(w) for w in WS]


def plain_chain(x):
    for f in LAYERS:
        x = f(x)
    return jnp.sum(x)


# both containers fast, with 3 segments of the 6 functions (two checkpointed regions of two, a
# plain tail of two) and 6 (five regions of one, a tail of one); the other counts slow (CI runs
# them). segments=1 (no region) is counted by test_checkpointed_segments_count_and_residuals[1]
FAST_FUNCTIONS = {(list, 3), (tuple, 6)}


@pytest.mark.parametrize("container,segments", [
    pytest.param(c, s, id=f"{c.__name__}-{s}", marks=() if (c, s) in FAST_FUNCTIONS else pytest.mark.slow)
    for c in (list, tuple) for s in (1, 2, 3, 4, 6)
])
def test_functions_gradients(segments, container):
    f = lambda x: jnp.sum(checkpoint_sequential(container(LAYERS), segments, x))  # noqa: E731
    assert_trees_close(f(X), plain_chain(X))
    assert_trees_close(jax.grad(f)(X), jax.grad(plain_chain)(X))
    assert_trees_close(jax.jit(jax.grad(f))(X), jax.grad(plain_chain)(X))


@pytest.mark.parametrize("segments", [1, 2, 3, 4, 5, 6])
def test_checkpointed_segments_count_and_residuals(segments):
    f = lambda x: jnp.sum(checkpoint_sequential(LAYERS, segments, x))  # noqa: E731
    assert remat_count(f, X) == segments - 1
    kept = len(nonarg_residuals(f, X))
    plain = len(nonarg_residuals(plain_chain, X))
    if segments == 1:
        assert kept == plain  # segments=1 checkpoints nothing, as in PyTorch
    else:
        # each checkpointed chunk keeps only its input; the tail keeps its usual residuals
        size = len(LAYERS) // segments
        tail = len(LAYERS) - size * (segments - 1)
        assert kept < plain
        # the inputs of the chunks after the first; per tail layer tanh(x @ w) its input
        # (for the weight gradient) and 1 - tanh**2
        assert kept == (segments - 2) + 2 * tail


def test_more_segments_keep_fewer_residuals():
    counts = [len(nonarg_residuals(lambda x, s=s: jnp.sum(checkpoint_sequential(LAYERS, s, x)), X))
              for s in (1, 2, 3)]
    assert counts[0] > counts[1] > counts[2]


def test_pytree_input_and_output_through_chain():
    fs = [lambda d: {"a": jnp.sin(d["a"]), "b": d["b"] * 2}, lambda d: {"a": d["a"] * d["b"], "b": d["b"]}]
    x = {"a": jnp.array([0.1, 0.2]), "b": jnp.array([1.0, 3.0])}
    f = lambda x: jnp.sum(checkpoint_sequential(fs, 2, x)["a"])  # noqa: E731
    g = jax.grad(f)(x)
    np.testing.assert_allclose(g["a"], np.cos([0.1, 0.2]) * 2 * np.array([1.0, 3.0]), rtol=1e-6)


def test_use_reentrant_and_options():
    for opts in ({"use_reentrant": True}, {"use_reentrant": False}, {"preserve_rng_state": False},
                 {"policy": "dots"}, {"determinism_check": "none"}):
        f = lambda x, opts=opts: jnp.sum(checkpoint_sequential(LAYERS, 3, x, **opts))  # noqa: E731
        assert_trees_close(jax.grad(f)(X), jax.grad(plain_chain)(X))
        assert remat_count(f, X) == 2


# --- NNX ----------------------------------------------------------------------------------

def _np_init(rng):
    """An nnx.Linear kernel or bias initializer drawing with NumPy (jax.random, eager, compiles
    a program per shape); the kernel scaled as LeCun's."""
    def init(key, shape, dtype=jnp.float32):
        return jax.device_put((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(dtype))

    return init


def _linear(i, o, rngs, rng):
    return nnx.Linear(i, o, rngs=rngs, kernel_init=_np_init(rng), bias_init=_np_init(rng))


def _nnx_seq(seed=0):
    rngs, rng = nnx.Rngs(seed), np.random.default_rng(seed)
    return nnx.Sequential(
        _linear(4, 8, rngs, rng), jnp.tanh, _linear(8, 8, rngs, rng), nnx.relu,
        _linear(8, 4, rngs, rng), jnp.sin,
    )


# 3 fast (it also runs eagerly); the others slow
@pytest.mark.parametrize("segments", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow),
                                      3, pytest.param(6, marks=pytest.mark.slow)])
def test_nnx_sequential(segments):
    def loss(model, x, s):
        return jnp.sum(checkpoint_sequential(model, s, x) ** 2)

    def loss_plain(model, x):
        return jnp.sum(model(x) ** 2)

    model = _nnx_seq()
    # the plain gradient, the checkpointed one and that of the layers as a plain list of NNX
    # modules and functions: one program
    g0, gj, g_list = nnx.jit(lambda m, x: (
        nnx.grad(loss_plain)(m, x), nnx.grad(loss)(m, x, segments),
        nnx.grad(lambda m, x: jnp.sum(checkpoint_sequential(list(m.layers), segments, x) ** 2))(m, x)))(model, X)
    assert_trees_close(gj, g0)
    assert_trees_close(g_list, g0)
    if segments == 3:  # eager too (slow: op by op), once
        assert_trees_close(nnx.grad(loss)(model, X, segments), g0)

    graphdef, state = nnx.split(model)
    f = lambda st: loss(nnx.merge(graphdef, st), X, segments)  # noqa: E731
    assert remat_count(f, state) == segments - 1
    if segments > 1:
        plain = len(nonarg_residuals(lambda st: loss_plain(nnx.merge(graphdef, st), X), state))
        assert len(nonarg_residuals(f, state)) < plain


def test_nnx_sequential_with_dropout_and_batchnorm():
    def make():
        rngs, rng = nnx.Rngs(0, dropout=1), np.random.default_rng(0)
        return nnx.Sequential(
            _linear(4, 8, rngs, rng), nnx.BatchNorm(8, rngs=rngs), nnx.relu,
            nnx.Dropout(0.3, rngs=rngs), _linear(8, 4, rngs, rng),
        )

    x = jax.device_put(np.random.default_rng(5).standard_normal((6, 4)).astype(np.float32))
    m0, m1 = make(), make()
    g0, g1 = nnx.jit(lambda m0, m1: (  # one program for both sides
        nnx.grad(lambda m: jnp.sum(m(x) ** 2))(m0),
        nnx.grad(lambda m: jnp.sum(checkpoint_sequential(m, 3, x) ** 2))(m1)))(m0, m1)
    assert_trees_close(g1, g0)
    assert_trees_close(nnx.state(m1, nnx.BatchStat), nnx.state(m0, nnx.BatchStat))
    assert_trees_close(nnx.state(m1, nnx.RngState), nnx.state(m0, nnx.RngState))


# --- Linen --------------------------------------------------------------------------------

def _dense(features):
    """nn.Dense with a kernel drawn by NumPy from its shape (jax.random, eager, compiles a program
    per shape)."""
    return nn.Dense(features, kernel_init=lambda key, shape, dtype=jnp.float32: jax.device_put(
        (np.random.default_rng(shape).standard_normal(shape) / np.sqrt(shape[0])).astype(dtype)))


class LinenSeq(nn.Module):
    segments: int
    checkpointed: bool = True

    def setup(self):
        self.seq = nn.Sequential([_dense(8), nn.tanh, _dense(8), nn.relu, _dense(4)])

    def __call__(self, x):
        if self.checkpointed:
            return checkpoint_sequential(self.seq, self.segments, x)
        return self.seq(x)


class LinenList(nn.Module):
    segments: int
    checkpointed: bool = True

    def setup(self):
        self.layers = [_dense(8), _dense(8), _dense(4)]

    def __call__(self, x):
        if self.checkpointed:
            return checkpoint_sequential(self.layers, self.segments, x)
        for f in self.layers:
            x = f(x)
        return x


# every segment count of the list and, of nn.Sequential's five, 1, 2 (eager) and 5 in the default
# run; all five with the slow cases
@pytest.mark.parametrize("cls,n,counts", [
    pytest.param(LinenSeq, 5, (1, 2, 5), id="nn.Sequential"),
    pytest.param(LinenSeq, 5, (1, 2, 3, 4, 5), id="nn.Sequential-every-count", marks=pytest.mark.slow),
    pytest.param(LinenList, 3, (1, 2, 3), id="list"),
])
def test_linen_sequential(cls, n, counts):
    params = cls(1, checkpointed=False).init(jax.random.key(0), X)
    assert jax.tree.structure(jax.eval_shape(cls(2).init, jax.random.key(0), X)) == jax.tree.structure(params)

    def loss(p, s, ck=True):
        return jnp.sum(cls(s, checkpointed=ck).apply(p, X) ** 2)

    # the plain value and gradient, every jitted segment count and the gradient at n: one program
    jitted = [s for s in counts if s != 2]
    v0, g0, together, g_n = jax.jit(lambda p: (
        loss(p, 1, False), jax.grad(loss)(p, 1, False),
        {s: jax.value_and_grad(loss)(p, s) for s in jitted}, jax.grad(loss)(p, n)))(params)
    for s in counts:
        v, g = together[s] if s != 2 else jax.value_and_grad(loss)(params, s)  # eager once
        assert_trees_close(v, v0)
        assert_trees_close(g, g0)
        assert remat_count(lambda p, s=s: jax.grad(loss)(p, s), params) >= s - 1
        assert remat_count(lambda p, s=s: loss(p, s), params) == s - 1
    assert_trees_close(g_n, g0)


# --- bad input ----------------------------------------------------------------------------

BAD = [
    (lambda: checkpoint_sequential(LAYERS, 0, X), ValueError, ["segments=0", "between 1 and", "(6)"]),
    (lambda: checkpoint_sequential(LAYERS, 7, X), ValueError, ["segments=7", "(6)"]),
    (lambda: checkpoint_sequential(LAYERS, -1, X), ValueError, ["segments=-1"]),
    (lambda: checkpoint_sequential([], 1, X), ValueError, ["(0)"]),
    (lambda: checkpoint_sequential(LAYERS, 2.0, X), TypeError, ["segments must be an int"]),
    (lambda: checkpoint_sequential(LAYERS, True, X), TypeError, ["segments must be an int"]),
    (lambda: checkpoint_sequential([jnp.sin, 3], 1, X), TypeError, ["functions[1]", "int"]),
    (lambda: checkpoint_sequential(jnp.sin, 1, X), TypeError, ["list or tuple"]),
    (lambda: checkpoint_sequential(LAYERS, 2, X, policy="bogus"), ValueError, ["unknown policy"]),
    (lambda: checkpoint_sequential(LAYERS, 2, X, context_fn=lambda: None), TypeError, ["policy="]),
    (lambda: checkpoint_sequential(LAYERS, 2, X, use_reentrant=True, policy="dots"), ValueError,
     ["use_reentrant=False"]),
    (lambda: checkpoint_sequential(LAYERS, 2, X, bogus=1), TypeError, ["bogus", "policy"]),
    (lambda: checkpoint_sequential(LAYERS, 2, X, static_argnums=0), TypeError, ["static_argnums"]),
    (lambda: checkpoint_sequential(nn.Sequential([nn.Dense(3)]), 1, X), TypeError, ["unbound", "setup()"]),
    (lambda: checkpoint_sequential([nn.Dense(3), nn.Dense(3)], 2, X), TypeError, ["one parent"]),
]


@pytest.mark.parametrize("call,exc,fragments", BAD, ids=range(len(BAD)))
def test_bad_input(call, exc, fragments):
    with pytest.raises(exc) as excinfo:
        call()
    assert_clean_error(excinfo, *fragments)


# --- PyTorch parity -----------------------------------------------------------------------

def test_segment_bounds_equal_pytorch_at_run_time(monkeypatch):
    torch = pytest.importorskip("torch")
    import torch.utils.checkpoint as tuc

    for n in range(1, 8):
        for segments in range(1, n + 1):
            torch_bounds = _torch_segment_bounds(torch, tuc, monkeypatch, n, segments)
            assert segment_bounds(n, segments) == torch_bounds, (n, segments)


def _torch_segment_bounds(torch, tuc, monkeypatch, n, segments):
    """The ``(start, stop)`` of each segment torch's checkpoint_sequential checkpoints, seen at run time."""
    calls: list[int] = []
    chunks: list[list[int]] = []
    real = tuc.checkpoint

    def recording(fn, *a, **k):
        start = len(calls)
        out = real(fn, *a, **k)
        chunks.append(list(range(start, len(calls))))
        return out

    def layer(i, x):
        calls.append(i)
        return x + 1

    monkeypatch.setattr(tuc, "checkpoint", recording)
    fs = [functools.partial(layer, i) for i in range(n)]
    with torch.no_grad():
        tuc.checkpoint_sequential(fs, segments, torch.zeros(1), use_reentrant=False)
    monkeypatch.setattr(tuc, "checkpoint", real)
    return [(c[0], c[-1] + 1) for c in chunks]


def _torch_model(torch, sizes, seed=0):
    torch.manual_seed(seed)
    mods = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        mods.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 2:
            mods.append(torch.nn.Tanh())
    return torch.nn.Sequential(*mods)


FAST_PARITY = {(False, 2)}  # one mechanism for both modes (docs/pytorch.md); the other cases slow


@pytest.mark.parametrize("use_reentrant,segments", [
    pytest.param(r, s, id=f"{r}-{s}", marks=() if (r, s) in FAST_PARITY else pytest.mark.slow)
    for r in (False, True) for s in (1, 2, 3, 5, 7)
])
def test_pytorch_parity(segments, use_reentrant):
    torch = pytest.importorskip("torch")
    from torch.utils.checkpoint import checkpoint_sequential as torch_cs

    sizes = [5, 8, 8, 6, 4]  # 4 Linear + 3 Tanh = 7 functions
    model = _torch_model(torch, sizes)
    x_np = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    xt = torch.tensor(x_np, requires_grad=True)
    out_t = torch_cs(model, segments, xt, use_reentrant=use_reentrant)
    (out_t ** 2).sum().backward()
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]

    # the same weights as plain jnp functions ...
    np_params = [(m.weight.detach().numpy(), m.bias.detach().numpy()) for m in linears]
    params = jax.device_put(np_params)

    def functions(ps):
        fs = []
        for i, (w, b) in enumerate(ps):
            fs.append(lambda x, w=w, b=b: x @ w.T + b)
            if i < len(ps) - 1:
                fs.append(jnp.tanh)
        return fs

    def loss(ps, x):
        return jnp.sum(checkpoint_sequential(functions(ps), segments, x, use_reentrant=use_reentrant) ** 2)

    # ... and as an nnx.Sequential of nnx.Linear
    rngs = nnx.Rngs(0)
    layers = []
    for i, ((w, b), (a, o)) in enumerate(zip(np_params, zip(sizes[:-1], sizes[1:]), strict=True)):
        layers.append(nnx.Linear(a, o, rngs=rngs, kernel_init=lambda *_, w=w: jax.device_put(w.T.copy()),
                                 bias_init=lambda *_, b=b: jax.device_put(b)))
        if i < len(np_params) - 1:
            layers.append(jnp.tanh)
    seq = nnx.Sequential(*layers)

    def nnx_loss(m, x):
        return jnp.sum(checkpoint_sequential(m, segments, x, use_reentrant=use_reentrant) ** 2)

    # the forward pass and both gradients: one program
    out_j, (gp, gx), (grads, gx2) = nnx.jit(lambda seq, ps, x: (
        checkpoint_sequential(functions(ps), segments, x), jax.grad(loss, argnums=(0, 1))(ps, x),
        nnx.grad(nnx_loss, argnums=(0, 1))(seq, x)))(seq, params, jax.device_put(x_np))
    np.testing.assert_allclose(out_j, out_t.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gx, xt.grad.numpy(), rtol=1e-4, atol=1e-5)
    for (gw, gb), m in zip(gp, linears, strict=True):
        np.testing.assert_allclose(gw, m.weight.grad.numpy(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(gb, m.bias.grad.numpy(), rtol=1e-4, atol=1e-5)

    np.testing.assert_allclose(gx2, xt.grad.numpy(), rtol=1e-4, atol=1e-5)
    for j, m in enumerate(linears):
        g = grads["layers"][2 * j]
        np.testing.assert_allclose(g["kernel"][...], m.weight.grad.numpy().T, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(g["bias"][...], m.bias.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_pytorch_rejects_what_we_reject():
    # the bounds on segments are PyTorch's too (it fails, less clearly, past them)
    torch = pytest.importorskip("torch")
    from torch.utils.checkpoint import checkpoint_sequential as torch_cs

    fs = [torch.nn.Tanh(), torch.nn.Tanh()]
    with pytest.raises(ValueError):
        torch_cs(fs, 3, torch.zeros(2), use_reentrant=False)
    with pytest.raises(ValueError):
        checkpoint_sequential([jnp.tanh, jnp.tanh], 3, jnp.zeros(2))
