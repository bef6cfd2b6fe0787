"""policy=: every spelling gives exact gradients and keeps what it says it keeps."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_clean_error, assert_trees_close, nonarg_residuals, residual_bytes
from jax.ad_checkpoint import Offloadable, Recompute, Saveable

import remat
from remat import checkpoint, checkpoint_name, policies
from remat.policies import CheckpointPolicy

W = jax.random.normal(jax.random.key(0), (4, 4)) * 0.5
X = jax.random.normal(jax.random.key(1), (2, 3, 4))


def body(w, x):
    h = checkpoint_name(jnp.tanh(x @ w), "h")             # weights x activations: no batch dims
    s = jnp.einsum("bij,bkj->bik", h, h)                  # batched matmul (attention-like)
    s = checkpoint_name(jnp.exp(jnp.sin(s)), "scores")
    return jnp.sum(s * s) + jnp.sum(jnp.cos(h @ w) * h)


def loss_plain(w, x):
    return body(w, x)


def ck_loss(policy):
    return lambda w, x: checkpoint(body, w, x, policy=policy)


def kept(policy):
    return nonarg_residuals(ck_loss(policy), W, X)


def nbytes(policy):
    return residual_bytes(ck_loss(policy), W, X)


@functools.cache
def plain_grads():
    """The reference gradients, compiled once for every policy that is compared with them."""
    return jax.jit(jax.grad(loss_plain, argnums=(0, 1)))(W, X)


ALL_POLICIES = {
    "None": None,
    "nothing": "nothing",
    "everything": "everything",
    "dots": "dots",
    "dots_no_batch": "dots_no_batch",
    "names-list": ["h"],
    "names-tuple": ("h", "scores"),
    "save_names": policies.save_names("h"),
    "save_names-list": policies.save_names(["scores"]),
    "save_all_but": policies.save_all_but("scores"),
    "offload_names": policies.offload_names("h"),
    "any_of": policies.any_of("dots_no_batch", policies.save_names("scores")),
    "selective-ops": policies.selective(["mm"]),
    "selective-prims": policies.selective([jax.lax.dot_general_p, "exp"]),
    "selective-fn": policies.selective(
        lambda op, *a, **k: CheckpointPolicy.MUST_SAVE if op == "tanh" else CheckpointPolicy.PREFER_RECOMPUTE
    ),
    "jax-callable": jax.checkpoint_policies.checkpoint_dots,
}


# every policy in the default run once: eager (op by op) for a few of each kind, jitted for the rest
# and for None (the jitted baseline); the other pairs are slow. names-tuple and save_names-list are
# spellings that test_names_policy_keeps_exactly_the_named_value resolves to the same policy.
EAGER_FAST = {"None", "nothing", "dots", "names-list", "selective-fn"}
JIT_SLOW = (EAGER_FAST - {"None"}) | {"names-tuple", "save_names-list"}


@pytest.mark.parametrize("jit,name", [
    pytest.param(jit, name, id=f"{'jit' if jit else 'eager'}-{name}",
                 marks=pytest.mark.slow if name in (JIT_SLOW if jit else set(ALL_POLICIES) - EAGER_FAST) else ())
    for jit in (False, True) for name in ALL_POLICIES])
def test_every_policy_gives_plain_gradients(name, jit):
    if jit and name not in JIT_SLOW:
        got = _jit_fast_grads()[name]
    else:
        g = jax.grad(ck_loss(ALL_POLICIES[name]), argnums=(0, 1))
        got = (jax.jit(g) if jit else g)(W, X)
    assert_trees_close(got, plain_grads(), rtol=1e-5, atol=1e-5)


@functools.cache
def _jit_fast_grads():
    """The jitted gradients of the default run's jit cases, each policy's its own jax.grad of its
    own checkpoint, all in one compiled program (one compile, not one per policy)."""
    names = [n for n in ALL_POLICIES if n not in JIT_SLOW]
    grads = jax.jit(lambda w, x: [jax.grad(ck_loss(ALL_POLICIES[n]), argnums=(0, 1))(w, x) for n in names])(W, X)
    return dict(zip(names, grads, strict=True))


def test_named_policy_ordering():
    plain = residual_bytes(loss_plain, W, X)
    everything, dots, no_batch, nothing = (nbytes(p) for p in ("everything", "dots", "dots_no_batch", "nothing"))
    assert everything > dots > no_batch > nothing
    assert nbytes(None) == nothing
    assert everything <= plain
    assert kept("nothing") == [] and kept(None) == []
    assert len(kept("everything")) > len(kept("dots")) > len(kept("dots_no_batch")) > 0


def _descriptions(policy):
    return [d for _, d in kept(policy)]


def test_dots_keep_matmul_outputs_only():
    dots = _descriptions("dots")
    assert dots and all(d.startswith("output of dot_general") for d in dots)
    assert len(dots) == 3
    no_batch = _descriptions("dots_no_batch")
    assert len(no_batch) == 2  # x @ w and h @ w, not the batched einsum
    shapes = sorted(a.shape for a, _ in kept("dots_no_batch"))
    assert shapes == [(2, 3, 4), (2, 3, 4)]
    assert (2, 3, 3) in [a.shape for a, _ in kept("dots")]


@pytest.mark.parametrize("spelling", [["h"], ("h",), policies.save_names("h"), policies.save_names(["h"])],
                         ids=["list", "tuple", "save_names", "save_names-list"])
def test_names_policy_keeps_exactly_the_named_value(spelling):
    (res,) = kept(spelling)
    aval, desc = res
    assert "named 'h'" in desc
    assert aval.shape == (2, 3, 4)


def test_names_policy_two_names():
    descs = _descriptions(["h", "scores"])
    assert len(descs) == 2
    assert any("named 'h'" in d for d in descs) and any("named 'scores'" in d for d in descs)


def test_unknown_name_keeps_nothing():
    assert kept(["no_such_name"]) == []


def test_save_all_but_drops_only_the_named_value():
    everything = _descriptions("everything")
    all_but = _descriptions(policies.save_all_but("scores"))
    assert any("named 'scores'" in d for d in everything)
    assert not any("named 'scores'" in d for d in all_but)
    assert any("named 'h'" in d for d in all_but)  # other names are still kept
    assert 0 < len(all_but) < len(everything)
    assert nbytes(policies.save_all_but("scores")) <= nbytes("everything")
    assert repr(policies.save_all_but("scores")) == "save_all_but('scores')"


def test_offload_names_moves_the_value_to_host():
    res = kept(policies.offload_names("h"))
    assert len(res) == 1
    aval, _ = res[0]
    assert aval.shape == (2, 3, 4)
    assert "host" in str(aval)
    # the policy decision itself
    from jax._src.ad_checkpoint import name_p

    p = policies.offload_names("h", save=["scores"])
    a = jax.core.ShapedArray((2,), jnp.float32)
    assert isinstance(p(name_p, a, name="h"), Offloadable)
    assert p(name_p, a, name="scores") is Saveable
    assert p(name_p, a, name="other") is Recompute


def test_any_of_is_the_union():
    union = _descriptions(policies.any_of("dots_no_batch", policies.save_names("scores")))
    assert len(union) == len(_descriptions("dots_no_batch")) + 1
    assert any("named 'scores'" in d for d in union)
    assert _descriptions(policies.any_of("nothing", None)) == []
    assert repr(policies.any_of("dots", ["h"])) == "any_of(dots, save_names('h'))"


def test_selective_ops_match_dots():
    assert len(kept(policies.selective(["mm"]))) == len(kept("dots"))
    assert len(kept(policies.selective(["torch.ops.aten.mm.default"]))) == len(kept("dots"))
    assert len(kept(policies.selective(["aten.bmm"]))) == len(kept("dots"))
    assert len(kept(policies.selective([jax.lax.dot_general_p]))) == len(kept("dots"))
    assert kept(policies.selective(["conv2d"])) == []


def test_selective_function_policy():
    def save_tanh(op, *avals, **params):
        return CheckpointPolicy.MUST_SAVE if op == "tanh" else CheckpointPolicy.PREFER_RECOMPUTE

    res = kept(policies.selective(save_tanh))
    assert len(res) == 1 and res[0][0].shape == (2, 3, 4)
    assert repr(policies.selective(save_tanh)) == "selective(save_tanh)"
    # bools work too; PREFER_SAVE saves like MUST_SAVE
    assert len(kept(policies.selective(lambda op, *a, **k: op == "tanh"))) == 1
    prefer = policies.selective(lambda op, *a, **k: CheckpointPolicy.PREFER_SAVE if op == "tanh" else False)
    assert len(kept(prefer)) == 1


def test_selective_bad_return_value():
    bad = policies.selective(lambda op, *a, **k: "save")
    with pytest.raises(TypeError, match="CheckpointPolicy"):
        jax.grad(ck_loss(bad))(W, X)


def test_checkpoint_policy_enum_exported():
    assert remat.CheckpointPolicy is CheckpointPolicy
    assert {p.name for p in CheckpointPolicy} == {"MUST_SAVE", "PREFER_SAVE", "MUST_RECOMPUTE", "PREFER_RECOMPUTE"}


def test_resolve_policy():
    assert policies.resolve_policy(None) is None
    assert policies.resolve_policy("nothing") is None
    assert policies.resolve_policy("everything") is jax.checkpoint_policies.everything_saveable
    assert policies.resolve_policy("dots") is jax.checkpoint_policies.dots_saveable
    assert policies.resolve_policy("dots_no_batch") is jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    f = jax.checkpoint_policies.nothing_saveable
    assert policies.resolve_policy(f) is f
    assert set(policies.NAMED_POLICIES) == {"nothing", "everything", "dots", "dots_no_batch"}


def test_policy_name():
    assert policies.policy_name(None) == "nothing"
    assert policies.policy_name("dots") == "dots"
    assert policies.policy_name(["a", "b"]) == "names:a,b"
    assert policies.policy_name(policies.selective(["mm"])) == "selective('dot_general')"


@pytest.mark.parametrize(
    "call,exc,fragments",
    [
        (lambda: policies.resolve_policy("bogus"), ValueError, ["'bogus'", "'dots'"]),
        (lambda: policies.resolve_policy(3.0), TypeError, ["float"]),
        (lambda: policies.resolve_policy([]), TypeError, ["non-empty"]),
        (lambda: policies.resolve_policy([1]), TypeError, ["names"]),
        (lambda: policies.save_names(1), TypeError, ["save_names"]),
        (lambda: policies.save_all_but("a", 2), TypeError, ["save_all_but"]),
        (lambda: policies.offload_names(None), TypeError, ["offload_names"]),
        (lambda: policies.selective([]), ValueError, ["at least one"]),
        (lambda: policies.any_of("bogus"), ValueError, ["unknown policy"]),
    ],
    ids=range(9),
)
def test_policy_errors(call, exc, fragments):
    with pytest.raises(exc) as excinfo:
        call()
    assert_clean_error(excinfo, *fragments)


def test_policy_with_nnx_and_sequential():
    # policies travel through the other entry points unchanged
    layers = [lambda x: jnp.tanh(x @ W), lambda x: jnp.tanh(x @ W), jnp.sin]
    f = lambda x, p: jnp.sum(remat.checkpoint_sequential(layers, 2, x, policy=p))  # noqa: E731
    x = X[0]
    n_dots = len(nonarg_residuals(lambda x: f(x, "dots"), x))
    n_nothing = len(nonarg_residuals(lambda x: f(x, None), x))
    assert n_dots == n_nothing + 1
    np.testing.assert_allclose(jax.grad(lambda x: f(x, "dots"))(x), jax.grad(lambda x: f(x, None))(x), rtol=1e-6)


# --- Policies are values (issue 20) ---------------------------------------------------------

def _every_constructed_policy():
    return [
        policies.save_names("a", "b"), policies.save_all_but("a"), policies.offload_names("a", save=["b"]),
        policies.any_of("dots_no_batch", ["a"]), policies.selective(["mm", "conv2d"]),
        policies.selective(_save_exp),
    ]


def _save_exp(op, *avals, **params):
    return op == "exp"


@pytest.mark.parametrize("index", range(6))
def test_equal_policies_are_equal_hash_equal_print_and_pickle(index):
    import copy
    import pickle

    policy, again = _every_constructed_policy()[index], _every_constructed_policy()[index]
    assert policy == again and hash(policy) == hash(again)
    assert pickle.loads(pickle.dumps(policy)) == policy
    assert copy.deepcopy(policy) == policy
    assert "<function" not in repr(policy) and "object at" not in repr(policy)
    assert policies.policy_name(policy) == repr(policy) or index == 0


def test_equal_policies_share_one_trace():
    calls = []

    def body(x):
        calls.append(1)
        return jnp.sin(remat.checkpoint_name(jnp.sin(x), "a"))

    for _ in range(3):  # a new, equal policy object each call
        jax.grad(lambda x: remat.checkpoint(body, x, policy=policies.any_of("dots", ["a"])).sum())(jnp.ones(3))
    assert len(calls) == 1


@pytest.mark.parametrize("policy", [["a"], "names", "any_of", "save_all_but", "selective"])
def test_a_model_checkpointed_with_any_policy_pickles_and_deepcopies(policy):
    import copy
    import pickle

    from flax import nnx

    chosen = {"names": policies.save_names("a"), "any_of": policies.any_of("dots", ["a"]),
              "save_all_but": policies.save_all_but("a"), "selective": policies.selective(["mm"])}
    policy = chosen.get(policy, policy) if isinstance(policy, str) else policy
    model = nnx.Sequential(nnx.Linear(3, 3, rngs=nnx.Rngs(0)), nnx.Linear(3, 3, rngs=nnx.Rngs(1)))
    remat.apply_checkpointing(model, nnx.Linear, policy=policy)
    x = jnp.ones((2, 3))
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        np.testing.assert_allclose(clone(x), model(x))
        assert [p for p, _ in remat.checkpointed(clone)] == [p for p, _ in remat.checkpointed(model)]
