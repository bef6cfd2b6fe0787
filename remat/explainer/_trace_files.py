"""The timeline of an explained step as a picture and as files that existing viewers open.

* :func:`plot_timeline`: a PNG (matplotlib, no global backend change): live temp bytes
  per step with the peak and the start of the backward pass marked, and the lifetimes of
  the largest buffers at the peak, labelled.
* :func:`write_trace`: ``.json`` is the Chrome trace event format that Perfetto
  (https://ui.perfetto.dev) and ``chrome://tracing`` open: a counter of live bytes, one
  slice per value (lanes so that slices on one track never overlap), instants for the
  peak and the backward pass. ``.pickle`` is PyTorch's memory snapshot
  (``torch.cuda.memory._snapshot()``'s format) for https://pytorch.org/memory_viz: one
  segment (the temp buffer), every value's alloc and free with its Python frames.

A step is one event of XLA's heap simulation; trace timestamps count steps as microseconds.
"""
from __future__ import annotations

import json
import os
import pickle
from typing import Any

from remat._core.residuals import format_bytes

_BASE_ADDRESS = 1 << 32  # where the temp buffer "starts" in the snapshot; offsets are XLA's


def _label(buffer: Any) -> str:
    where = " ".join(x for x in (buffer.module, f"({buffer.source})" if buffer.source else None) if x)
    return f"{format_bytes(buffer.bytes)} {buffer.kind}" + (f" {where}" if where else f" {buffer.op}")


_KIND_COLORS = {"residual": "tab:orange", "recomputed value": "tab:purple", "gradient": "tab:green",
                "other temporary": "lightgray"}


def _bytes_by_kind(report: Any) -> dict[str, list[int]]:
    """Live temp bytes per kind after each step."""
    t = report.timeline
    deltas: dict[str, list[int]] = {}
    for occ in t.occupancies:
        kind = getattr(report.step_labels.get(occ.buffer_id), "kind", "other temporary")
        d = deltas.setdefault(kind, [0] * (t.steps + 1))
        d[occ.start] += occ.size
        d[min(occ.end, t.steps)] -= occ.size
    out = {}
    for kind in sorted(deltas, key=lambda k: list(_KIND_COLORS).index(k) if k in _KIND_COLORS else 99):
        running, series = 0, []
        for delta in deltas[kind][:t.steps]:
            running += delta
            series.append(running)
        out[kind] = series
    return out


def plot_timeline(report: Any, path: str, *, top: int = 5, title: str | None = None) -> str:
    """Writes ``path`` (PNG); returns it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    t = report.timeline
    mib = 2.0 ** 20
    fig = Figure(figsize=(11, 6.5))
    FigureCanvasAgg(fig)
    ax, lanes = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    steps = range(t.steps)
    kinds = _bytes_by_kind(report)
    if kinds:
        ax.stackplot(steps, *[[b / mib for b in series] for series in kinds.values()], labels=list(kinds),
                     colors=[_KIND_COLORS.get(k, "lightgray") for k in kinds], alpha=0.75)
    ax.plot(steps, [b / mib for b in t.live_bytes], color="black", lw=0.8, label="live temp bytes")
    ax.axhline(report.temp_bytes / mib, color="gray", ls=":", lw=1,
               label=f"temp buffer {format_bytes(report.temp_bytes)}")
    if t.steps:
        ax.plot([t.peak], [t.live_bytes[t.peak] / mib], "v", color="tab:red", ms=9,
                label=f"peak: {format_bytes(t.live_bytes[t.peak])} live at step {t.peak}")
    if report.backward_step is not None:
        for a in (ax, lanes):
            a.axvline(report.backward_step, color="tab:green", ls="--", lw=1)
        ax.text(report.backward_step, ax.get_ylim()[1] * 0.03, " backward pass ->", color="tab:green",
                va="bottom", fontsize=9)
    ax.set_ylabel("MiB")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(title or f"remat explain {report.function}: temp memory over the compiled schedule", fontsize=10)
    def order(o: Any) -> tuple:  # largest first; among equals residuals, then the longest lived
        kind = getattr(report.step_labels.get(o.buffer_id), "kind", "")
        return -o.size, kind != "residual", o.start - o.end

    largest = sorted(t.live_at(t.peak), key=order)[:top]
    for row, occ in enumerate(largest):
        buffer = report.step_labels.get(occ.buffer_id)
        lanes.broken_barh([(occ.start, max(occ.end - occ.start, 1))], (row - 0.4, 0.8), color=f"C{row % 10}")
        lanes.text(occ.start, row, " " + (_label(buffer) if buffer else format_bytes(occ.size)), va="center",
                   fontsize=8)
    lanes.set_yticks([])
    lanes.set_ylim(len(largest) - 0.5, -0.5)
    lanes.set_xlabel("step (XLA heap simulation event)")
    lanes.set_title(f"lifetimes of the {len(largest)} largest buffers at the peak", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png", dpi=110)
    return os.fspath(path)


def write_trace(report: Any, path: str) -> str:
    """``.pickle``/``.pkl``: PyTorch memory snapshot; anything else: Chrome trace JSON. Returns ``path``."""
    path = os.fspath(path)
    if path.endswith((".pickle", ".pkl")):
        with open(path, "wb") as f:
            pickle.dump(memory_snapshot(report), f)
    else:
        with open(path, "w") as f:
            json.dump(chrome_trace(report), f)
    return path


def _lanes(occupancies: list[Any]) -> dict[int, int]:
    """A lane per occupancy such that the occupancies of one lane never overlap in time."""
    ends: list[int] = []
    lane_of = {}
    for i, occ in sorted(enumerate(occupancies), key=lambda x: (x[1].start, x[1].end)):
        for lane, end in enumerate(ends):
            if end <= occ.start:
                ends[lane] = max(occ.end, occ.start + 1)
                lane_of[i] = lane
                break
        else:
            lane_of[i] = len(ends)
            ends.append(max(occ.end, occ.start + 1))
    return lane_of


def chrome_trace(report: Any) -> dict[str, Any]:
    """The Trace Event Format (``{"traceEvents": [...]}``) of the report's timeline."""
    t = report.timeline
    pid = 1
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": pid, "tid": 0, "name": "process_name",
         "args": {"name": f"remat explain {report.function}: XLA temp buffer {format_bytes(report.temp_bytes)}"}},
        {"ph": "M", "pid": pid, "tid": 0, "name": "thread_name", "args": {"name": "markers"}},
    ]
    for step, live in enumerate(t.live_bytes):
        events.append({"ph": "C", "pid": pid, "tid": 0, "ts": step, "name": "live temp bytes",
                       "args": {"bytes": live}})
    occupancies = list(t.occupancies)
    lanes = _lanes(occupancies)
    for lane in sorted(set(lanes.values())):
        events.append({"ph": "M", "pid": pid, "tid": lane + 1, "name": "thread_name",
                       "args": {"name": f"values {lane}"}})
    for i, occ in enumerate(occupancies):
        buffer = report.step_labels.get(occ.buffer_id)
        args = {"bytes": occ.size, "offset": occ.offset}
        if buffer is not None:
            args.update(kind=buffer.kind, shape=buffer.shape, op=buffer.op, source=buffer.source or "",
                        module=buffer.module or "", region=buffer.region or "", rule=buffer.rule or "")
        events.append({"ph": "X", "pid": pid, "tid": lanes[i] + 1, "ts": occ.start,
                       "dur": max(occ.end - occ.start, 1), "cat": buffer.kind if buffer else "value",
                       "name": _label(buffer) if buffer else format_bytes(occ.size), "args": args})
    if t.steps:
        events.append({"ph": "i", "pid": pid, "tid": 0, "ts": t.peak, "s": "g",
                       "name": f"peak: {format_bytes(t.live_bytes[t.peak])} live", "args": {}})
    if report.backward_step is not None:
        events.append({"ph": "i", "pid": pid, "tid": 0, "ts": report.backward_step, "s": "g",
                       "name": "backward pass begins", "args": {}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"temp_bytes": report.temp_bytes, "note": "ts counts XLA heap simulation steps"}}


def _frames(report: Any, buffer_id: int) -> list[dict[str, Any]]:
    """PyTorch snapshot frames, innermost first: a first frame naming the value, then its Python stack."""
    buffer = report.step_labels.get(buffer_id)
    frames = [{"filename": "<xla>", "line": 0, "name": _label(buffer) if buffer else "value"}]
    program = report.program
    if program is not None and buffer_id in program.buffers:
        ins = program.instructions.get(program.buffers[buffer_id].instruction_id)
        if ins is not None:
            frames += [{"filename": f.file, "line": f.line, "name": f.function} for f in ins.frames]
    return frames


def memory_snapshot(report: Any) -> dict[str, Any]:
    """PyTorch's memory snapshot of the temp buffer: its whole history, and its state after the step."""
    t = report.timeline
    trace: list[dict[str, Any]] = [{"action": "segment_alloc", "addr": _BASE_ADDRESS, "size": t.size,
                                    "stream": 0, "frames": [], "time_us": 0}]
    changes: list[tuple[int, int, dict[str, Any]]] = []
    for occ in t.occupancies:
        entry = {"addr": _BASE_ADDRESS + occ.offset, "size": occ.size, "stream": 0,
                 "frames": _frames(report, occ.buffer_id)}
        changes.append((occ.start, 1, {"action": "alloc", **entry, "time_us": occ.start}))
        for action in ("free_requested", "free_completed"):
            changes.append((occ.end, 0, {"action": action, **entry, "time_us": occ.end}))
    changes.sort(key=lambda c: (c[0], c[1]))  # at one step, frees before allocs: in-place reuse
    trace.extend(c[2] for c in changes)
    segment = {"device": 0, "address": _BASE_ADDRESS, "total_size": t.size, "allocated_size": 0, "active_size": 0,
               "requested_size": 0, "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
               "is_expandable": False, "frames": [],
               "blocks": [{"address": _BASE_ADDRESS, "size": t.size, "requested_size": 0, "state": "inactive",
                           "frames": []}]}
    return {"segments": [segment] if t.size else [], "device_traces": [trace],
            "allocator_settings": {}, "external_annotations": []}
