"""Hypothesis strategies that draw case specs: plain JSON dicts that :func:`tests.fuzz.cases.run_case` runs."""
from __future__ import annotations

import os

from hypothesis import strategies as st

from .nnx_stacks import LAYERS, NNX_FORMS, NNX_MODES
from .ops import FORWARD_ONLY, OPS, TAGS
from .transforms import FORWARD_TRANSFORMS, PLACEMENTS, TRANSFORMS

FORMS = ("call", "decorator", "partial", "nested", "sequential")
OP_NAMES = sorted(OPS)
NAMES = ["nothing", "everything", "dots", "dots_no_batch", "no_checkpoint"]


def _leaf_policies() -> st.SearchStrategy:
    names = st.lists(st.sampled_from(TAGS), min_size=1, max_size=2, unique=True)
    return st.one_of(
        st.none(),
        st.sampled_from(NAMES),
        names,
        names.map(lambda n: {"save_names": n}),
        names.map(lambda n: {"save_all_but": n}),
        names.map(lambda n: {"offload": n}),
        st.lists(st.sampled_from(["mm", "tanh", "sin", "exp"]), min_size=1, max_size=2, unique=True).map(
            lambda ops: {"selective": ops}),
        st.sampled_from([0.0, 0.3, 0.5, 1.0]).map(lambda f: {"budget": f}),
        st.sampled_from([0, 64, 256]).map(lambda b: {"budget_bytes": b}),
    )


def _composable(policy: object) -> bool:
    """``any_of`` composes JAX policies: not "no checkpoint", nor a budget (chosen per region)."""
    return policy != "no_checkpoint" and not (isinstance(policy, dict) and {"budget", "budget_bytes"} & set(policy))


def policies() -> st.SearchStrategy:
    """Every policy spelling, and compositions of two with ``any_of``."""
    composable = _leaf_policies().filter(_composable)
    return st.one_of(_leaf_policies(), st.lists(composable, min_size=2, max_size=2).map(lambda ps: {"any_of": ps}))


def _steps(ops: list[str], max_size: int, min_size: int = 0) -> st.SearchStrategy:
    return st.lists(st.tuples(st.sampled_from(ops), st.sampled_from((None, None, *TAGS))).map(list),
                    min_size=min_size, max_size=max_size)


@st.composite
def _calls(draw: st.DrawFn) -> list[dict]:
    """The call sequence: Python scalars changing value and type, shapes, a mutated config."""
    call = st.fixed_dictionaries({
        "n": st.sampled_from([2, 3, 4]),
        "scale": st.sampled_from([0.5, 2.0, 3, 1, True, -1.5]),
        "shift": st.sampled_from([0.0, 0.25, -1.0]),
        "mode": st.sampled_from(["sin", "cos"]),
    })
    return draw(st.lists(call, min_size=1, max_size=3))


def _vmap_rejects_names(spec: dict) -> bool:
    """Under JAX_REMAT3=1, JAX 0.10 cannot vmap ``checkpoint_name`` (NotImplementedError, no
    remat involved): programs that are vmapped (the vmap placement, jacfwd, hessian) draw no tags."""
    vmapped = spec["placement"] == "vmap" or spec["transform"] in ("jacfwd_grad", "hessian")
    return vmapped and os.environ.get("JAX_REMAT3", "") not in ("", "0")


@st.composite
def function_cases(draw: st.DrawFn, dtype: str | None = None) -> dict:
    """A program of a few ops around one region, in one form, placement and transform."""
    transform = draw(st.sampled_from(TRANSFORMS))
    placement = draw(st.sampled_from(PLACEMENTS))
    forward_only = transform in FORWARD_TRANSFORMS
    if placement == "while" and not forward_only:
        transform = draw(st.sampled_from(FORWARD_TRANSFORMS))
        forward_only = True
    ops = OP_NAMES if forward_only else [o for o in OP_NAMES if o not in FORWARD_ONLY]
    heavy = transform in ("jacfwd_grad", "hessian")
    spec = {
        "kind": "function",
        "seed": draw(st.integers(0, 2**16)),
        "dtype": dtype or draw(st.sampled_from(["float32", "float64"])),
        "pre": draw(_steps(ops, 1)),
        "body": draw(_steps(ops, 2 if heavy else 4, min_size=1)),
        "post": draw(_steps(ops, 1)),
        "inputs": draw(st.integers(1, 3)),
        "output": draw(st.sampled_from(["array", "pytree", "int", "bool"])),
        "form": draw(st.sampled_from(FORMS)),
        "policy": draw(policies()),
        "prevent_cse": draw(st.one_of(st.booleans(), st.lists(st.booleans(), min_size=1, max_size=3))),
        "placement": placement,
        "transform": transform,
        "calls": draw(_calls()),
    }
    if _vmap_rejects_names(spec):
        for part in ("pre", "body", "post"):
            spec[part] = [[op, None] for op, _ in spec[part]]
    if spec["form"] == "nested":
        spec["inner_policy"] = draw(policies())
    if spec["form"] == "sequential":
        spec["segments"] = draw(st.integers(1, 4))
    if spec["form"] in ("call", "decorator", "nested"):
        spec["static"] = draw(st.sampled_from([[], [7], [5, 7]]))
    return spec


@st.composite
def nnx_cases(draw: st.DrawFn, dtype: str | None = None) -> dict:
    """A stack of NNX blocks trained a step or two, checkpointed in one form."""
    spec = {
        "kind": "nnx",
        "seed": draw(st.integers(0, 2**16)),
        "dtype": dtype or draw(st.sampled_from(["float32", "float64"])),
        "mode": draw(st.sampled_from(NNX_MODES)),
        "form": draw(st.sampled_from(NNX_FORMS)),
        "policy": draw(policies()),
        "prevent_cse": draw(st.booleans()),
        "steps": draw(st.integers(1, 2)),
        "n": draw(st.sampled_from([3, 4])),
    }
    # flax 0.12 cannot update a merged module's Variables (Dropout's RNG count, BatchNorm's
    # statistics) under jax.grad, jitted or not (TraceContextError, with or without remat):
    # plain jax transforms of split state draw the stateless layers
    layers = LAYERS if spec["mode"].startswith("nnx") else ("linear", "layernorm")
    spec["layers"] = draw(st.lists(st.sampled_from(layers), min_size=1, max_size=4))
    if spec["form"] == "sequential":
        spec["segments"] = draw(st.integers(1, 3))
    return spec


def cases() -> st.SearchStrategy:
    """Any case: mostly function programs, some NNX stacks."""
    return st.one_of(function_cases(), function_cases(), function_cases(), nnx_cases())
