"""remat.scan schedules: unequal (binomial / Revolve-style) checkpoint segments, nested."""
from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_clean_error
from programs import (
    WIDE_X,
    assert_trees_close,
    layer,
    stacked,
    unrolled,
    wide_layer,
    wide_params,
)

from remat import scan as S
from remat._core.hooks import deciding
from remat.analysis import compiled_memory, saved_residuals
from remat.scan import (
    LinenScanLayers,
    binomial_schedule,
    scan_layers,
    scan_nnx_layers,
    schedule_peak,
    schedule_recomputes,
    stack_nnx_layers,
)
from remat.scan.schedules import _capacity

SCHEDULES_8 = [
    pytest.param({"segments": (8,)}, id="(8,)", marks=pytest.mark.slow),
    pytest.param({"segments": (5, 2, 1)}, id="(5,2,1)", marks=pytest.mark.slow),
    pytest.param({"segments": (4, 4)}, id="(4,4)", marks=pytest.mark.slow),
    pytest.param({"segments": (3, 3, 2)}, id="(3,3,2)", marks=pytest.mark.slow),
    pytest.param({"segments": ((3, 2), (2, 1))}, id="((3,2),(2,1))", marks=pytest.mark.slow),
    pytest.param({"segments": ((2, 1), (2, 1), 1, 1)}, id="((2,1),(2,1),1,1)", marks=pytest.mark.slow),
    pytest.param({"segments": (((2, 1), 1), (2, 1), 1)}, id="3-levels"),
    pytest.param({"segments": [1] * 8}, id="list-of-1", marks=pytest.mark.slow),
    pytest.param({"levels": 1}, id="levels1", marks=pytest.mark.slow),
    pytest.param({"levels": 2}, id="levels2", marks=pytest.mark.slow),
]


# ----------------------------------------------------------------------------- the model


def all_schedules(n, levels):
    """Every schedule of n layers with at most ``levels`` levels (brute force)."""
    out = [n]
    if levels == 0:
        return out
    for parts in range(1, n + 1):
        for cuts in itertools.combinations(range(1, n), parts - 1):
            sizes = [b - a for a, b in zip((0, *cuts), (*cuts, n))]
            for kids in itertools.product(*(all_schedules(s, levels - 1) for s in sizes)):
                out.append(tuple(kids))
    return out


def leaves(s):
    return [s] if isinstance(s, int) else [x for c in s for x in leaves(c)]


@pytest.mark.parametrize("levels", [1, 2])
def test_binomial_schedule_is_optimal_against_brute_force(levels):
    for n in range(1, 9):
        best = min(schedule_peak(s) for s in all_schedules(n, levels))
        s = binomial_schedule(n, levels)
        assert schedule_peak(s) == best, (n, levels, s, best)
        assert sum(leaves(s)) == n
        assert schedule_recomputes(s) <= levels


def test_binomial_schedule_values():
    assert binomial_schedule(16, 0) == 16
    assert binomial_schedule(1, 3) == 1
    assert binomial_schedule(3, 1) == (2, 1)
    assert binomial_schedule(10, 1) == (4, 3, 2, 1)  # C(5, 2) = 10: exactly full
    assert binomial_schedule(16, 1) == (6, 5, 4, 1)
    assert binomial_schedule(16, 2) == ((4, 3, 2, 1), (3, 2, 1))
    assert binomial_schedule(20, 2) == ((4, 3, 2, 1), (3, 2, 1), (2, 1), 1)  # C(6, 3) = 20
    assert binomial_schedule(16, 3) == binomial_schedule(16, 2)  # a 3rd level cannot lower peak 4
    assert binomial_schedule(35, 3) == (
        ((4, 3, 2, 1), (3, 2, 1), (2, 1), 1), ((3, 2, 1), (2, 1), 1), ((2, 1), 1), 1)
    for depth in (1, 2, 7, 16, 31, 64, 100, 1000):
        peaks = [schedule_peak(binomial_schedule(depth, lv)) for lv in range(6)]
        assert peaks[0] == depth
        assert all(a >= b for a, b in zip(peaks, peaks[1:])), (depth, peaks)  # monotone in levels
        for lv in range(6):
            s = binomial_schedule(depth, lv)
            assert sum(leaves(s)) == depth and schedule_recomputes(s) <= lv
            p = schedule_peak(s)
            # least peak: the binomial capacity C(p + l, l + 1) reaches depth, C(p - 1 + l, l + 1) does not
            if lv:
                assert _capacity(p, lv) >= depth > _capacity(p - 1, lv)
    # sqrt(2N) with one level, never worse than the best equal split
    for depth in (16, 36, 64, 100):
        k = S.best_segments(depth)
        assert schedule_peak(binomial_schedule(depth, 1)) <= schedule_peak((depth // k,) * k)


def test_schedule_peak_and_recomputes():
    assert schedule_peak(16) == 16
    assert schedule_peak((4, 4, 4, 4)) == 7
    assert schedule_peak((5, 4, 3, 2, 1, 1)) == 6
    assert schedule_peak(((3, 2, 1), (2, 1), 1)) == 3
    assert schedule_peak((1, 8)) == 9  # the big segment last pays for every held input
    assert schedule_peak([[3, 2, 1], [2, 1], 1]) == 3  # lists read as tuples
    assert [schedule_recomputes(s) for s in (5, (5,), ((3, 2, 1), (2, 1), 1), (((1,),),))] == [0, 1, 2, 3]


def test_bad_schedules_are_one_line_value_errors():
    x = jnp.ones((2, 8))
    cases = [
        ({"segments": (5, 4)}, ["schedule (5, 4) covers 9 layers but params have depth 16", "must sum to the depth"]),
        ({"segments": (8, 0, 8)}, ["has a leaf 0", "positive int"]),
        ({"segments": (8, (), 8)}, ["empty tuple"]),
        ({"segments": (8, "8")}, ["of type str", "positive ints"]),
        ({"segments": (8, True, 7)}, ["of type bool"]),
        ({"segments": (8, 8), "levels": 1}, ["levels=1 and segments=(8, 8)", "pass only one"]),
        ({"nested": True, "levels": 1}, ["levels=1 and nested=True", "pass only one"]),
        ({"segments": (8, 8), "nested": True}, ["nested=True", "pass only one"]),
        ({"levels": -1}, ["levels must be an int >= 0"]),
        ({"segments": 2.5}, ["segments must be a positive int"]),
    ]
    for kw, fragments in cases:
        with pytest.raises(ValueError) as e:
            scan_layers(layer, stacked(16), x, **kw)
        assert_clean_error(e, *fragments)
    for bad in [(3, 0), ()]:
        with pytest.raises(ValueError) as e:
            schedule_peak(bad)
        assert_clean_error(e)
    with pytest.raises(ValueError) as e:
        binomial_schedule(0, 1)
    assert_clean_error(e, "depth must be a positive int")


# ----------------------------------------------------------------------------- values


# "nothing" on a 3-level schedule (unequal children, lone layers) in the fast suite; the
# other forms and policies with the slow cases
@pytest.mark.parametrize("policy", ["nothing", pytest.param("dots", marks=pytest.mark.slow),
                                    pytest.param("no_checkpoint", marks=pytest.mark.slow)])
@pytest.mark.parametrize("nesting", SCHEDULES_8)
def test_schedule_gradients_equal_unrolled(policy, nesting):
    # programs.assert_scan_matches_unrolled's check, with the scan and its Python-loop reference
    # in one program compiled with XLA's backend optimisations off (one compile, not two)
    params, x = stacked(8), jax.random.normal(jax.random.PRNGKey(1), (3, 8))
    loss = lambda p, x: jnp.sum(jnp.sin(scan_layers(layer, p, x, policy=policy, **nesting)))  # noqa: E731
    ref_loss = lambda p, x: jnp.sum(jnp.sin(unrolled(p, x)))  # noqa: E731
    both = jax.jit(lambda p, x: (jax.value_and_grad(loss, (0, 1))(p, x), jax.value_and_grad(ref_loss, (0, 1))(p, x)))
    (value, grads), (ref_value, ref_grads) = both(params, x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    assert_trees_close(grads, ref_grads)


@pytest.mark.slow
def test_schedule_under_vmap_and_pytree_carry():
    params = stacked(6)

    def two(p, h):
        a, b = h
        return layer(p, a), b + jnp.sum(a)

    def f(p, a):
        out = scan_layers(two, p, (a, jnp.zeros(())), segments=((2, 1), 2, 1))
        return jnp.sum(out[0]) + out[1]

    def ref(p, a):
        h = (a, jnp.zeros(()))
        for i in range(6):
            h = two(jax.tree.map(lambda v, i=i: v[i], p), h)
        return jnp.sum(h[0]) + h[1]

    xs = jax.random.normal(jax.random.PRNGKey(4), (3, 2, 8))
    got = jax.jit(jax.vmap(jax.grad(f), in_axes=(None, 0)))(params, xs)
    want = jax.jit(jax.vmap(jax.grad(ref), in_axes=(None, 0)))(params, xs)
    assert_trees_close(got, want)


def test_equal_tuple_is_the_int_segments_program():
    params, x = stacked(16), jnp.ones((2, 8))

    def jaxpr(**kw):
        return str(jax.make_jaxpr(jax.grad(lambda p: jnp.sum(scan_layers(layer, p, x, **kw))))(params))

    assert jaxpr(segments=(4, 4, 4, 4)) == jaxpr(segments=4)
    assert jaxpr(segments=((4, 4), (4, 4))) != jaxpr(segments=2)


def test_planner_override_may_return_a_schedule():
    params, x = stacked(8), jax.random.normal(jax.random.PRNGKey(1), (3, 8))
    seen = []

    def override(depth, policy, groups):
        seen.append((depth, groups))
        return "dots", (5, 2, 1)

    loss = lambda p: jnp.sum(jnp.sin(scan_layers(layer, p, x, levels=1)))  # noqa: E731
    with deciding(scan=override):
        g = jax.jit(jax.grad(loss))(params)  # traced here, under the override
    assert seen == [(8, (4, 3, 1))]  # the caller's levels=1 schedule goes to the planner
    with deciding(scan=lambda d, p, gr: (p, (4, 3))), pytest.raises(ValueError) as e:
        jax.grad(loss)(params)
    assert_clean_error(e, "the planner's schedule (4, 3) covers 7 layers but params have depth 8")
    with deciding(scan=lambda d, p, gr: (p, 3)), pytest.raises(ValueError, match="not divisible by segments=3"):
        jax.grad(loss)(params)
    ref = jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(unrolled(p, x)))))
    assert_trees_close(g, ref(params))


def test_saved_residuals_are_the_child_inputs():
    params = stacked(8)
    x = jnp.ones((3, 8))
    f = lambda p, x: jnp.sum(scan_layers(layer, p, x, segments=(5, 2, 1)))  # noqa: E731
    report = saved_residuals(f, params, x)
    # the backward of the top level keeps x and the inputs of children 2 and 3, and the
    # per-child parameter slices; nothing per layer
    acts = [r for r in report if tuple(r.shape) == (3, 8)]
    assert len(acts) == 3, str(report)
    assert not any(len(r.shape) == 3 and r.shape[1:] == (3, 8) for r in report), str(report)


# ----------------------------------------------------------------------------- memory


@functools.lru_cache(maxsize=None)
def temp(depth, **kw):
    loss = lambda p, x: jnp.sum(scan_layers(wide_layer, p, x, **kw) ** 2)  # noqa: E731
    return compiled_memory(loss, wide_params(depth), WIDE_X).temp_bytes


@pytest.mark.slow  # test_saved_residuals_are_the_child_inputs is the fast check of what a schedule keeps
def test_binomial_memory_below_equal_groups_depth_16():
    flat, equal, two = temp(16), temp(16, nested=True), temp(16, levels=2)
    # Model peaks (layer inputs): flat 16, (4, 4, 4, 4) 7 (8 as one outer scan), levels=2
    # ((4, 3, 2, 1), (3, 2, 1)) 4, plus a constant. Measured (XLA:CPU, jax 0.10.2), in
    # MiB with 0.5 MiB per layer input: flat 10.53, equal 6.78, levels=2 6.67 (each lone
    # child pays a few input-sized copies at its cond, which eats most of the saving here).
    assert two < equal < 0.7 * flat, (flat, equal, two)


@pytest.mark.slow
def test_binomial_memory_depth_32():
    flat, equal = temp(32), temp(32, nested=True)
    one, two = temp(32, levels=1), temp(32, levels=2)
    # Model peaks: flat 32, (8, 8, 8, 8) 11 (12 as an outer scan), levels=1
    # (8, 7, 6, 5, 4, 2) 8, levels=2 ((5, 4, 3, 2, 1), (4, 3, 2, 1), (3, 2, 1), 1) 5.
    # Measured MiB: flat 18.53, equal 9.03, levels=1 7.79, levels=2 7.17 (levels=3: 7.65,
    # the copies of its 10 lone children outweigh the one input it saves).
    assert two < one < equal < 0.55 * flat, (flat, equal, one, two)
    assert equal - two > 3 * WIDE_X.nbytes, (equal, two)


# ----------------------------------------------------------------------------- Flax NNX


def _nnx_block(rngs):
    from programs import nnx_block as block

    return block(rngs)


def _stateful_block(rngs):
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(8, 8, rngs=rngs)
            self.bn = nnx.BatchNorm(8, momentum=0.5, rngs=rngs)

        def __call__(self, x):
            return x + jnp.tanh(self.bn(self.lin(x)))

    return Block(rngs)


NNX_SCHEDULES = [((2, 1), 1), pytest.param((2, 1, 1), marks=pytest.mark.slow),
                 pytest.param(((1, 1), 1, 1), marks=pytest.mark.slow),
                 pytest.param((2, 2), marks=pytest.mark.slow)]


@pytest.mark.slow  # fast: test_nnx_batch_stats_written_back_in_layer_order compares a schedule's gradients
@pytest.mark.parametrize("segments", NNX_SCHEDULES, ids=str)
def test_nnx_schedule_gradients_equal_unrolled(segments):
    from flax import nnx
    from programs import nnx_unrolled as _nnx_unrolled

    layers = stack_nnx_layers(_nnx_block, 4, nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(2), (3, 8))
    grads = nnx.jit(nnx.grad(lambda m, x: jnp.sum(scan_nnx_layers(m, x, segments=segments) ** 2)))(layers, x)
    ref = nnx.jit(nnx.grad(lambda m, x: jnp.sum(_nnx_unrolled(m, x, 4) ** 2)))(layers, x)
    assert_trees_close(grads, ref)
    lv = nnx.jit(nnx.grad(lambda m, x: jnp.sum(scan_nnx_layers(m, x, levels=1) ** 2)))(layers, x)
    assert_trees_close(lv, ref)


@pytest.mark.parametrize("segments", [pytest.param(None, marks=pytest.mark.slow), *NNX_SCHEDULES], ids=str)
def test_nnx_batch_stats_written_back_in_layer_order(segments):
    from flax import nnx

    depth = 4
    x = jax.random.normal(jax.random.PRNGKey(5), (6, 8))
    layers = stack_nnx_layers(_stateful_block, depth, nnx.Rngs(0))
    ref_layers = stack_nnx_layers(_stateful_block, depth, nnx.Rngs(0))

    def scanned(m, x):
        return jnp.sum(scan_nnx_layers(m, x, segments=segments) ** 2)

    def loop(m, x):
        graphdef, state = nnx.split(m)
        new = []
        for i in range(depth):
            layer_i = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))
            x = layer_i(x)
            new.append(nnx.state(layer_i, nnx.BatchStat))
        nnx.update(m, jax.tree.map(lambda *a: jnp.stack(a), *new))
        return jnp.sum(x ** 2)

    # one compile for both sides, with XLA's backend optimisations off: nnx.jit's split, merge
    # and write-back spelled out (nnx.jit takes no compiler options)
    graphdef, state = nnx.split((layers, ref_layers))

    def both(state, x):
        a, b = nnx.merge(graphdef, state)
        return (nnx.value_and_grad(scanned)(a, x), nnx.value_and_grad(loop)(b, x)), nnx.state((a, b))

    ((v, g), (rv, rg)), state = jax.jit(both)(state, x)
    nnx.update((layers, ref_layers), state)
    np.testing.assert_allclose(v, rv, rtol=1e-5)
    assert_trees_close(g, rg)
    stats, rstats = nnx.state(layers, nnx.BatchStat), nnx.state(ref_layers, nnx.BatchStat)
    assert_trees_close(stats, rstats)
    # every layer's statistics moved, and differently (the state is per layer, in order)
    mean = np.asarray(jax.tree.leaves(stats)[0])
    assert not np.allclose(mean[0], mean[1])


# ----------------------------------------------------------------------------- Flax Linen


def test_linen_rejects_schedules_clearly():
    from programs import linen_block as _linen_block

    model = LinenScanLayers(_linen_block(), depth=4, segments=(2, 1, 1))
    with pytest.raises(ValueError) as e:
        model.init(jax.random.PRNGKey(0), jnp.ones((2, 8)))
    assert "\n" not in str(e.value)
    assert "use scan_layers or scan_nnx_layers" in str(e.value)
