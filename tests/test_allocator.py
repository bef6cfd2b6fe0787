"""``remat.keep_freed_memory``: XLA:CPU's per-step temp buffer stops being page-faulted afresh.

Each case runs in a fresh interpreter: the allocator settings are process-wide and must be
made before JAX starts its threads.
"""
import json
import statistics
import subprocess
import sys
import textwrap

import pytest

from remat.analysis import allocator as _allocator

pytestmark = pytest.mark.skipif(_allocator._glibc() is None, reason="needs glibc")

# A jitted program whose temp buffer is 128 MiB (32768 pages of 4 KiB), and the minor page
# faults each of 40 executions costs.
_PROGRAM = textwrap.dedent("""
    import json, resource, sys
    import remat
    kept = remat.keep_freed_memory() if sys.argv[1] == "keep" else None
    import jax, jax.numpy as jnp
    f = jax.jit(lambda x: jnp.sum(jnp.sin(x) * jnp.cos(x[::-1])))
    x = jnp.ones((4096, 4096))
    temp = f.lower(x).compile().memory_analysis().temp_size_in_bytes
    faults = []
    for _ in range(40):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        f(x).block_until_ready()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps({"kept": kept, "temp": temp, "faults": faults}))
""")


def _run(mode: str) -> dict:
    import json

    out = subprocess.run([sys.executable, "-c", _PROGRAM, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_temp_buffer_is_no_longer_faulted_in_every_step():
    default, kept = _run("default"), _run("keep")
    pages = default["temp"] / 4096
    assert default["temp"] == kept["temp"] == 128 * 2**20
    # Measured by default: 32768-32770 faults in every step (each page of the buffer).
    # Kept: a step faults the buffer in only when the heap grows (small blocks allocated
    # between steps split the freed buffer's chunk until the heap holds enough); measured
    # 2-9 such steps in 40, mostly in the first 15, up to 5 in steps 10-19 on a loaded
    # machine; every other step faults 0-2 pages.
    assert min(default["faults"][5:]) >= 0.9 * pages, default
    assert kept["kept"] is True
    assert sum(f > 0.5 * pages for f in kept["faults"]) <= 20, kept
    assert statistics.median(kept["faults"][20:]) <= 0.01 * pages, kept


# One fresh interpreter for the two checks below (each pays JAX's import): the settings are
# process-wide, so they are made there, not in the test process. malloc_mode and trim_heap run
# first, before JAX starts; then JAX starts and keep_freed_memory() is called after it.
_FRESH = textwrap.dedent("""
    import json, warnings
    from remat.analysis import allocator as a
    modes = [a.malloc_mode('measure'), a.malloc_mode('time'), a.trim_heap(), a.glibc() is a._glibc()]
    try:
        a.malloc_mode('fast')
        error = None
    except ValueError as e:
        error = str(e)
    import jax.numpy as jnp, remat
    jnp.ones(1).block_until_ready()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        kept = remat.keep_freed_memory()
    print(json.dumps({"modes": modes, "error": error, "kept": kept, "warnings": [str(x.message) for x in w]}))
""")


@pytest.fixture(scope="module")
def fresh_interpreter() -> dict:
    out = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_after_jax_started_it_warns_how_to_call_it(fresh_interpreter):
    assert fresh_interpreter["kept"] is True
    messages = fresh_interpreter["warnings"]
    assert messages and messages[0].startswith("keep_freed_memory() after JAX started"), messages
    assert "call it before the first JAX computation" in messages[0]


@pytest.mark.parametrize("command", [["plan", "mlp", "--budget", "0.5"], ["train", "mlp"], ["profile", "mlp"]])
def test_the_commands_take_keep_freed_memory(command, monkeypatch):
    from remat.cli import build_parser
    from remat.cli._common import apply_keep_freed_memory_flag

    calls = []
    monkeypatch.setattr(_allocator, "keep_freed_memory", lambda: calls.append(1) or True)
    args = build_parser().parse_args([*command, "--keep-freed-memory"])
    assert args.keep_freed_memory is True
    apply_keep_freed_memory_flag(args)
    apply_keep_freed_memory_flag(build_parser().parse_args(command))  # without the flag: no call
    assert calls == [1]



def test_malloc_mode_and_trim_heap_go_through_the_one_glibc_handle(fresh_interpreter):
    assert fresh_interpreter["modes"] == [True, True, True, True]
    assert fresh_interpreter["error"] == "mode must be 'measure' or 'time', got 'fast'"


_PROBE = textwrap.dedent("""
    import json, sys
    import remat
    from remat.analysis.allocator import fault_s_per_byte
    kept = remat.keep_freed_memory() if sys.argv[1] == "keep" else None
    print(json.dumps({"kept": kept, "fault": [fault_s_per_byte() for _ in range(3)]}))
""")


# it compares measured times (fault_s_per_byte is a timing): slow, never in the default run;
# test_the_temp_buffer_is_no_longer_faulted_in_every_step counts the same faults, not their time
@pytest.mark.slow
def test_the_fault_probe_sees_fresh_maps_by_default_and_none_once_freed_memory_is_kept():
    runs = {}
    for mode in ("default", "keep"):
        out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        runs[mode] = statistics.median(json.loads(out.stdout.strip().splitlines()[-1])["fault"])
    # measured: 0.25-0.35 ms per MiB filled afresh on two cores by default (a page fault and
    # a zeroed page per 4 KiB); kept, the freed block comes back and the difference is noise
    assert runs["default"] * 2**20 > 0.02e-3, runs
    assert runs["keep"] < 0.2 * runs["default"], runs
