"""remat.ops.scaled_dot_product_attention: PyTorch's call, computed in tiles (flash attention)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DEFAULT_COMPILE
from jax.test_util import check_grads

from remat import checkpoint, ops
from remat.analysis import saved_residuals


def _reference(q, k, v, mask=None, causal=False, gqa=False):
    """The attention written out: the whole [..., L, S] scores, softmax, then @ v."""
    if gqa:
        group = q.shape[-3] // k.shape[-3]
        k, v = jnp.repeat(k, group, -3), jnp.repeat(v, group, -3)
    s = jnp.einsum("...qe,...ke->...qk", q, k, precision="highest") * q.shape[-1] ** -0.5
    if causal:
        s = jnp.where(jnp.tri(*s.shape[-2:], dtype=bool), s, -jnp.inf)
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf) if mask.dtype == bool else s + mask
    p = jax.nn.softmax(s, -1)
    return jnp.einsum("...qk,...ke->...qe", jnp.where(jnp.isnan(p), 0.0, p), v, precision="highest")


_rng = np.random.default_rng(0)

#: for a program whose run, not its compile, is the cost: XLA:CPU's backend at level 1 (conftest
#: compiles at level 0, whose code runs many times slower)
RUN_FAST = {"xla_backend_optimization_level": 1}


CASES = {
    "plain": dict(q=(2, 3, 10, 4), k=(2, 3, 10, 4), v=(2, 3, 10, 5), chunk=4),
    "causal": dict(q=(2, 3, 10, 4), k=(2, 3, 10, 4), v=(2, 3, 10, 5), chunk=4, causal=True),
    "causal one tile": dict(q=(1, 2, 9, 4), k=(1, 2, 9, 4), v=(1, 2, 9, 4), chunk=128, causal=True),
    "causal, keys longer": dict(q=(1, 2, 5, 4), k=(1, 2, 11, 4), v=(1, 2, 11, 4), chunk=3, causal=True),
    "fewer keys, chunk 3": dict(q=(2, 3, 10, 4), k=(2, 3, 7, 4), v=(2, 3, 7, 5), chunk=3),
    "causal, tiles (4, 3)": dict(q=(1, 2, 10, 4), k=(1, 2, 10, 4), v=(1, 2, 10, 4), chunk=(4, 3), causal=True),
    "causal, tiles (2, 5)": dict(q=(1, 2, 10, 4), k=(1, 2, 10, 4), v=(1, 2, 10, 4), chunk=(2, 5), causal=True),
    "gqa causal": dict(q=(2, 6, 10, 4), k=(2, 3, 13, 4), v=(2, 3, 13, 5), chunk=4, gqa=True, causal=True),
    "gqa float mask per head": dict(q=(2, 6, 10, 4), k=(2, 3, 13, 4), v=(2, 3, 13, 5), chunk=4, gqa=True,
                                    mask=("normal", (1, 6, 10, 13))),
    "gqa padding mask": dict(q=(2, 6, 10, 4), k=(2, 3, 13, 4), v=(2, 3, 13, 5), chunk=5, gqa=True,
                             mask=("normal", (2, 1, 1, 13))),
    "bool mask (L, S)": dict(q=(2, 3, 10, 4), k=(2, 3, 13, 4), v=(2, 3, 13, 5), chunk=4, mask=("bool", (10, 13))),
    "rows with no key": dict(q=(2, 3, 10, 4), k=(2, 3, 13, 4), v=(2, 3, 13, 5), chunk=4,
                             mask=("sparse", (2, 1, 10, 13))),
    "no batch axes": dict(q=(10, 4), k=(13, 4), v=(13, 5), chunk=64, mask=("normal", (10, 13))),
}


def _host(x, dtype=None):
    """A NumPy array on the device, cast by NumPy: put there as it is (jnp.asarray compiles a
    program for each shape, and a cast another)."""
    return jax.device_put(np.asarray(x, dtype))


def _draw(case, dtype):
    q, k, v = (_host(_rng.normal(size=case[n]), dtype) for n in "qkv")
    mask = None
    if "mask" in case:
        kind, shape = case["mask"]
        mask = {"normal": lambda: _host(_rng.normal(size=shape), dtype),
                "bool": lambda: jnp.asarray(_rng.random(shape) > 0.3),
                "sparse": lambda: jnp.asarray(_rng.random(shape) > 0.9)}[kind]()
    return q, k, v, mask


def _both(case):
    def tiled(q, k, v, mask):
        return ops.scaled_dot_product_attention(q, k, v, mask, is_causal=case.get("causal", False),
                                                enable_gqa=case.get("gqa", False), chunk=case["chunk"])

    def whole(q, k, v, mask):
        return _reference(q, k, v, mask, case.get("causal", False), case.get("gqa", False))

    return tiled, whole


#: the default run: these, which between them take every path but one (causal tiles that are not
#: square, in float64; grouped heads with a float mask and its gradient); the rest are marked slow.
#: A boolean mask with rows that attend to nothing is checked in the default run by
#: test_a_query_no_key_may_attend_to_gets_zeros_and_zero_gradients (its value and gradient), and
#: grouped heads with causal tiles by the bfloat16 and PyTorch tests below.
FAST = {jnp.float32: ("gqa float mask per head",),
        jnp.float64: ("causal, tiles (4, 3)",)}


@pytest.mark.parametrize("name, dtype", [
    pytest.param(name, dtype, marks=() if name in FAST[dtype] else pytest.mark.slow)
    for dtype in (jnp.float32, jnp.float64) for name in CASES])
def test_values_and_gradients_equal_the_whole_softmax(name, dtype):
    with jax.enable_x64(dtype == jnp.float64):
        _check_values_and_gradients(CASES[name], dtype)


def _value_and_pullback(f, wrt, compiler_options=None):
    """``f``'s output and the gradient of ``sum(f(...) * cotangent)`` over ``wrt``, from one compiled
    program (the forward is a part of the backward's program; compiled apart it costs a compile more)."""
    def run(cotangent, *args):
        out, pull = jax.vjp(lambda *d: f(*(d[wrt.index(i)] if i in wrt else a for i, a in enumerate(args))),
                            *(args[i] for i in wrt))
        return out, pull(cotangent.astype(out.dtype))
    return jax.jit(run, compiler_options=compiler_options)


def _check_values_and_gradients(case, dtype):
    q, k, v, mask = _draw(case, dtype)
    tiled, whole = _both(case)
    wrt = (0, 1, 2, 3) if mask is not None and mask.dtype != bool else (0, 1, 2)
    out_shape = (*q.shape[:-1], v.shape[-1])
    cotangent = _host(_rng.normal(size=out_shape), dtype)
    out, got = _value_and_pullback(tiled, wrt)(cotangent, q, k, v, mask)
    # the reference compiled too: run eagerly, its dozens of primitives each compile alone
    expected, want = _value_and_pullback(whole, wrt)(cotangent, q, k, v, mask)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5 if dtype == jnp.float32 else 1e-12)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 if dtype == jnp.float32 else 1e-12)
    assert np.all(np.isfinite(np.asarray(got[0])))


def test_a_query_no_key_may_attend_to_gets_zeros_and_zero_gradients():
    q, k, v = (_host(np.ones((1, 4, 3)), jnp.float32) for _ in range(3))  # made by NumPy: no eager compiles
    mask = _host(np.array([[True] * 5, [False] * 5, [True] * 5, [False] * 5])[None, :, :4])
    # the output and the gradient of its sum, one compiled program (eager, each operation compiles alone)
    out, (dq,) = _value_and_pullback(lambda q: ops.scaled_dot_product_attention(q, k, v, mask, chunk=2), (0,))(
        _host(np.ones((1, 4, 3)), jnp.float32), q)
    np.testing.assert_array_equal(np.asarray(out)[0, 1], 0.0)  # indexed by NumPy: no eager compiles
    np.testing.assert_array_equal(np.asarray(dq)[0, 3], 0.0)


def test_bfloat16_stays_within_one_rounding_of_the_float32_result():
    case = CASES["gqa causal"] | {"q": (2, 6, 64, 16), "k": (2, 3, 64, 16), "v": (2, 3, 64, 16), "chunk": 16}
    q, k, v, _ = _draw(case, jnp.float32)
    tiled, whole = _both(case)
    low = [_host(a, jnp.bfloat16) for a in (q, k, v)]
    # the output and the gradient of its float32 sum (a cotangent of ones), one compiled program;
    # at XLA's default compile, whose fusions decide where bfloat16 rounds
    out, grads = _value_and_pullback(lambda *a: tiled(*a, None), (0, 1, 2), DEFAULT_COMPILE)(
        _host(np.ones(q.shape), jnp.float32), *low)
    assert out.dtype == jnp.bfloat16
    # both references from one program: the whole softmax on the bfloat16 inputs, and its float32 gradient
    reference, exact = jax.jit(lambda *a: (whole(*a, None), jax.grad(lambda *a: whole(*a, None).sum(), (0, 1, 2))(
        *(x.astype(jnp.float32) for x in a))), compiler_options=DEFAULT_COMPILE)(*low)
    # compared in NumPy (in jnp, each eager operation compiles alone)
    np.testing.assert_allclose(np.asarray(out, np.float32), reference, atol=2e-2, rtol=2e-2)
    for g, w in zip(grads, exact, strict=True):
        assert g.dtype == jnp.bfloat16
        g, w = np.asarray(g, np.float32), np.asarray(w)
        scale = float(np.abs(w).max())
        assert float(np.abs(g - w).max()) < 3e-2 * scale


def test_the_scores_are_never_kept_and_the_compiled_temp_is_far_smaller():
    b, h, length, e = 1, 4, 1024, 32
    q = k = v = _host(np.zeros((b, h, length, e)), jnp.float32)
    scores_bytes = b * h * length * length * 4

    def loss(attention):
        return lambda q, k, v: attention(q, k, v).sum()

    def tiled(q, k, v):
        return ops.scaled_dot_product_attention(q, k, v, is_causal=True, chunk=128)

    def whole(q, k, v):
        return _reference(q, k, v, causal=True)

    saved = saved_residuals(loss(tiled), q, k, v)
    assert saved and all(np.prod(r.shape) < length * length for r in saved), saved
    temp = {name: jax.jit(jax.grad(loss(f), (0, 1, 2))).lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
            for name, f in (("tiled", tiled), ("whole", whole))}
    assert temp["tiled"] < scores_bytes / 4 < temp["whole"], temp


# "nothing" in the default run; "dots" slow (the same attention backward, recomputed inside the checkpoint)
@pytest.mark.parametrize("policy", ["nothing", pytest.param("dots", marks=pytest.mark.slow)])
def test_composes_with_checkpoint_and_scan(policy):
    q, k, v, _ = _draw(CASES["gqa causal"], jnp.float32)

    def layer(x, _, attention=ops.scaled_dot_product_attention):
        y = attention(x, k, v, is_causal=True, enable_gqa=True, chunk=4)
        return jnp.tanh(y[..., :4] + x), None

    def whole(q, k, v, **_):
        return _reference(q, k, v, causal=True, gqa=True)

    def stack(x, body):
        return jax.lax.scan(body, x, None, length=3)[0].sum()

    # the plain scan of the whole softmax: a cheaper program to compile than the tiles' plain scan
    want = jax.jit(jax.grad(lambda x: stack(x, lambda x, _: layer(x, _, whole))))(q)
    got = jax.jit(jax.grad(lambda x: stack(x, checkpoint(layer, policy=policy))))(q)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_composes_with_vmap():
    q, k, _, _ = _draw(CASES["gqa causal"], jnp.float32)
    per_batch = jax.vmap(lambda q, k, v: ops.scaled_dot_product_attention(q, k, v, is_causal=True, chunk=4))
    qs, ks, vs = (_host(np.asarray(a).reshape(-1, *a.shape[-2:])[:3]) for a in (q, k, k))  # sliced by NumPy
    causal_reference = jax.jit(lambda q, k, v: _reference(q, k, v, causal=True))
    np.testing.assert_allclose(jax.jit(per_batch)(qs, ks, vs),
                               causal_reference(qs, ks, vs), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_dropout_is_deterministic_per_key_and_its_gradient_is_exact():
    with jax.enable_x64(True):  # the numerical gradient check needs float64
        _check_dropout()


def _check_dropout():
    q, k, v, _ = _draw(CASES["causal"], jnp.float64)
    rng = jax.random.key(3)

    def attend(q, k, v, key=rng):
        return ops.scaled_dot_product_attention(q, k, v, dropout_p=0.25, is_causal=True, dropout_rng=key, chunk=4)

    np.testing.assert_array_equal(attend(q, k, v), attend(q, k, v))
    assert not np.allclose(attend(q, k, v), attend(q, k, v, jax.random.key(4)))
    assert not np.allclose(attend(q, k, v), _reference(q, k, v, causal=True))
    check_grads(attend, (q, k, v), order=1, modes=["rev"])


def test_dropout_keeps_the_expected_value():
    q, k, v, _ = _draw(CASES["plain"] | {"q": (1, 1, 64, 4), "k": (1, 1, 64, 4), "v": (1, 1, 64, 4)}, jnp.float32)
    # one compiled program: the keys, the 400 outputs' mean and the reference (eager, the batched
    # loops' operations, the keys and the mean each compile alone); 2 x 2 tiles of 32 (4 x 4 tiles
    # of 16 unroll into twice the compile)
    # at XLA's level 1: at conftest's level 0 the 400 attentions run 1.5-2 s, at level 1 under 0.1 s,
    # for about 0.6 s more compile
    mean, expected = jax.jit(lambda: (jax.vmap(lambda key: ops.scaled_dot_product_attention(
        q, k, v, dropout_p=0.5, dropout_rng=key, chunk=32))(jax.random.split(jax.random.key(0), 400)).mean(0),
        _reference(q, k, v)), compiler_options=RUN_FAST)()
    np.testing.assert_allclose(mean, expected, atol=0.1)


@pytest.mark.parametrize("call, message", [
    (lambda q: ops.scaled_dot_product_attention(q, q[..., :3], q), "must be"),
    (lambda q: ops.scaled_dot_product_attention(q, q, q, jnp.ones((4, 4), bool), is_causal=True), "not both"),
    (lambda q: ops.scaled_dot_product_attention(q, q, q, dropout_p=0.1), "needs dropout_rng"),
    (lambda q: ops.scaled_dot_product_attention(q, q, q, dropout_p=1.0), "dropout_p must be"),
    (lambda q: ops.scaled_dot_product_attention(q, q, q, chunk=0), "chunk must be"),
    (lambda q: ops.scaled_dot_product_attention(q, q, q, jnp.ones((3, 5))), "does not broadcast"),
    (lambda q: ops.scaled_dot_product_attention(q, q, q, jnp.ones((4, 4), jnp.int32)), "boolean or floating"),
    (lambda q: ops.scaled_dot_product_attention(q, q[:, :2], q[:, :2], enable_gqa=False), "do not broadcast"),
    (lambda q: ops.scaled_dot_product_attention(q[:, :3], q[:, :2], q[:, :2], enable_gqa=True), "multiple"),
])
def test_errors_are_one_line_and_name_the_argument(call, message):
    q = jnp.ones((2, 4, 4, 8))
    with pytest.raises(ValueError, match=message) as raised:
        call(q)
    assert "\n" not in str(raised.value)


# causal in the default run (torch's call with skipped tiles); the full attention with the
# slow cases (the default run compares it with the whole softmax: "gqa float mask per head")
@pytest.mark.parametrize("causal", [pytest.param(False, marks=pytest.mark.slow), True])
def test_matches_torch_scaled_dot_product_attention(causal):
    torch = pytest.importorskip("torch")
    q, k, v, _ = _draw(CASES["gqa causal"] | {"q": (2, 6, 33, 8), "k": (2, 3, 33, 8), "v": (2, 3, 33, 8)},
                       jnp.float32)
    tq, tk, tv = (torch.tensor(np.asarray(a), requires_grad=True) for a in (q, k, v))
    expected = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, enable_gqa=True)
    expected.pow(2).sum().backward()

    @jax.jit  # the output and the gradient of sum(out ** 2) from one program, not one per operation
    def out_and_grads(q, k, v):
        out, pull = jax.vjp(lambda *a: ops.scaled_dot_product_attention(*a, is_causal=causal, enable_gqa=True,
                                                                         chunk=16), q, k, v)
        return out, pull(2 * out)

    out, grads = out_and_grads(q, k, v)
    np.testing.assert_allclose(out, expected.detach().numpy(), rtol=1e-5, atol=1e-6)
    for g, t in zip(grads, (tq, tk, tv), strict=True):
        np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-4, atol=1e-5)
