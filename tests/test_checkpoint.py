"""remat.checkpoint on plain JAX functions: every form, composition with transforms,
pass-through arguments, PyTorch keywords and bad input."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    assert_clean_error,
    assert_trees_close,
    nonarg_residuals,
    num_residuals,
    remat_count,
    residual_bytes,
)

from remat import checkpoint

W = jax.random.normal(jax.random.key(0), (4, 4)) * 0.5
X = jax.random.normal(jax.random.key(1), (3, 4))


def block(w, x):
    h = jnp.tanh(x @ w)
    h = jnp.sin(h @ w) * h
    return jnp.cos(h @ w)


def loss_plain(w, x):
    return jnp.sum(block(w, x))


# --- the forms ----------------------------------------------------------------------------

def _call_form(w, x):
    return jnp.sum(checkpoint(block, w, x))


_wrapped = checkpoint(block)


def _wrap_form(w, x):
    return jnp.sum(_wrapped(w, x))


@checkpoint
def _decorated(w, x):
    return block(w, x)


def _decorator_form(w, x):
    return jnp.sum(_decorated(w, x))


@checkpoint(policy="nothing")
def _decorated_policy(w, x):
    return block(w, x)


def _decorator_policy_form(w, x):
    return jnp.sum(_decorated_policy(w, x))


def _kwargs_form(w, x):
    return jnp.sum(checkpoint(block, w=w, x=x))


def _zero_arg_form(w, x):
    return jnp.sum(checkpoint(lambda: block(w, x))())


FORMS = {
    "call": _call_form,
    "checkpoint(fn)": _wrap_form,
    "@checkpoint": _decorator_form,
    "@checkpoint(policy=)": _decorator_policy_form,
    "kwargs": _kwargs_form,
    "zero-arg": _zero_arg_form,
}


@functools.lru_cache(maxsize=None)
def _jitted_form_gradients():
    """Every form's jitted gradient, computed in one program (one compile, not one per form)."""
    return jax.jit(lambda w, x: {name: jax.grad(f, argnums=(0, 1))(w, x) for name, f in FORMS.items()})(W, X)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_forms_match_plain_gradients(form, jit):
    f = FORMS[form]
    grad_plain = jax.grad(loss_plain, argnums=(0, 1))
    assert_trees_close(f(W, X), loss_plain(W, X))
    grads = _jitted_form_gradients()[form] if jit else jax.grad(f, argnums=(0, 1))(W, X)
    assert_trees_close(grads, grad_plain(W, X))


@pytest.mark.parametrize("form", list(FORMS))
def test_forms_rematerialize(form):
    f = FORMS[form]
    assert remat_count(f, W, X) == 1
    assert remat_count(jax.grad(f), W, X) >= 1
    assert num_residuals(f, W, X) < num_residuals(loss_plain, W, X)
    assert residual_bytes(f, W, X) < residual_bytes(loss_plain, W, X)
    # only the inputs are kept (the zero-arg form closes over them, which JAX saves too)
    assert nonarg_residuals(f, W, X) == [] or form == "zero-arg"
    assert not any(d.startswith("output of") for _, d in nonarg_residuals(f, W, X))


def test_plain_function_has_no_remat_and_keeps_intermediates():
    # the control for the tests above: without checkpoint intermediates are kept
    assert remat_count(loss_plain, W, X) == 0
    assert len(nonarg_residuals(loss_plain, W, X)) >= 4


def test_vjp_form():
    out, vjp = jax.vjp(lambda w, x: checkpoint(block, w, x), W, X)
    out0, vjp0 = jax.vjp(block, W, X)
    ct = jnp.ones_like(out)
    assert_trees_close(out, out0)
    assert_trees_close(vjp(ct), vjp0(ct))


def test_outside_autodiff_is_a_plain_call():
    np.testing.assert_allclose(checkpoint(block, W, X), block(W, X), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(_wrapped)(W, X), block(W, X), rtol=1e-6)


def test_decorator_keeps_metadata():
    @checkpoint
    def my_fn(x):
        """doc"""
        return x

    assert my_fn.__name__ == "my_fn"
    assert my_fn.__doc__ == "doc"


def test_checkpoint_of_checkpointed_function():
    f = checkpoint(checkpoint(block))
    assert_trees_close(jax.grad(lambda w: f(w, X).sum())(W), jax.grad(lambda w: block(w, X).sum())(W))


# --- composition with transforms --------------------------------------------------------------

def _f1(x):
    return jnp.sum(jnp.sin(jnp.sin(x)) * x)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_vmap_of_grad_and_grad_of_vmap(jit):
    xs = jax.device_put(np.random.default_rng(2).standard_normal((5, 3)).astype(np.float32))
    a = jax.vmap(jax.grad(lambda x: checkpoint(_f1, x)))
    b = jax.grad(lambda xs: jax.vmap(checkpoint(_f1))(xs).sum())
    if jit:
        a, b = jax.jit(a), jax.jit(b)
    expected = jax.vmap(jax.grad(_f1))(xs)
    assert_trees_close(a(xs), expected)
    assert_trees_close(b(xs), expected)


def test_vmap_still_rematerializes():
    xs = jnp.ones((5, 3))
    f = lambda xs: jax.vmap(checkpoint(_f1))(xs).sum()  # noqa: E731
    g = lambda xs: jax.vmap(_f1)(xs).sum()  # noqa: E731
    assert remat_count(f, xs) == 1
    assert num_residuals(f, xs) < num_residuals(g, xs)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_grad_of_grad(jit):
    f = lambda x: checkpoint(lambda y: jnp.sin(y) ** 3 * jnp.exp(y), x)  # noqa: E731
    g = lambda x: jnp.sin(x) ** 3 * jnp.exp(x)  # noqa: E731
    d2 = jax.grad(jax.grad(f))
    if jit:
        d2 = jax.jit(d2)
    np.testing.assert_allclose(d2(0.7), jax.grad(jax.grad(g))(0.7), rtol=1e-5)


def test_hessian():
    x = jnp.array([0.3, -0.5, 1.2])
    np.testing.assert_allclose(
        jax.jit(jax.hessian(lambda x: checkpoint(_f1, x)))(x), jax.jit(jax.hessian(_f1))(x), rtol=1e-5, atol=1e-6
    )


def test_nested_checkpoints():
    def inner(x):
        return jnp.sin(jnp.sin(x))

    def outer(x):
        return jnp.sum(checkpoint(inner, jnp.cos(x)) * x)

    def plain(x):
        return jnp.sum(jnp.sin(jnp.sin(jnp.cos(x))) * x)

    x = jnp.array([0.1, 0.2, 0.3])
    f = lambda x: checkpoint(outer, x)  # noqa: E731
    assert_trees_close(jax.grad(f)(x), jax.grad(plain)(x))
    assert_trees_close(jax.jit(jax.grad(f))(x), jax.grad(plain)(x))
    assert remat_count(f, x) == 2
    assert nonarg_residuals(f, x) == []
    # checkpointing only the inner part keeps the outer cos(x) (and nothing of inner)
    assert len(nonarg_residuals(outer, x)) >= 1
    assert len(nonarg_residuals(outer, x)) < len(nonarg_residuals(plain, x))


def test_jit_inside_checkpoint():
    f = lambda x: checkpoint(jax.jit(_f1), x)  # noqa: E731
    x = jnp.array([0.4, 0.5])
    assert_trees_close(jax.grad(f)(x), jax.grad(_f1)(x))
    assert nonarg_residuals(f, x) == []


def test_random_key_argument_recomputes_same_values():
    def noisy(x, key):
        return jnp.sum(jnp.sin(x * jax.random.normal(key, x.shape)))

    key = jax.random.key(3)
    x = jnp.ones(4)
    g = jax.grad(lambda x: checkpoint(noisy, x, key))(x)
    assert_trees_close(g, jax.grad(noisy)(x, key))
    assert_trees_close(jax.jit(jax.grad(lambda x: checkpoint(noisy, x, key)))(x), g)


# --- arguments and outputs ------------------------------------------------------------------

def test_non_array_arguments_pass_through():
    calls = []

    def f(x, mode, scale=None, act=jnp.sin, cfg=None, flag=True):
        calls.append((mode, flag))
        assert isinstance(mode, str) and isinstance(flag, bool) and callable(act)
        y = act(x) * (1.0 if scale is None else scale)
        if mode == "double":  # Python control flow on a non-array argument
            y = y * 2
        if cfg["square"]:
            y = y ** 2
        return y.sum()

    x = jnp.array([0.1, 0.5, 0.9])
    for mode in ("double", "single"):
        for cfg in ({"square": True}, {"square": False}):
            ck = jax.grad(lambda x, mode=mode, cfg=cfg: checkpoint(f, x, mode, None, act=jnp.cos, cfg=cfg,
                                                                   flag=False))(x)
            pl = jax.grad(lambda x, mode=mode, cfg=cfg: f(x, mode, None, act=jnp.cos, cfg=cfg, flag=False))(x)
            assert_trees_close(ck, pl)
    assert ("double", False) in calls and ("single", False) in calls


def test_python_scalar_argument_and_gradient_through_it():
    f = lambda x, s: jnp.sum(jnp.sin(x) * s)  # noqa: E731
    x = jnp.array([0.3, 0.6])
    assert_trees_close(jax.grad(lambda x: checkpoint(f, x, 2.0))(x), 2.0 * jnp.cos(x))
    # a scalar that jax.grad traces is an array, and gets its gradient
    np.testing.assert_allclose(jax.grad(lambda s: checkpoint(f, x, s))(2.0), jnp.sin(x).sum(), rtol=1e-6)


def test_integer_array_argument():
    f = lambda i, x: jnp.sin(x[i])  # noqa: E731
    x = jnp.array([0.1, 0.2, 0.3])
    g = jax.grad(lambda x: checkpoint(f, jnp.array(1), x))(x)
    np.testing.assert_allclose(g, [0.0, np.cos(0.2), 0.0], rtol=1e-6)


def test_static_argnums_drives_python_control_flow():
    def f(x, n):
        for _ in range(int(n)):
            x = jnp.sin(x)
        return x.sum()

    x = jnp.array([0.5, 1.0])
    for n in (np.int32(1), np.int32(3), np.array(2)):
        g = jax.grad(lambda x, n=n: checkpoint(f, x, n, static_argnums=1))(x)
        assert_trees_close(g, jax.grad(lambda x, n=n: f(x, int(n)))(x))
        gj = jax.jit(jax.grad(lambda x, n=n: checkpoint(f, x, n, static_argnums=(1,))))(x)
        assert_trees_close(gj, g)
    # without static_argnums the array is traced and int() fails: static_argnums is needed
    with pytest.raises(jax.errors.ConcretizationTypeError):
        jax.jit(lambda x, n: checkpoint(f, x, n))(x, np.int32(2))


def test_static_argnums_decorator_form():
    @checkpoint(static_argnums=(1,))
    def f(x, power):
        return jnp.sum(x ** int(power))

    x = jnp.array([1.0, 2.0])
    np.testing.assert_allclose(jax.grad(f)(x, np.array(3)), 3 * x ** 2, rtol=1e-6)


def test_pytree_outputs_with_non_arrays():
    def f(x):
        return {"y": jnp.sin(x), "none": None, "s": "tag", "n": 3, "pair": (x.sum(), [jnp.cos(x)])}

    x = jnp.array([0.2, 0.4])
    out = checkpoint(f, x)
    assert out["none"] is None and out["s"] == "tag" and out["n"] == 3
    np.testing.assert_allclose(out["pair"][1][0], jnp.cos(x), rtol=1e-6)

    def loss(x):
        o = checkpoint(f, x)
        return o["y"].sum() + o["pair"][0] * o["n"] + o["pair"][1][0].sum()

    def loss0(x):
        o = f(x)
        return o["y"].sum() + o["pair"][0] * o["n"] + o["pair"][1][0].sum()

    assert_trees_close(jax.grad(loss)(x), jax.grad(loss0)(x))
    assert_trees_close(jax.jit(jax.grad(loss))(x), jax.grad(loss0)(x))


def test_pytree_inputs():
    params = {"w": W, "layers": [W * 0.5, (W * 0.1,)]}

    def f(p, x):
        h = jnp.tanh(x @ p["w"])
        h = jnp.tanh(h @ p["layers"][0])
        return jnp.sum(jnp.sin(h @ p["layers"][1][0]))

    assert_trees_close(jax.grad(lambda p: checkpoint(f, p, X))(params), jax.grad(f)(params, X))
    assert nonarg_residuals(lambda p: checkpoint(f, p, X), params) == []


# --- PyTorch keywords -------------------------------------------------------------------------

PYTORCH_OPTIONS = [
    {"use_reentrant": True},
    {"use_reentrant": False},
    {"use_reentrant": None},
    {"preserve_rng_state": False},
    {"determinism_check": "none"},
    {"early_stop": False},
    {"use_reentrant": True, "preserve_rng_state": False, "early_stop": False},
]


def _options_loss(options):
    return lambda w, x: jnp.sum(checkpoint(block, w, x, **options))


@functools.lru_cache(maxsize=None)
def _jitted_options_gradients():
    """Every option's jitted gradient, computed in one program (one compile, not one per option)."""
    return jax.jit(lambda w, x: [jax.grad(_options_loss(o))(w, x) for o in PYTORCH_OPTIONS])(W, X)


@pytest.mark.parametrize("options", PYTORCH_OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_pytorch_keywords_give_exact_gradients_and_rematerialize(options):
    f = _options_loss(options)
    assert_trees_close(jax.grad(f, argnums=(0, 1))(W, X), jax.grad(loss_plain, argnums=(0, 1))(W, X))
    assert_trees_close(_jitted_options_gradients()[PYTORCH_OPTIONS.index(options)], jax.grad(loss_plain)(W, X))
    assert nonarg_residuals(f, W, X) == []
    assert remat_count(f, W, X) == 1


def test_prevent_cse_false():
    f = lambda w, x: jnp.sum(checkpoint(block, w, x, prevent_cse=False))  # noqa: E731
    assert_trees_close(jax.grad(f)(W, X), jax.grad(loss_plain)(W, X))
    jaxpr = jax.make_jaxpr(f)(W, X)
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name in ("checkpoint", "remat", "remat2")]
    assert eqn.params["prevent_cse"] is False


def test_debug_prints_a_report(capsys):
    g = jax.grad(lambda w: jnp.sum(checkpoint(block, w, X, debug=True)))(W)
    assert_trees_close(g, jax.grad(loss_plain)(W, X))
    err = capsys.readouterr().err
    assert "remat.checkpoint(debug=True)" in err
    assert "block" in err
    assert "no report" not in err, err


# --- bad input --------------------------------------------------------------------------------

def _never_traced(*_a, **_k):
    raise AssertionError("the function was traced although the options were invalid")


BAD_INPUTS = [
    # (call, exception type, fragments the one-line message must contain)
    (lambda: checkpoint(X, jnp.sin), TypeError, ["ArrayImpl", "function comes first"]),
    (lambda: checkpoint(3), TypeError, ["expects a function", "int"]),
    (lambda: checkpoint("block", X), TypeError, ["expects a function", "str"]),
    (lambda: checkpoint(None, X), TypeError, ["expects a function", "NoneType"]),
    (lambda: checkpoint(_never_traced, X, policy="bogus"), ValueError,
     ["'bogus'", "'nothing'", "'everything'", "'dots'", "'dots_no_batch'"]),
    (lambda: checkpoint(policy="bogus"), ValueError, ["unknown policy"]),
    (lambda: checkpoint(_never_traced, X, policy=3), TypeError, ["policy must be"]),
    (lambda: checkpoint(_never_traced, X, policy=[]), TypeError, ["non-empty list"]),
    (lambda: checkpoint(_never_traced, X, policy=["a", 1]), TypeError, ["checkpoint names"]),
    (lambda: checkpoint(_never_traced, X, context_fn=lambda: None), TypeError, ["policy="]),
    (lambda: checkpoint(_never_traced, X, use_reentrant=True, policy="dots"), ValueError,
     ["use_reentrant=False"]),
    (lambda: checkpoint(_never_traced, X, use_reentrant=True, debug=True), ValueError,
     ["use_reentrant=False"]),
    (lambda: checkpoint(_never_traced, X, use_reentrant="yes"), TypeError, ["use_reentrant"]),
    (lambda: checkpoint(_never_traced, X, determinism_check="strict"), ValueError,
     ["'default'", "'none'"]),
    (lambda: checkpoint(_never_traced, X, preserve_rng_state=1), TypeError, ["preserve_rng_state"]),
    (lambda: checkpoint(_never_traced, X, debug="yes"), TypeError, ["debug"]),
    (lambda: checkpoint(_never_traced, X, early_stop=None), TypeError, ["early_stop"]),
    (lambda: checkpoint(_never_traced, X, static_argnums=-1), ValueError, ["static_argnums"]),
    (lambda: checkpoint(_never_traced, X, static_argnums="a"), ValueError, ["static_argnums"]),
    (lambda: checkpoint(_never_traced, X, static_argnums=3), ValueError,
     ["static_argnums", "1 positional"]),
    (lambda: checkpoint(_never_traced, static_argnums=0)(), ValueError, ["static_argnums"]),
]


@pytest.mark.parametrize("call,exc,fragments", BAD_INPUTS, ids=range(len(BAD_INPUTS)))
def test_bad_input_clear_error(call, exc, fragments):
    with pytest.raises(exc) as excinfo:
        call()
    assert_clean_error(excinfo, *fragments)


def test_one_keyword_list_for_every_entry_point():
    """checkpoint, checkpoint_sequential and apply_checkpointing take the keywords of one specification."""
    import dataclasses
    import inspect

    from flax import nnx

    import remat
    from remat._core.options import KEYWORDS, CheckpointKeywords, normalize_options

    params = inspect.signature(checkpoint).parameters  # what help(remat.checkpoint) shows
    assert [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY] == list(KEYWORDS)
    defaults = {f.name: f.default for f in dataclasses.fields(CheckpointKeywords)}
    assert {n: params[n].default for n in KEYWORDS} == defaults
    assert normalize_options() == normalize_options(**defaults)
    # a keyword that is not checkpoint's goes to the function, as in torch.utils.checkpoint
    assert checkpoint(lambda x, *, scale: x * scale, X, scale=2.0).shape == X.shape
    # the other entry points name the same list in their errors
    for call in (lambda: remat.checkpoint_sequential([jnp.sin], 1, X, polcy="dots"),
                 lambda: remat.apply_checkpointing(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), nnx.Linear, polcy="dots")):
        with pytest.raises(TypeError) as excinfo:
            call()
        assert_clean_error(excinfo, "polcy", "prevent_cse", "preserve_rng_state")


def test_bad_input_under_grad_and_jit_is_still_clean():
    # raised while an outer transform traces: still ours, still one line
    with pytest.raises(ValueError) as excinfo:
        jax.jit(jax.grad(lambda x: checkpoint(_never_traced, x, policy="bogus")))(X)
    assert "unknown policy" in str(excinfo.value)
    assert type(excinfo.value) is ValueError


def test_functools_partial_with_static_argnums():
    import functools

    def f(n, x, scale):
        for _ in range(int(n)):
            x = jnp.sin(x)
        return jnp.sum(x * scale)

    x = jnp.array([0.3, 0.9])
    # static_argnums counts the partial's own call arguments (x is 0, scale is 1), as in jax.checkpoint
    g = jax.jit(jax.grad(lambda x: checkpoint(functools.partial(f, 2), x, np.float32(3.0), static_argnums=(1,))))(x)
    assert_trees_close(g, jax.grad(lambda x: f(2, x, 3.0))(x))
    # a partial's arguments are call arguments: Python values pass through, arrays are traced
    g2 = jax.grad(lambda x: checkpoint(functools.partial(f, 2, scale=jnp.float32(3.0)), x))(x)
    assert_trees_close(g2, g)
    gs = jax.grad(lambda s: checkpoint(functools.partial(f, 2, scale=s), x))(3.0)
    np.testing.assert_allclose(gs, jnp.sum(jnp.sin(jnp.sin(x))), rtol=1e-6)
    assert nonarg_residuals(lambda x: checkpoint(functools.partial(f, 2, scale=3.0), x), x) == []
