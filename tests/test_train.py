"""``remat train``: JSON output, learning, several devices, kill-and-resume, bad input.

Fast cases call ``remat.cli.main`` in this process. Anything that needs its own JAX
backend (a device count, a process to kill) runs ``python -m remat train`` in a
subprocess; those are marked slow.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from remat.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {
    "mlp": ["--depth", "1", "--width", "16", "--lr", "0.01"],
    "transformer": ["--depth", "1", "--width", "16", "--seq-len", "8", "--batch-size", "8", "--lr", "0.01"],
    "cnn": ["--depth", "2", "--width", "4", "--lr", "0.02"],
}


def train(capsys, *argv: str) -> dict:
    rc = main(["train", *argv, "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def cli(*argv: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "remat", "train", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


def falls(losses: list[float]) -> bool:
    return np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])


@pytest.fixture(scope="module")
def mlp_run() -> dict:
    """One 1-device MLP run, shared by the tests that compare against it."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["train", "mlp", "--steps", "20", "--json", *TINY["mlp"]]) == 0
    return json.loads(out.getvalue())


def test_json_has_every_step_and_the_mlp_learns(mlp_run):
    d = mlp_run
    for key in ("model", "config", "policy", "optimizer", "lr", "batch_size", "devices", "losses", "final_loss",
                "steps_per_s", "peak_rss_mb", "parameters", "resumed_from", "saved_steps"):
        assert key in d, key
    assert d["model"] == "mlp" and d["devices"] == 1 and d["steps"] == 20
    assert len(d["losses"]) == 20 and all(isinstance(v, float) for v in d["losses"])
    assert d["final_loss"] == d["losses"][-1]
    assert d["steps_per_s"] > 0 and d["peak_rss_mb"] > 0
    assert d["config"]["config"]["depth"] == 1 and d["config"]["config"]["width"] == 16
    assert falls(d["losses"]), d["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["transformer", "cnn"])
def test_transformer_and_cnn_learn(capsys, model):
    d = train(capsys, model, "--steps", "25", *TINY[model])
    assert len(d["losses"]) == 25
    assert falls(d["losses"]), d["losses"]
    assert d["task"] == {"transformer": "char-lm", "cnn": "images"}[model]
    if model == "transformer":
        assert "corpus.txt" in d["data"] and d["config"]["config"]["vocab"] > 40


@pytest.mark.slow
def test_policies_change_memory_not_losses(capsys, mlp_run):
    ref = mlp_run["losses"][:6]
    for policy in ("no_checkpoint", "dots", "names"):
        d = train(capsys, "mlp", "--steps", "6", "--policy", policy, *TINY["mlp"])
        np.testing.assert_allclose(d["losses"], ref, rtol=1e-5, err_msg=policy)


def test_table_progress_and_plot(capsys, tmp_path):
    png = tmp_path / "loss.png"
    assert main(["train", "seed-model", "--steps", "4", "--plot", str(png)]) == 0
    out, err = capsys.readouterr()
    assert "remat train" in out and "steps/s" in out and "peak RSS" in out
    assert "loss=" in err and "rss=" in err  # the progress bar, on stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_factory_trains_with_its_train_loss(capsys, tmp_path):
    f = tmp_path / "my_model.py"
    f.write_text(
        "import numpy as np\n"
        "from flax import nnx\n"
        "import remat\n\n"
        "class Net(nnx.Module):\n"
        "    def __init__(self, rngs):\n"
        "        self.a = nnx.Linear(4, 8, rngs=rngs)\n"
        "        self.b = nnx.Linear(8, 1, rngs=rngs)\n"
        "    def __call__(self, x):\n"
        "        return self.b(remat.checkpoint(lambda h: nnx.relu(self.a(h)), x))\n\n"
        "def build(seed=0):\n"
        "    x = np.random.default_rng(seed).standard_normal((8, 4)).astype(np.float32)\n"
        "    return Net(nnx.Rngs(seed)), None, (x,)\n\n"
        "def train_loss(out, x):\n"
        "    return ((out[:, 0] - x.sum(axis=1)) ** 2).mean()\n"
    )
    d = train(capsys, f"{f}:build", "--steps", "15", "--lr", "0.03")
    assert d["task"] == "factory" and "train_loss" in d["data"]
    assert d["losses"][-1] < 0.5 * d["losses"][0]


@pytest.mark.slow
def test_saves_then_refuses_to_overwrite_and_resumes_in_process(capsys, tmp_path):
    save = tmp_path / "run"
    first = train(capsys, "mlp", "--steps", "4", "--save-every", "2", "--save-dir", str(save), *TINY["mlp"])
    assert first["saved_steps"] == [2, 4]
    assert main(["train", "mlp", "--steps", "4", "--save-dir", str(save), *TINY["mlp"]]) == 2
    err = capsys.readouterr().err
    assert "already holds saves" in err and "--resume" in err
    more = train(capsys, "mlp", "--steps", "6", "--save-every", "2", "--save-dir", str(save), "--resume", *TINY["mlp"])
    assert more["resumed_from"] == 4 and more["steps_run"] == 2 and len(more["losses"]) == 6
    assert more["losses"][:4] == first["losses"]
    assert more["saved_steps"] == [4, 6]  # the last two are kept
    # A resume with other options is refused, naming what differs.
    assert main(["train", "mlp", "--steps", "8", "--save-dir", str(save), "--resume", "--lr", "0.5"]) == 2
    assert "lr" in capsys.readouterr().err


def _damaged_dir(tmp_path) -> str:
    d = tmp_path / "damaged"
    (d / "7").mkdir(parents=True)
    (d / "7" / "junk").write_text("not a checkpoint")
    return str(d)


def _garbage_dir(tmp_path) -> str:
    d = tmp_path / "garbage"
    d.mkdir()
    (d / "notes.txt").write_text("hello")
    return str(d)


def _under_a_file(tmp_path) -> str:
    f = tmp_path / "a_file"
    f.write_text("x")
    return str(f / "sub")


BAD = [
    (["nope"], ["unknown model 'nope'", "mlp", "transformer", "cnn"]),
    (["my_models.py:"], ["malformed factory"]),
    (["no_such_file.py:build"], ["does not exist"]),
    (["mlp", "--residual-budget", "0"], ["(0, 1]"]),
    (["mlp", "--residual-budget", "1.5"], ["(0, 1]"]),
    (["mlp", "--residual-budget", "-0.2"], ["(0, 1]"]),
    (["mlp", "--devices", "0"], ["--devices"]),
    (["mlp", "--devices", "3", "--batch-size", "32"], ["split evenly"]),
    (["mlp", "--steps", "0"], ["--steps"]),
    (["mlp", "--coordinator", "localhost:1234"], ["needs all of --coordinator", "--num-processes", "--process-id"]),
    (["mlp", "--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"], ["HOST:PORT"]),
    (["mlp", "--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"], ["--process-id 2", "0..1"]),
    (["mlp", "--coordinator", "h:1", "--num-processes", "2", "--process-id", "0", "--devices", "3"],
     ["global count", "multiple of 2"]),
    (["mlp", "--resume"], ["--resume needs --save-dir"]),
    (["mlp", "--save-dir", _under_a_file], ["not writable"]),
    (["mlp", "--resume", "--save-dir", _garbage_dir], ["no save to resume from", "notes.txt"]),
    # the task is built before the save is read: the sizes of mlp_run, whose compiled initial state is kept
    (["mlp", "--resume", "--save-dir", _damaged_dir, "--depth", "1", "--width", "16"], ["damaged", "delete"]),
    (["seed-model", "--depth", "3"], ["do not apply"]),
    (["cnn", "--depth", "5"], ["at most 3 blocks"]),
    (["transformer", "--width", "30"], ["not divisible"]),
]


def test_a_save_dir_without_saves_or_with_saves_is_refused_before_the_model_is_built(capsys, tmp_path, monkeypatch):
    import remat.cli._train_loop as loop

    def unbuilt(*args, **kwargs):
        raise AssertionError("the task was built before the save directory was checked")

    monkeypatch.setattr(loop, "build_task", unbuilt)
    assert main(["train", "mlp", "--resume", "--save-dir", _garbage_dir(tmp_path)]) == 2
    assert "no save to resume from" in capsys.readouterr().err
    (tmp_path / "run" / "4" / "state").mkdir(parents=True)  # a finished save's step directory
    assert main(["train", "mlp", "--save-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "already holds saves (last at step 4)" in err and err.count("\n") == 1


@pytest.mark.parametrize("argv,fragments", BAD, ids=[" ".join(a if isinstance(a, str) else a.__name__ for a in b[0])
                                                     for b in BAD])
def test_bad_input_is_one_line_exit_2(capsys, tmp_path, argv, fragments):
    argv = [a(tmp_path) if callable(a) else a for a in argv]
    rc = main(["train", *argv])
    out, err = capsys.readouterr()
    assert rc == 2
    assert err.startswith("remat: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and out == ""
    for frag in fragments:
        assert frag in err, (frag, err)


def test_budget_trains_like_any_policy(capsys, mlp_run):
    d = train(capsys, "mlp", "--steps", "3", "--residual-budget", "0.5", *TINY["mlp"])
    assert d["policy"] == "residual_budget(0.5)"
    np.testing.assert_allclose(d["losses"], mlp_run["losses"][:3], rtol=1e-5)


def test_more_devices_than_this_process_has(capsys):
    import jax

    have = len(jax.devices())  # starts the backend here if no test did
    rc = main(["train", "mlp", "--devices", str(have + 1), "--batch-size", str(8 * (have + 1))])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--devices" in err


@pytest.mark.slow
def test_too_many_devices_in_a_fresh_process():
    p = cli("mlp", "--devices", "100000", "--batch-size", "100000", "--json")
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.startswith("remat: error: --devices 100000") and p.stderr.count("\n") == 1, p.stderr


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_four_devices_give_the_one_device_losses(capsys, mlp_run, model):
    steps = "20" if model == "mlp" else "10"
    p = cli(model, "--steps", steps, "--devices", "4", "--json", *TINY[model])
    assert p.returncode == 0, p.stderr
    four = json.loads(p.stdout)
    assert four["devices"] == 4
    one = mlp_run if model == "mlp" else train(capsys, model, "--steps", steps, *TINY[model])
    assert one["devices"] == 1
    np.testing.assert_allclose(four["losses"], one["losses"], rtol=2e-5, atol=1e-6)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _two_processes(*argv: str) -> list[dict]:
    """``remat train`` as 2 processes on this machine (2 CPU devices each, gloo collectives)."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, "-m", "remat", "train", *argv, "--devices", "4", "--json",
                               "--coordinator", coordinator, "--num-processes", "2", "--process-id", str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
             for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    return [json.loads(out) for out, _ in outs]


@pytest.mark.slow
def test_two_processes_give_the_one_process_losses_and_resume(mlp_run, tmp_path):
    """A real multi-process run, saved half-way with orbax and resumed by both processes."""
    save = str(tmp_path / "run")
    first = _two_processes("mlp", "--steps", "10", "--save-every", "5", "--save-dir", save, *TINY["mlp"])
    resumed = _two_processes("mlp", "--steps", "20", "--resume", "--save-dir", save, *TINY["mlp"])
    for a, b in zip(first, resumed, strict=True):
        assert a["devices"] == b["devices"] == 4 and a["processes"] == 2
        assert b["resumed_from"] == 10
        np.testing.assert_allclose(b["losses"], mlp_run["losses"], rtol=2e-5, atol=1e-6)
        assert b["losses"][:10] == a["losses"]
    assert resumed[0]["losses"] == resumed[1]["losses"]  # the same replicated loss on both


#: How far a --mesh data=2,fsdp=2 run's losses may be from the one-device run's, relative.
#: The sharded step sums the batch mean and the gradients in another order (per-device
#: partial sums, then an all-reduce or reduce-scatter over 4 devices), each sum rounded
#: anew in float32 (eps 1.19e-7), and Adam carries the difference into the next steps.
#: Measured over 20 steps (docs/cli.md): at most 1.7e-7; 2e-6 leaves a tenfold margin.
MESH_RTOL = 2e-6


def test_a_one_device_mesh_is_the_plain_run(capsys, mlp_run):
    d = train(capsys, "mlp", "--steps", "3", "--mesh", "data=1", *TINY["mlp"])
    assert d["mesh"] == {"data": 1, "fsdp": 1} and mlp_run["mesh"] == {"data": 1, "fsdp": 1}
    assert d["losses"] == mlp_run["losses"][:3]
    assert d["state_bytes_per_device"] == d["state_bytes"] > 0  # one device holds everything


@pytest.mark.slow
def test_fsdp_mesh_gives_the_one_device_losses_and_resumes(mlp_run, tmp_path):
    p = cli("mlp", "--steps", "20", "--mesh", "data=2,fsdp=2", "--json", *TINY["mlp"])
    assert p.returncode == 0, p.stderr
    mesh = json.loads(p.stdout)
    assert mesh["devices"] == 4 and mesh["mesh"] == {"data": 2, "fsdp": 2}
    # parameters and Adam's moments split in two over fsdp (the scalars and odd biases replicated)
    assert mesh["state_bytes_per_device"] < 0.55 * mesh["state_bytes"]
    np.testing.assert_allclose(mesh["losses"], mlp_run["losses"], rtol=MESH_RTOL, atol=0)
    save = str(tmp_path / "run")
    half = cli("mlp", "--steps", "10", "--save-every", "5", "--save-dir", save, "--mesh", "data=2,fsdp=2",
               "--json", *TINY["mlp"])
    assert half.returncode == 0, half.stderr
    resumed = cli("mlp", "--steps", "20", "--resume", "--save-dir", save, "--mesh", "data=2,fsdp=2", "--json",
                  *TINY["mlp"])
    assert resumed.returncode == 0, resumed.stderr
    r = json.loads(resumed.stdout)
    assert r["resumed_from"] == 10 and r["losses"] == mesh["losses"]  # the sharded state restored exactly


@pytest.mark.slow
def test_two_processes_on_an_fsdp_mesh_give_the_one_device_losses_and_resume(mlp_run, tmp_path):
    """2 processes of 2 CPU devices, one data=2,fsdp=2 mesh; saved half-way (orbax writes
    each process's shards) and resumed by both."""
    save = str(tmp_path / "run")
    mesh = ("--mesh", "data=2,fsdp=2", *TINY["mlp"])
    first = _two_processes("mlp", "--steps", "10", "--save-every", "5", "--save-dir", save, *mesh)
    resumed = _two_processes("mlp", "--steps", "20", "--resume", "--save-dir", save, *mesh)
    for a, b in zip(first, resumed, strict=True):
        assert b["processes"] == 2 and b["mesh"] == {"data": 2, "fsdp": 2} and b["resumed_from"] == 10
        assert b["losses"][:10] == a["losses"]
        np.testing.assert_allclose(b["losses"], mlp_run["losses"], rtol=MESH_RTOL, atol=0)
    assert resumed[0]["losses"] == resumed[1]["losses"]


def _finished_saves(directory: str) -> list[int]:
    try:
        return sorted(int(n) for n in os.listdir(directory) if n.isdigit())
    except FileNotFoundError:
        return []


@pytest.mark.slow
def test_killed_run_resumes_to_exactly_the_uninterrupted_losses(tmp_path):
    """SIGKILL as soon as the first save is complete on disk, then resume.

    A save every 10 steps makes the run long enough to be caught in the middle: each
    orbax save (written to a temporary directory, then renamed) takes far longer than
    10 steps of the tiny MLP, so after the first save appears some 29 remain, and the
    kill most likely lands inside one of them, which must leave the finished ones intact.
    """
    save = str(tmp_path / "run")
    steps = 300
    args = ["mlp", "--steps", str(steps), "--save-every", "10", *TINY["mlp"], "--json"]
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "remat", "train", *args, "--save-dir", save],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + 150
        while not _finished_saves(save):
            assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
            assert time.monotonic() < deadline, "no save appeared"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    saved = _finished_saves(save)
    assert saved and saved[-1] < steps

    resumed = cli(*args, "--save-dir", save, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    r = json.loads(resumed.stdout)
    assert r["resumed_from"] == saved[-1] and len(r["losses"]) == steps

    ref = cli(*args)
    assert ref.returncode == 0, ref.stderr
    assert r["losses"] == json.loads(ref.stdout)["losses"]  # bitwise, not approximately

    # A damaged save (its array data overwritten) is reported in one line, with what to do.
    broken = str(tmp_path / "broken")
    shutil.copytree(save, broken)
    last = os.path.join(broken, str(max(_finished_saves(broken))))
    for root, _, files in os.walk(os.path.join(last, "state")):
        for name in files:
            if "/d" in root or name.endswith(".ocdbt"):
                with open(os.path.join(root, name), "wb") as fh:
                    fh.write(b"garbage")
    bad = cli(*args, "--save-dir", broken, "--resume")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("remat: error: --resume: the save") and bad.stderr.count("\n") == 1, bad.stderr
    assert "delete" in bad.stderr


# --- the task API (remat.models.tasks), shared by remat train/plan/profile and the benchmarks


def test_task_api_by_keywords():
    import jax

    from remat.models.tasks import make_task, pure_step_loss

    task = make_task("mlp", depth=1, width=16, batch_size=4, policy="dots", seed=3)
    assert (task.kind, task.policy, task.batch_size) == ("regression", "dots", 4)
    (x,), y = task.batch(0)
    assert x.shape == (4, 16) and y.shape == (4, 8)
    assert np.array_equal(task.batch(5)[0][0], make_task("mlp", depth=1, width=16, batch_size=4, seed=3).batch(5)[0][0])
    loss, (params, inputs, targets) = pure_step_loss(task)
    assert np.isfinite(float(jax.jit(loss)(params, inputs, targets)))  # compiled: op by op, each op compiles


def test_every_registry_entry_names_its_training(monkeypatch):
    from flax import nnx

    from remat.models import MODELS, tasks

    for name, entry in MODELS.items():
        assert entry.module is not None and entry.task in ("regression", "char-lm", "images"), name
    # the weights are not what this checks: the model built abstract, without its compiled initialisation
    # (test_models.py builds a transformer task in full)
    monkeypatch.setattr(tasks, "init_model", lambda cls, config, seed: nnx.eval_shape(
        lambda: cls(config, rngs=nnx.Rngs(seed))))
    assert tasks.make_task("transformer", depth=1, width=16, seq_len=8, batch_size=2).kind == "char-lm"


def test_task_errors_name_keywords_and_the_cli_spells_them_as_flags():
    from remat.cli._common import flag
    from remat.models.tasks import TaskError, make_task

    with pytest.raises(TaskError) as e:
        make_task("mlp", seq_len=8)
    assert str(e.value).startswith("seq_len does not apply to mlp")
    assert e.value.spelled(flag).startswith("--seq-len does not apply to mlp")
    with pytest.raises(TaskError) as e:
        make_task("seed-model", depth=2, width=3)
    assert e.value.spelled(flag).startswith("--depth and --width do not apply")
    with pytest.raises(TaskError, match="batch_size must be at least 1"):
        make_task("mlp", batch_size=0)
    with pytest.raises(TaskError, match="policy does not apply to a factory"):
        make_task("my.py:build", policy="dots")


def test_mixed_precision_follows_the_float32_loss_curve(capsys, mlp_run):
    d = train(capsys, "mlp", "--steps", "20", "--precision", "mixed", *TINY["mlp"])
    assert d["precision"] == "mixed" and d["config"]["precision"] == "mixed" and mlp_run["precision"] == "float32"
    assert falls(d["losses"])
    assert d["losses"] != mlp_run["losses"]  # bfloat16 compute really ran
    # same data, same start: bfloat16 rounding moves the curve by percents, not more
    assert np.allclose(d["losses"], mlp_run["losses"], rtol=0.05)
