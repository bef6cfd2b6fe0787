"""remat.explain and ``remat explain``: every byte at a compiled step's peak, attributed.

The report is checked against XLA itself (the temp bytes of a plain compilation of the
same step; the temp buffer covered exactly by the peak's entries), the attributions
against the code that made each buffer (this file's lines, the NNX module paths), each
warning against a planted mistake and against the compiled truth, and the trace files
with their viewers' own readers (PyTorch's ``torch.cuda._memory_viz``; the trace event
format's rules that Perfetto's JSON importer enforces).
"""
from __future__ import annotations

import json
import os
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import remat
from remat.cli import main
from remat.explainer.explanation import KINDS, explain

HERE = os.path.basename(__file__)


def _temp(fn, *args):
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def _line_of(text: str) -> int:
    """The line of this file that contains ``text``."""
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if text in line and "_line_of" not in line)


def tanh_mlp(w, x):
    h = jnp.tanh(x @ w["a"])  # first layer
    return jnp.sum(jnp.tanh(h @ w["b"]) ** 2)  # second layer


def _full(shape, value=1.0):
    """An array made by NumPy and put on the device as it is (jnp.ones and its scaling, run
    eagerly, compile a program each)."""
    return jax.device_put(np.full(shape, value, np.float32))


W = {"a": _full((64, 64), 0.01), "b": _full((64, 64), 0.01)}
X = _full((256, 64))


class Block(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.fc = nnx.Linear(width, 4 * width, rngs=rngs)
        self.out = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x):
        hidden = remat.checkpoint_name(self.fc(x), "hidden")
        return x + self.out(jnp.tanh(hidden))


class Net(nnx.Module):
    def __init__(self, depth: int = 4, width: int = 32, head: int = 32, rngs: nnx.Rngs | None = None):
        rngs = rngs or nnx.Rngs(0)
        self.blocks = nnx.List([Block(width, rngs) for _ in range(depth)])
        self.head = nnx.Linear(width, head, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _net(head=32):
    """A :class:`Net` built by ``nnx.eval_shape``, its parameters drawn by NumPy: run eagerly, its
    initialisers compile a program per shape (the reports read shapes and code, not values)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Net(head=head)))
    rng = np.random.default_rng(0)
    return nnx.merge(graphdef, jax.tree.map(
        lambda s: jax.device_put((rng.standard_normal(s.shape) * 0.1).astype(s.dtype)), state))


def net_step(check=None, policy=None, head=32):
    """``(loss, params, x)`` of a :class:`Net` with the blocks ``check(path)`` selects checkpointed."""
    model = _net(head)
    if check is not None:
        remat.apply_checkpointing(model, lambda path, m: isinstance(m, Block) and check(path), policy=policy)
    graphdef, params = nnx.split(model)

    def loss(params, x):
        return jnp.mean(nnx.merge(graphdef, params, copy=True)(x) ** 2)

    return loss, params, _full((128, 32))


_EXPLAINED: dict = {}


def explained(key, build):
    """``(loss, args, report)``: ``build()``'s step and ``explain`` of its gradient, made once
    per ``key`` in this module (several tests read the same report; explaining compiles)."""
    if key not in _EXPLAINED:
        loss, *args = build()
        _EXPLAINED[key] = loss, args, explain(jax.grad(loss), *args)
    return _EXPLAINED[key]


def _hidden_net():
    """Every block checkpointed, keeping the values tagged 'hidden'."""
    return net_step(check=lambda path: True, policy=["hidden"])


def test_explain_is_the_plain_compilation_and_covers_its_temp_buffer():
    report = explain(jax.grad(tanh_mlp), W, X)
    assert report.temp_bytes == _temp(jax.grad(tanh_mlp), W, X)
    temp = [b for b in report.peak_buffers if b.allocation == "temp"]
    assert sum(b.bytes for b in temp) == report.temp_bytes  # live values and gaps tile the buffer
    assert [b.bytes for b in report.peak_buffers] == sorted((b.bytes for b in report.peak_buffers), reverse=True)
    assert {b.kind for b in report.peak_buffers} <= set(KINDS)
    assert report.attributed_fraction >= 0.95
    residual_lines = {b.source for b in temp if b.kind == "residual"}
    assert f"{HERE}:{_line_of('# first layer')}" in residual_lines
    params = sorted(b.rule for b in report.peak_buffers if b.kind == "parameter")
    assert params == ["argument w['a']", "argument w['b']"]
    assert {b.kind for b in report.peak_buffers if b.allocation == "argument" and b.rule == "argument x"} == {"input"}


def test_module_paths_regions_and_the_policy_rule_of_each_residual():
    loss, (params, x), report = explained("hidden net", _hidden_net)
    assert report.temp_bytes == _temp(jax.grad(loss), params, x)
    kept = [b for b in report.temp_peak_buffers if b.kind == "residual" and b.region]
    named = [b for b in kept if "'hidden'" in (b.rule or "")]
    assert named, "the values tagged 'hidden' are kept by the names policy"
    for b in named:
        assert b.module == b.region and b.source == f"{HERE}:{_line_of('hidden = remat')}"
    recomputed = [b for b in report.temp_peak_buffers if b.kind == "recomputed value"]
    assert recomputed and all(b.region and b.module.startswith(b.region) for b in recomputed)
    assert {r["region"] for r in report.regions} == {f"blocks.{i}" for i in range(4)}
    assert all(r["policy"] == "names ['hidden']" for r in report.regions)


def test_a_policy_that_matches_nothing_is_named_with_its_fix():
    loss, params, x = net_step(check=lambda path: True, policy=["hiden"])  # misspelled
    warnings = explain(jax.grad(loss), params, x).warnings
    found = [w for w in warnings if "matches nothing" in w]
    assert len(found) == 4 and all("fix: policy=['hidden']" in w for w in found)
    assert not [w for w in explained("hidden net", _hidden_net)[2].warnings if "matches nothing" in w]


def four_blocks(policy, width=16, batch=16):
    """``(loss, weights, x)``: four ``tanh(h @ w)`` blocks, each checkpointed under ``policy``."""
    def block(h, w):
        return jnp.tanh(h @ w)

    def loss(ws, x):
        h = x
        for w in ws:
            h = remat.checkpoint(block, h, w, policy=policy)
        return jnp.sum(h)

    return loss, [_full((width, width), 0.01) for _ in range(4)], _full((batch, width))


# None is remat.checkpoint's default, "nothing", and on these 2-D products "dots_no_batch" keeps what
# "dots" keeps: both slow (the same programs as the "nothing" and "dots" cases)
POLICIES = [pytest.param(None, marks=pytest.mark.slow), "nothing", "dots",
            pytest.param("dots_no_batch", marks=pytest.mark.slow), "everything", ["h"]]


# every policy at the smallest shape by default, and at the wider and longer ones with -m slow
@pytest.mark.parametrize("policy", POLICIES, ids=str)
@pytest.mark.parametrize("width,batch", [(16, 16), pytest.param(64, 8, marks=pytest.mark.slow),
                                         pytest.param(64, 256, marks=pytest.mark.slow)])
def test_every_policy_attributes_at_least_95_percent_of_four_blocks(policy, width, batch):
    """Small programs included, where XLA's alignment padding and the values of called
    computations (the CPU lowering's conditionals) are a large share of the temp buffer."""
    loss, (ws, x), report = explained(("four blocks", str(policy), width, batch),
                                      lambda: four_blocks(policy, width, batch))
    assert report.temp_bytes == _temp(jax.grad(loss), ws, x)
    assert sum(b.bytes for b in report.temp_peak_buffers) == report.temp_bytes
    assert report.attributed_fraction >= 0.95, (policy, report.attributed_fraction, str(report))
    padding = [b for b in report.temp_peak_buffers if b.rule and b.rule.startswith("padding")]
    assert all(b.source == f"{HERE}:{_line_of('h = remat.checkpoint(block, h, w, policy=policy)')}"
               or b.source == f"{HERE}:{_line_of('return jnp.tanh(h @ w)')}" for b in padding), padding


def test_a_checkpoint_whose_policy_keeps_everything_is_named():
    def loss(w, x):
        for _ in range(4):
            x = jnp.tanh(x @ w["a"])
        return jnp.sum(x ** 2)

    whole = remat.checkpoint(loss, policy="everything")
    found = [w for w in explain(jax.grad(whole), W, X).warnings if "recomputes nothing" in w]
    assert len(found) == 1 and "policy everything" in found[0] and "fix:" in found[0]
    assert _temp(jax.grad(loss), W, X) <= _temp(jax.grad(whole), W, X)  # the truth: no memory saved
    _, (ws, x), report = explained(("four blocks", "everything", 16, 16), lambda: four_blocks("everything"))
    assert len([w for w in report.warnings if "recomputes nothing" in w]) == 4

    def relu_blocks(ws, x):  # the backward recomputes relu's mask, which JAX does not save: still nothing saved
        for w in ws:
            x = remat.checkpoint(lambda h, w: jax.nn.relu(h @ w), x, w, policy="everything")
        return jnp.sum(x)

    assert len([w for w in explain(jax.grad(relu_blocks), ws, x).warnings if "recomputes nothing" in w]) == 4
    for policy in ("nothing", "dots", ["h"]):
        report = explained(("four blocks", str(policy), 16, 16), lambda policy=policy: four_blocks(policy))[2]
        assert not [w for w in report.warnings if "recomputes nothing" in w], policy
    report = explained("hidden net", _hidden_net)[2]  # keeps some, recomputes the rest
    assert not [w for w in report.warnings if "recomputes nothing" in w]


def test_checkpointing_the_last_block_alone_is_named_and_really_saves_nothing():
    loss, params, x = net_step(check=lambda path: path == ("blocks", 3))
    report = explain(jax.grad(loss), params, x)
    found = [w for w in report.warnings if "does not lower the peak" in w]
    assert len(found) == 1 and found[0].startswith("blocks.3") and "('blocks', 3)" in found[0]
    plain_loss, plain_params, _ = net_step()  # the truth: without the checkpoint, no more memory
    assert _temp(jax.grad(plain_loss), plain_params, x) <= report.temp_bytes
    loss, params, x = net_step(check=lambda path: path != ("blocks", 3))
    assert not [w for w in explain(jax.grad(loss), params, x).warnings if "does not lower the peak" in w]


def test_checkpointing_the_whole_function_is_named():
    def loss(w, x):
        for _ in range(4):
            x = jnp.tanh(x @ w["a"])
        return jnp.sum(x ** 2)

    whole = remat.checkpoint(loss)
    report = explain(jax.grad(whole), W, X)
    assert any("does not lower the peak" in w and "checkpoint the blocks inside it" in w for w in report.warnings)
    assert _temp(jax.grad(loss), W, X) <= report.temp_bytes  # the truth


def test_the_largest_residual_from_unchecked_code_is_named():
    loss, params, x = net_step(check=lambda path: path != ("blocks", 2))  # one block left out
    report = explain(jax.grad(loss), params, x)
    found = [w for w in report.warnings if w.startswith("the largest residual at the peak")]
    assert len(found) == 1 and "blocks.2" in found[0] and "path == ('blocks', 2)" in found[0]
    loss, params, x = net_step(check=lambda path: True, policy="everything")  # the largest: in a region
    assert not [w for w in explain(jax.grad(loss), params, x).warnings if w.startswith("the largest residual")]


def test_a_scan_over_layers_stacks_what_its_regions_keep():
    def loss(params, x):
        return jnp.sum(remat.scan_layers(lambda p, h: jnp.tanh(h @ p["w"]), params, x, policy="nothing") ** 2)

    params = {"w": _full((8, 64, 64), 0.01)}
    report = explain(jax.grad(loss), params, X)
    assert report.temp_bytes == _temp(jax.grad(loss), params, X)
    stacked = [b for b in report.temp_peak_buffers if b.kind == "residual" and b.op == "while"]
    assert stacked and all(b.region and "loop over layers" in b.rule for b in stacked)
    assert not [w for w in report.warnings if w.startswith("the largest residual")]


def test_a_training_step_kinds_arguments_and_outputs():
    import optax

    opt = optax.adam(1e-3)

    def step(params, opt_state, x):
        value, grads = jax.value_and_grad(tanh_mlp)(params, x)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    report = explain(step, W, opt.init(W), X)
    kinds = {(b.allocation, b.kind) for b in report.peak_buffers}
    assert {("argument", "parameter"), ("argument", "optimizer state"), ("argument", "input"),
            ("output", "parameter"), ("output", "optimizer state"), ("temp", "residual")} <= kinds


def test_a_function_without_backward_pass_has_no_residuals():
    report = explain(lambda x: jnp.sin(x) @ x.T, X)
    assert report.backward_step is None
    assert not {"residual", "gradient", "recomputed value"} & {b.kind for b in report.peak_buffers}


def test_explaining_leaves_the_program_as_it_was(capsys, monkeypatch):
    import remat.explainer.explanation as module

    monkeypatch.setattr(module, "PROGRESS_AFTER_S", 0.0)
    before_env, before_call = dict(os.environ), Block.__call__
    model = _net()
    explain(jax.grad(lambda m, x: jnp.sum(m(x))), model, _full((8, 32)))
    assert dict(os.environ) == before_env and Block.__call__ is before_call
    assert all("_remat_module_path" not in vars(m) for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Module))
    assert "remat explain: compiling" in capsys.readouterr().err  # the progress line of a slow compile


def _check_trace_events(trace: dict) -> None:
    """The Trace Event Format's rules that Perfetto's JSON importer enforces."""
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    slices: dict[tuple, list] = {}
    for e in events:
        assert e["ph"] in ("M", "C", "X", "i") and isinstance(e["name"], str)
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] != "M":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] > 0
            slices.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
        if e["ph"] == "C":
            assert e["args"] and all(isinstance(v, (int, float)) for v in e["args"].values())
        if e["ph"] == "i":
            assert e["s"] in ("g", "p", "t")
        json.dumps(e.get("args", {}))
    for spans in slices.values():  # slices of one track must nest; these follow each other
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert start >= end


def test_timeline_plot_and_trace_files_open_in_their_viewers(tmp_path):
    from matplotlib.image import imread
    from torch.cuda import _memory_viz

    report = explained("hidden net", _hidden_net)[2]  # every block checkpointed (the report shared)
    t = report.timeline
    assert report.backward_step is not None and 0 < report.backward_step <= t.peak < t.steps
    assert max(t.live_bytes) == t.live_bytes[t.peak] <= report.temp_bytes

    png = report.plot(str(tmp_path / "memory.png"))
    assert imread(png).shape[2] in (3, 4)

    trace = json.load(open(report.to_trace(str(tmp_path / "memory.json"))))
    _check_trace_events(trace)
    counter = [e["args"]["bytes"] for e in trace["traceEvents"] if e["ph"] == "C"]
    assert max(counter) == t.live_bytes[t.peak]
    assert {e["name"] for e in trace["traceEvents"] if e["ph"] == "i"} >= {"backward pass begins"}

    snapshot = pickle.load(open(report.to_trace(str(tmp_path / "memory.pickle")), "rb"))
    _memory_viz.segsum(snapshot)  # raises on inconsistent segments
    assert "Device 0" in _memory_viz.trace(snapshot)
    assert "Active Memory Timeline" in _memory_viz.trace_plot(snapshot)
    live = peak = 0
    for e in snapshot["device_traces"][0]:
        live += {"alloc": e["size"], "free_completed": -e["size"]}.get(e["action"], 0)
        peak = max(peak, live)
        assert live >= 0
    assert peak == t.live_bytes[t.peak] and live == 0
    frames = [e["frames"] for e in snapshot["device_traces"][0] if e["action"] == "alloc"]
    assert any(f["filename"].endswith(HERE) for fs in frames for f in fs)


def test_the_command_prints_the_report_as_json(capsys, tmp_path):
    from remat.models.tasks import make_task, pure_step_loss

    args = ["explain", "mlp", "--policy", "dots", "--json", "--plot", str(tmp_path / "m.png"),
            "--trace", str(tmp_path / "m.json")]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"temp_bytes", "peak_buffers", "attributed_fraction", "warnings"} <= set(out)
    assert set(out["peak_buffers"][0]) >= {"bytes", "kind", "source", "module", "region", "rule"}
    loss, step_args = pure_step_loss(make_task("mlp", policy="dots"))
    assert out["temp_bytes"] == _temp(jax.grad(loss), *step_args)
    assert out["attributed_fraction"] >= 0.95
    assert os.path.getsize(out["plot"]) > 0 and os.path.getsize(out["trace"]) > 0


def test_the_command_in_float64_and_its_table(capsys):
    assert main(["explain", "mlp", "--dtype", "float64", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "f64[" in out and "attributed to a line or module" in out


def test_the_command_rejects_bad_flags_in_one_line(capsys):
    assert main(["explain", "mlp", "--plan", "2"]) == 2
    assert main(["explain", "mlp", "--checkpoint", "Nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("remat: error:") for line in err)


@pytest.mark.slow
def test_transformer_dots_attributes_its_peak():
    """The README's case, the representative of the matrix below."""
    from remat.models.tasks import make_task, pure_step_loss

    loss, step_args = pure_step_loss(make_task("transformer", policy="dots"))
    report = explain(jax.grad(loss), *step_args)
    assert report.temp_bytes == _temp(jax.grad(loss), *step_args)
    assert report.attributed_fraction >= 0.95
    residuals = [b for b in report.temp_peak_buffers if b.kind == "residual"]
    assert residuals and all(b.region in ("blocks.0", "blocks.1") for b in residuals if b.bytes >= 65536)
    assert {"dots", "input"} == {"dots" if "`dots`" in b.rule else "input" for b in residuals if b.region}


TWINS = ("mlp", "transformer", "cnn", "llama", "gpt2", "resnet")


@pytest.mark.slow
@pytest.mark.parametrize("model", TWINS)
def test_every_twin_policy_and_plan_is_attributed(model, capsys):
    """At least 95% of the temp bytes attributed, for every policy and a plan, through the command."""
    pytest.importorskip("transformers")
    from remat.policies import POLICY_NAMES

    runs = [["--policy", p] for p in POLICY_NAMES] + [["--plan", "0"]]
    for extra in runs:
        assert main(["explain", model, "--json", *extra]) == 0, extra
        out = json.loads(capsys.readouterr().out)
        assert out["attributed_fraction"] >= 0.95, (extra, out["attributed_fraction"])
        assert sum(b["bytes"] for b in out["peak_buffers"] if b["allocation"] == "temp") == out["temp_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("model", TWINS)
def test_every_twin_writes_its_plot_and_trace(model, dtype, capsys, tmp_path):
    pytest.importorskip("transformers")
    png, trace = str(tmp_path / "m.png"), str(tmp_path / "m.pickle")
    assert main(["explain", model, "--dtype", dtype, "--json", "--plot", png, "--trace", trace]) == 0
    out = json.loads(capsys.readouterr().out)
    floats = {b["shape"][:3] for b in out["peak_buffers"] if b["shape"][:1] == "f" and b["kind"] == "parameter"}
    assert floats == {"f64" if dtype == "float64" else "f32"}
    assert os.path.getsize(png) > 0
    snapshot = pickle.load(open(trace, "rb"))
    assert sum(e["size"] for e in snapshot["device_traces"][0] if e["action"] == "alloc") > 0
    assert np.isfinite(out["attributed_fraction"])


def test_the_benchmark_measures_explain_against_one_compile():
    from benchmarks.explain import markdown, measure

    row = measure("mlp", "nothing", {}, rounds=1)
    assert row["plain_s"] > 0 and row["explain_s"] > 0 and row["attributed"] >= 0.95
    assert "| mlp | nothing |" in markdown([row])
