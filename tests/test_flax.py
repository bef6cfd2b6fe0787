"""remat.checkpoint inside Flax: NNX submodules, methods and closures; Linen submodules,
methods, closures and classes; Dropout and BatchNorm state through checkpointed regions."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_clean_error, assert_trees_close, nonarg_residuals, remat_count
from flax import nnx

from remat import checkpoint

X = jax.random.normal(jax.random.key(1), (6, 4))


# --- NNX ----------------------------------------------------------------------------------

class NNXSub(nnx.Module):
    """fc2 -> BatchNorm -> relu -> Dropout: state (batch stats, RNG) and intermediates."""

    def __init__(self, rngs: nnx.Rngs, dropout: float):
        self.fc2 = nnx.Linear(8, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, h):
        return self.drop(nnx.relu(self.bn(self.fc2(h))))


class NNXBlock(nnx.Module):
    """fc1 -> tanh -> sub -> fc3 -> sin, with a choice of checkpoint form for ``sub``."""

    def __init__(self, form: str | None, rngs: nnx.Rngs, dropout: float = 0.5, policy=None):
        self.fc1 = nnx.Linear(4, 8, rngs=rngs)
        self.sub = NNXSub(rngs, dropout)
        self.fc3 = nnx.Linear(8, 4, rngs=rngs)
        self.form = form
        self.policy = policy

    def inner(self, h):
        return jnp.cos(self.sub(h))

    def __call__(self, x):
        h = jnp.tanh(self.fc1(x))
        sub = self.sub
        if self.form is None:
            h = self.inner(h)
        elif self.form == "submodule":
            h = jnp.cos(checkpoint(self.sub, h, policy=self.policy))
        elif self.form == "method":
            h = checkpoint(self.inner, h, policy=self.policy)
        elif self.form == "closure":
            h = checkpoint(lambda t: jnp.cos(self.sub.drop(nnx.relu(self.sub.bn(self.sub.fc2(t))))), h,
                           policy=self.policy)
        elif self.form == "closure-submodule":
            h = checkpoint(lambda t: jnp.cos(sub(t)), h, policy=self.policy)
        elif self.form == "module-arg":
            h = checkpoint(lambda m, t: m.inner(t), self, h, policy=self.policy)
        elif self.form == "decorator":
            h = checkpoint(policy=self.policy)(self.inner)(h)
        return jnp.sin(self.fc3(h))


NNX_FORMS = ["submodule", "method", "closure", "closure-submodule", "module-arg", "decorator"]


def _nnx_loss(model, x):
    return jnp.sum(model(x) ** 2)


def _nnx_run(form, jit, steps=1, **kw):
    model = NNXBlock(form, nnx.Rngs(0, dropout=1), **kw)
    grad_fn = nnx.grad(_nnx_loss)
    if jit:
        grad_fn = nnx.jit(grad_fn)
    grads = [grad_fn(model, X + i) for i in range(steps)]
    return grads, model


_REFERENCE: dict = {}


def _nnx_reference(jit):
    """The un-checkpointed model's two training steps (computed once per mode)."""
    if jit not in _REFERENCE:
        _REFERENCE[jit] = _nnx_run(None, jit, steps=2)
    return _REFERENCE[jit]


def _check_nnx_form(form, jit):
    (g0, g0b), m0 = _nnx_reference(jit)
    (g1, g1b), m1 = _nnx_run(form, jit, steps=2)
    # gradients equal: Dropout drew the same mask in the recomputation as without checkpoint
    assert_trees_close(g1, g0, rtol=1e-5, atol=1e-6)
    assert_trees_close(g1b, g0b, rtol=1e-5, atol=1e-6)
    # BatchNorm statistics updated exactly as without checkpoint (twice)
    assert_trees_close(nnx.state(m1, nnx.BatchStat), nnx.state(m0, nnx.BatchStat))
    assert not np.allclose(m1.sub.bn.mean[...], 0.0)
    # the RNG streams advanced the same way
    assert_trees_close(nnx.state(m1, nnx.RngState), nnx.state(m0, nnx.RngState))


# a module and a closure over self fast; every form is in test_nnx_forms_rematerialize (and the
# method form in test_nnx_dropout_is_active), the rest of this matrix is slow
@pytest.mark.parametrize("form", [
    f if f in ("submodule", "closure") else pytest.param(f, marks=pytest.mark.slow) for f in NNX_FORMS
])
def test_nnx_forms_gradients_dropout_and_batch_stats(form):
    _check_nnx_form(form, jit=True)


# slow (op by op); eager checkpoints in the fast suite: test_nnx_rngs_passed_as_argument,
# test_nnx_nested_checkpoints, test_nnx_vmap_over_checkpointed_module
@pytest.mark.slow
@pytest.mark.parametrize("form", ["method", "closure"])
def test_nnx_forms_eager(form):
    _check_nnx_form(form, jit=False)


def test_nnx_dropout_is_active():
    # the control: a different dropout stream gives different gradients
    (g0, _), _ = _nnx_reference(True)
    model = NNXBlock("method", nnx.Rngs(0, dropout=2))
    g2 = nnx.jit(nnx.grad(_nnx_loss))(model, X)
    assert not np.allclose(g2["fc1"]["kernel"][...], g0["fc1"]["kernel"][...], atol=1e-6)


def _nnx_functional(form, **kw):
    """A function of the parameters only (RNG keys and batch stats are not differentiable)."""
    model = NNXBlock(form, nnx.Rngs(0, dropout=1), **kw)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def f(params, x):
        return _nnx_loss(nnx.merge(graphdef, params, rest, copy=True), x)

    return f, params


@pytest.mark.parametrize("form", NNX_FORMS)
def test_nnx_forms_rematerialize(form):
    f0, s0 = _nnx_functional(None)
    f1, s1 = _nnx_functional(form)
    assert remat_count(f0, s0, X) == 0
    assert remat_count(f1, s1, X) == 1
    assert remat_count(jax.grad(f1), s1, X) >= 1
    assert len(nonarg_residuals(f1, s1, X)) < len(nonarg_residuals(f0, s0, X))


def test_nnx_policy_passes_through():
    f_nothing, s = _nnx_functional("method")
    f_every, _ = _nnx_functional("method", policy="everything")
    f_dots, _ = _nnx_functional("method", policy="dots")
    n = [len(nonarg_residuals(f, s, X)) for f in (f_nothing, f_dots, f_every)]
    assert n[0] < n[1] < n[2]


def test_nnx_rngs_passed_as_argument():
    class Blk(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(4, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.5)

        def __call__(self, x, rngs=None):
            return self.drop(jnp.tanh(self.fc(x)), rngs=rngs)

    m = Blk(nnx.Rngs(0))

    def loss(m, x, rngs, ck):
        y = checkpoint(m, x, rngs=rngs) if ck else m(x, rngs=rngs)
        return jnp.sum(y ** 2)

    r0, r1 = nnx.Rngs(dropout=7), nnx.Rngs(dropout=7)
    g0 = nnx.grad(loss)(m, X, r0, False)
    g1 = nnx.grad(loss)(m, X, r1, True)
    assert_trees_close(g1, g0)
    assert int(r0.dropout.count[...]) == int(r1.dropout.count[...]) == 1
    g2 = nnx.jit(nnx.grad(loss), static_argnums=3)(m, X, nnx.Rngs(dropout=7), True)
    assert_trees_close(g2, g0)


@pytest.mark.slow
def test_nnx_train_step_with_optimizer_matches_plain():
    def train(form):
        model = NNXBlock(form, nnx.Rngs(0, dropout=1), dropout=0.2)
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

        @nnx.jit
        def step(model, opt, x):
            loss, grads = nnx.value_and_grad(_nnx_loss)(model, x)
            opt.update(model, grads)
            return loss

        losses = [float(step(model, opt, X * (1 + 0.1 * i))) for i in range(3)]
        return losses, nnx.state(model)

    l0, s0 = train(None)
    l1, s1 = train("closure")
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    assert l0[2] != l0[0]
    assert_trees_close(s1, s0, rtol=1e-5, atol=1e-6)


def test_nnx_nested_checkpoints():
    class Outer(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(4, 4, rngs=rngs)
            self.b = nnx.Linear(4, 4, rngs=rngs)

        def inner(self, x):
            return jnp.tanh(self.b(x))

        def body(self, x):
            return checkpoint(self.inner, jnp.sin(self.a(x)))

        def __call__(self, x, ck=True):
            return checkpoint(self.body, x) if ck else jnp.tanh(self.b(jnp.sin(self.a(x))))

    m = Outer(nnx.Rngs(0))
    g1 = nnx.grad(lambda m: jnp.sum(m(X) ** 2))(m)
    g0 = nnx.grad(lambda m: jnp.sum(m(X, ck=False) ** 2))(m)
    assert_trees_close(g1, g0)
    gd, st = nnx.split(m)
    assert remat_count(lambda s: jnp.sum(nnx.merge(gd, s)(X)), st) == 2


def test_nnx_vmap_over_checkpointed_module():
    lin = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

    def loss(m, xs, ck):
        f = nnx.vmap(lambda m, x: jnp.sin(checkpoint(m, x) if ck else m(x)), in_axes=(None, 0))
        return jnp.sum(f(m, xs))

    assert_trees_close(nnx.grad(loss)(lin, X, True), nnx.grad(loss)(lin, X, False))


def test_nnx_returning_a_module_is_a_clear_error():
    with pytest.raises(TypeError) as excinfo:
        checkpoint(lambda x: nnx.Linear(4, 4, rngs=nnx.Rngs(0)), X)
    assert "return arrays" in str(excinfo.value)


# --- Linen --------------------------------------------------------------------------------

class LinenSub(nn.Module):
    """fc2 -> relu -> Dropout -> cos: intermediates worth recomputing, and RNG use."""

    def setup(self):
        self.fc2 = nn.Dense(8)
        self.drop = nn.Dropout(0.5)

    def __call__(self, h, train: bool):
        return jnp.cos(self.drop(nn.relu(self.fc2(h)), deterministic=not train))


class LinenBlock(nn.Module):
    form: str | None = None
    policy: object = None

    def setup(self):
        self.fc1 = nn.Dense(8)
        self.sub = LinenSub()
        self.fc3 = nn.Dense(4)

    def inner(self, h, train: bool):
        return jnp.sin(self.sub(h, train))

    def __call__(self, x, train: bool = True):
        h = jnp.tanh(self.fc1(x))
        if self.form is None:
            h = self.inner(h, train)
        elif self.form == "submodule":
            h = jnp.sin(checkpoint(self.sub, h, train, policy=self.policy))
        elif self.form == "method":
            h = checkpoint(self.inner, h, train, policy=self.policy)
        elif self.form == "method-kw":
            h = checkpoint(self.inner, h, train=train, policy=self.policy)
        elif self.form == "closure":
            h = checkpoint(lambda t: jnp.sin(self.sub(t, train)), h, policy=self.policy)
        elif self.form == "static":
            h = checkpoint(self.inner, h, train, static_argnums=(1,), policy=self.policy)
        return jnp.sin(self.fc3(h))


LINEN_FORMS = ["submodule", "method", "method-kw", "closure", "static"]
RNGS = {"dropout": jax.random.key(2)}


@pytest.fixture(scope="module")
def linen_params():
    # eager: its kernels' shapes are those of NNXBlock, whose initializer programs this reuses
    return LinenBlock().init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, X)


def _linen_loss(form, **kw):
    def loss(params, x=X, train=True):
        return jnp.sum(LinenBlock(form, **kw).apply(params, x, train, rngs=RNGS) ** 2)

    return loss


# the submodule fast (the method form: test_linen_dropout_is_active, test_linen_policy); the rest slow
@pytest.mark.parametrize("form", [f if f == "submodule" else pytest.param(f, marks=pytest.mark.slow)
                                  for f in LINEN_FORMS])
def test_linen_forms(form, linen_params):
    # same parameter tree
    p1 = LinenBlock(form).init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, X)
    assert_trees_close(p1, linen_params)
    f0, f1 = _linen_loss(None), _linen_loss(form)
    # one program for both sides (eager, op by op: test_linen_forms_eager)
    values, grads, deterministic = jax.jit(lambda p: (
        (f1(p), f0(p)), (jax.grad(f1)(p), jax.grad(f0)(p)),
        # non-array argument train=False takes the deterministic branch
        (f1(p, train=False), f0(p, train=False))))(linen_params)
    assert_trees_close(*values)
    assert_trees_close(*grads)
    assert_trees_close(*deterministic)
    # rematerialization happens
    assert remat_count(f0, linen_params) == 0
    assert remat_count(f1, linen_params) == 1
    assert remat_count(lambda p: jax.grad(f1)(p), linen_params) >= 1
    assert len(nonarg_residuals(f1, linen_params)) < len(nonarg_residuals(f0, linen_params))
    assert not any("LinenSub" in d for _, d in nonarg_residuals(f1, linen_params))
    assert any("LinenSub" in d for _, d in nonarg_residuals(f0, linen_params))


# slow (op by op); eager Linen checkpoints in the fast suite: test_linen_module_as_first_argument,
# test_linen_partial_of_bound_method, test_linen_class_gradients_and_remat
@pytest.mark.slow
@pytest.mark.parametrize("form", LINEN_FORMS)
def test_linen_forms_eager(form, linen_params):
    f0, f1 = _linen_loss(None), _linen_loss(form)
    assert_trees_close(f1(linen_params), f0(linen_params))
    assert_trees_close(jax.grad(f1)(linen_params), jax.grad(f0)(linen_params))
    assert_trees_close(f1(linen_params, train=False), f0(linen_params, train=False))


def test_linen_dropout_is_active(linen_params):
    f = _linen_loss("method")
    other_rngs = {"dropout": jax.random.key(9)}
    g, other = jax.jit(lambda p: (  # one program for both
        jax.grad(f)(p), jax.grad(lambda p: jnp.sum(LinenBlock("method").apply(p, X, True, rngs=other_rngs) ** 2))(p)
    ))(linen_params)
    assert not np.allclose(g["params"]["fc1"]["kernel"], other["params"]["fc1"]["kernel"])


def test_linen_policy(linen_params):
    n = [len(nonarg_residuals(_linen_loss("method", policy=p), linen_params)) for p in (None, "dots", "everything")]
    assert n[0] < n[1] < n[2]


class LinenBN(nn.Module):
    ck: bool

    def setup(self):
        self.fc = nn.Dense(4)
        self.bn = nn.BatchNorm(use_running_average=False, momentum=0.5)

    def body(self, x):
        return jnp.tanh(self.bn(self.fc(x)))

    def __call__(self, x):
        return checkpoint(self.body, x) if self.ck else self.body(x)


def test_linen_batchnorm_mutable_batch_stats():
    v = jax.jit(LinenBN(False).init)(jax.random.key(0), X)

    def run(ck):
        def loss(p):
            y, upd = LinenBN(ck).apply({"params": p, "batch_stats": v["batch_stats"]}, X, mutable=["batch_stats"])
            return jnp.sum(y ** 2), upd

        return jax.grad(loss, has_aux=True)(v["params"])

    (g0, u0), (g1, u1) = jax.jit(lambda: (run(False), run(True)))()  # one program for both sides
    assert_trees_close(g1, g0)
    assert_trees_close(u1, u0)
    assert not np.allclose(u1["batch_stats"]["bn"]["mean"], v["batch_stats"]["bn"]["mean"])

    def f(p):
        return LinenBN(True).apply({"params": p, "batch_stats": v["batch_stats"]}, X, mutable=["batch_stats"])[0].sum()

    assert remat_count(f, v["params"]) == 1


# --- Linen class form --------------------------------------------------------------------

class Top(nn.Module):
    dense: type = nn.Dense

    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(self.dense(8)(x))
        return self.dense(3, use_bias=False)(h)


def test_linen_class_param_tree_unchanged():
    # the inits compiled together (one program, not one eager dispatch per op)
    p0, p1, standalone, standalone0 = jax.jit(lambda key: (
        Top(nn.Dense).init(key, X), Top(checkpoint(nn.Dense)).init(key, X),
        checkpoint(nn.Dense)(3).init(key, X), nn.Dense(3).init(key, X)))(jax.random.key(0))
    assert set(p1["params"]) == {"Dense_0", "Dense_1"}
    assert_trees_close(p1, p0)
    # nn.remat renames the parameters; checkpoint(nn.Dense) does not
    p_remat = jax.eval_shape(Top(nn.remat(nn.Dense)).init, jax.random.key(0), X)
    assert set(p_remat["params"]) != {"Dense_0", "Dense_1"}
    # standalone too
    assert_trees_close(standalone, standalone0)
    assert checkpoint(nn.Dense).__name__ == "Dense"
    assert issubclass(checkpoint(nn.Dense), nn.Dense)


def test_linen_class_gradients_and_remat():
    p = Top(nn.Dense).init(jax.random.key(0), X)

    def loss(cls):
        return lambda p: jnp.sum(jnp.sin(Top(cls).apply(p, X)))

    d = checkpoint(nn.Dense)
    assert_trees_close(jax.grad(loss(d))(p), jax.grad(loss(nn.Dense))(p))
    assert_trees_close(jax.jit(jax.grad(loss(d)))(p), jax.grad(loss(nn.Dense))(p))
    assert remat_count(loss(d), p) == 2
    assert remat_count(lambda p: jax.grad(loss(d))(p), p) >= 2
    assert remat_count(loss(nn.Dense), p) == 0
    assert remat_count(loss(checkpoint(policy="dots")(nn.Dense)), p) == 2


class TrainMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool, mode: str = "tanh"):
        h = nn.Dense(8)(x)
        h = jnp.tanh(h) if mode == "tanh" else jnp.sin(h)
        h = nn.Dropout(0.5, deterministic=not train)(h)
        return nn.Dense(2)(h)


def test_linen_class_traces_python_bools_like_nn_remat():
    """The class form follows nn.remat: a Python bool is traced unless static_argnums names it."""
    with pytest.raises(jax.errors.TracerBoolConversionError):
        checkpoint(TrainMLP)().init(jax.random.key(0), X, False)
    with pytest.raises(jax.errors.TracerBoolConversionError):
        nn.remat(TrainMLP)().init(jax.random.key(0), X, False)


@pytest.mark.slow
def test_linen_class_static_argnums_count_self_like_nn_remat():
    """static_argnums=(2,) is `train` in both: self is position 0."""
    Ck = checkpoint(TrainMLP, static_argnums=(2,))
    p0 = TrainMLP().init(jax.random.key(0), X, False)
    p1 = Ck().init(jax.random.key(0), X, False)
    assert_trees_close(p1, p0)
    for train in (False, True):
        for mode in ("tanh", "sin"):
            def loss(cls, p, train=train, mode=mode):
                return jnp.sum(cls().apply(p, X, train, mode, rngs=RNGS) ** 2)

            assert_trees_close(loss(Ck, p0), loss(TrainMLP, p0))
            assert_trees_close(jax.grad(lambda p: loss(Ck, p))(p0), jax.grad(lambda p: loss(TrainMLP, p))(p0))
    assert remat_count(lambda p: Ck().apply(p, X, True, rngs=RNGS), p0) == 1
    p_nn = nn.remat(TrainMLP, static_argnums=(2,))().init(jax.random.key(0), X, False)
    assert_trees_close(jax.tree.leaves(p_nn), jax.tree.leaves(p0))
    with pytest.raises(ValueError, match="position 0 is self"):
        checkpoint(TrainMLP, static_argnums=(0,))


def test_linen_class_inside_setup_and_bound_submodule_of_it():
    class P(nn.Module):
        def setup(self):
            self.d = checkpoint(nn.Dense)(4)

        def __call__(self, x):
            return jnp.sin(self.d(x))

    p = P().init(jax.random.key(0), X)
    assert set(p["params"]) == {"d"}
    assert remat_count(lambda p: P().apply(p, X), p) == 1


# --- Linen errors ----------------------------------------------------------------------------

def test_linen_errors():
    with pytest.raises(TypeError) as e1:
        checkpoint(nn.Dense, 3)
    assert_clean_error(e1, "checkpoint(Dense)(...)")
    with pytest.raises(TypeError) as e2:
        checkpoint(nn.Dense(3), X)
    assert_clean_error(e2, "not bound", "checkpoint(Dense)")

    with pytest.raises(TypeError) as e3:
        class Captures(nn.Module):
            def setup(self):
                self.a, self.b = nn.Dense(4), nn.Dense(4)

            def __call__(self, x):
                a, b = self.a, self.b
                return checkpoint(lambda t: b(a(t)), x)

        Captures().init(jax.random.key(0), X)
    assert "several Linen modules" in str(e3.value) and "\n" not in str(e3.value)

    class ModuleNotFirst(nn.Module):
        def setup(self):
            self.a = nn.Dense(4)

        def __call__(self, x):
            return checkpoint(lambda t, m: m(t), x, self.a)

    with pytest.raises(TypeError, match="pass it first"):
        ModuleNotFirst().init(jax.random.key(0), X)


def test_linen_module_as_first_argument():
    class M(nn.Module):
        def setup(self):
            self.a = nn.Dense(4)

        def __call__(self, x, ck=True):
            f = lambda m, t: jnp.sin(m(t))  # noqa: E731
            return checkpoint(f, self.a, x) if ck else f(self.a, x)

    p = M().init(jax.random.key(0), X)
    g1 = jax.grad(lambda p: M().apply(p, X).sum())(p)
    g0 = jax.grad(lambda p: M().apply(p, X, False).sum())(p)
    assert_trees_close(g1, g0)
    assert remat_count(lambda p: M().apply(p, X), p) == 1


# --- functools.partial ------------------------------------------------------------------------

def test_nnx_partial_of_bound_method():
    import functools

    class M(nnx.Module):
        def __init__(self, rngs, ck):
            self.fc = nnx.Linear(4, 4, rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)
            self.ck = ck

        def body(self, x, scale):
            return jnp.sin(self.bn(self.fc(x)) * scale)

        def __call__(self, x):
            f = functools.partial(self.body, scale=2.0)
            return checkpoint(f, x) if self.ck else f(x)

    m0, m1 = M(nnx.Rngs(0), False), M(nnx.Rngs(0), True)
    grad = nnx.grad(lambda m: jnp.sum(m(X) ** 2))
    g0, g1 = nnx.jit(lambda m0, m1: (grad(m0), grad(m1)))(m0, m1)  # one program for both sides
    assert_trees_close(g1, g0)
    assert_trees_close(nnx.state(m1, nnx.BatchStat), nnx.state(m0, nnx.BatchStat))
    gd, params, rest = nnx.split(m1, nnx.Param, ...)
    assert remat_count(lambda p: jnp.sum(nnx.merge(gd, p, rest, copy=True)(X)), params) == 1


def test_linen_partial_of_bound_method():
    import functools

    class M(nn.Module):
        ck: bool = True

        def setup(self):
            self.fc = nn.Dense(4)

        def body(self, x, scale):
            return jnp.sin(self.fc(x)) * scale

        def __call__(self, x):
            f = functools.partial(self.body, scale=2.0)
            return checkpoint(f, x) if self.ck else f(x)

    p = M().init(jax.random.key(0), X)
    g1 = jax.grad(lambda p: M().apply(p, X).sum())(p)
    g0 = jax.grad(lambda p: M(ck=False).apply(p, X).sum())(p)
    assert_trees_close(g1, g0)
    assert remat_count(lambda p: M().apply(p, X), p) == 1
