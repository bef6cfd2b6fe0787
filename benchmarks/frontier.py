"""Each framework's Pareto frontier of saved bytes against step time, and the goal against torch.compile.

``python -m benchmarks.run --frontier`` measures the variants below (the MLP and the
transformer at 8 and 16 blocks, both frameworks in one process per model and depth,
interleaved rounds) and writes ``frontier.md`` and ``frontier.png`` beside the usual
results. remat's points are the fixed policies and ``remat.plan`` at budgets 0, 0.25, 0.5,
0.75 and 1; PyTorch's are eager (``no_checkpoint``, ``nothing``) and ``torch.compile`` at
``activation_memory_budget`` 1.0, 0.5, 0.25 and 0.0.
"""
from __future__ import annotations

import os
from typing import Any

from benchmarks.cases import BLOCK_POLICIES, PLAN_VARIANTS, TORCH_COMPILE_VARIANTS, compile_budget
from remat._names import NO_CHECKPOINT

FRONTIER_JAX: tuple[str, ...] = (
    *BLOCK_POLICIES, "names", "sequential", "whole", "whole_nested", *PLAN_VARIANTS,
)
FRONTIER_TORCH: tuple[str, ...] = (NO_CHECKPOINT, "nothing", *TORCH_COMPILE_VARIANTS)
FRONTIER_DEPTHS: tuple[int, ...] = (8, 16)

MiB = 2**20


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / MiB:.2f} MiB" if n >= MiB // 10 else f"{n / 1024:.1f} KiB"


def pareto(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows no other row beats on both saved bytes and step time, by saved bytes."""
    out = []
    for r in rows:
        dominated = any(
            o["saved_bytes"] <= r["saved_bytes"] and o["step_ms"] <= r["step_ms"]
            and (o["saved_bytes"] < r["saved_bytes"] or o["step_ms"] < r["step_ms"])
            for o in rows
        )
        if not dominated:
            out.append(r)
    return sorted(out, key=lambda r: (r["saved_bytes"], r["step_ms"]))


def _groups(rows: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return sorted({(r["model"], r["depth"]) for r in rows})


def _sel(rows: list[dict[str, Any]], model: str, depth: int, framework: str) -> list[dict[str, Any]]:
    return [r for r in rows if (r["model"], r["depth"], r["framework"]) == (model, depth, framework)
            and r.get("step_ms") is not None and r.get("saved_bytes") is not None]


def goal(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For every torch.compile point: remat's fastest point keeping at most its saved bytes.

    ``met``: that point's step time is at most the torch.compile point's (ratio <= 1.0).
    """
    out = []
    for model, depth in _groups(rows):
        jax_rows = _sel(rows, model, depth, "jax")
        for t in _sel(rows, model, depth, "torch"):
            if t["variant"] not in TORCH_COMPILE_VARIANTS:
                continue
            leaner = [j for j in jax_rows if j["saved_bytes"] <= t["saved_bytes"]]
            best = min(leaner, key=lambda j: j["step_ms"]) if leaner else None
            ratio = best["step_ms"] / t["step_ms"] if best else None
            out.append({"model": model, "depth": depth, "torch_variant": t["variant"],
                        "torch_saved_bytes": t["saved_bytes"], "torch_step_ms": t["step_ms"],
                        "remat_variant": best and best["variant"],
                        "remat_saved_bytes": best and best["saved_bytes"],
                        "remat_step_ms": best and best["step_ms"], "ratio": ratio,
                        "met": ratio is not None and ratio <= 1.0})
    return out


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
            + ["| " + " | ".join(r) + " |" for r in body])


def _label(r: dict[str, Any]) -> str:
    choice = r.get("plan_choice")
    return f"{r['variant']} ({choice})" if choice else r["variant"]


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """``frontier.md``: the frontiers, the goal, and planning beside compiling."""
    lines = ["# Pareto frontiers: saved bytes against step time", "",
             f"JAX {meta.get('jax', '?')}, PyTorch {meta.get('torch', '?')}, {meta.get('threads', '?')} threads; "
             f"load average at start {meta.get('loadavg', '?')}; run {meta.get('wall_s', 0):.0f} s.", ""]
    body = []
    for model, depth in _groups(rows):
        for fw in ("jax", "torch"):
            for r in pareto(_sel(rows, model, depth, fw)):
                body.append([model, str(depth), "remat" if fw == "jax" else "PyTorch", _label(r),
                             _size(r["saved_bytes"]), f"{r['step_ms']:.1f}",
                             _size(r.get("peak_rss_bytes")), _size(r.get("temp_bytes"))])
    lines += _table(["model", "depth", "framework", "point", "saved", "step ms", "step peak RSS", "XLA temp"], body)
    lines += ["", "## remat against every torch.compile point", ""]
    lines += _table(
        ["model", "depth", "torch.compile", "its saved", "its ms", "remat's fastest with <= saved", "saved", "ms",
         "ratio", "met"],
        [[g["model"], str(g["depth"]), g["torch_variant"], _size(g["torch_saved_bytes"]),
          f"{g['torch_step_ms']:.1f}", g["remat_variant"] or "-", _size(g["remat_saved_bytes"]),
          "-" if g["remat_step_ms"] is None else f"{g['remat_step_ms']:.1f}",
          "-" if g["ratio"] is None else f"{g['ratio']:.2f}", "met" if g["met"] else "missed"]
         for g in goal(rows)])
    lines += ["", "## Planning time beside torch.compile's compile time (seconds)", ""]
    body = []
    for model, depth in _groups(rows):
        plans = [r for r in _sel(rows, model, depth, "jax") if r["variant"].startswith("plan_")]
        compiles = [r for r in _sel(rows, model, depth, "torch") if r["variant"] in TORCH_COMPILE_VARIANTS]
        body.append([model, str(depth),
                     ", ".join(f"{r['variant'].removeprefix('plan_')}: {r['compile_s']:.0f}" for r in plans) or "-",
                     f"{sum(r['compile_s'] for r in plans):.0f}" if plans else "-",
                     ", ".join(f"{compile_budget(r['variant'])}: {r['compile_s']:.0f}" for r in compiles) or "-",
                     f"{sum(r['compile_s'] for r in compiles):.0f}" if compiles else "-"])
    lines += _table(["model", "depth", "remat.plan, by budget (one shared cache, in this order)", "all plans",
                     "torch.compile first step, by activation_memory_budget", "all compiles"], body)
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: str | os.PathLike) -> str:
    """``frontier.png``: one panel per (model, depth), both frameworks' points and frontiers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _groups(rows) or [("-", 0)]
    cols = 2
    nrows = (len(groups) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(12, 4.6 * nrows), dpi=110, squeeze=False)
    for ax, (model, depth) in zip(axes.flat, groups):
        for fw, marker, color, name in (("jax", "o", "tab:blue", "remat"), ("torch", "^", "tab:red", "PyTorch")):
            pts = _sel(rows, model, depth, fw)
            ax.scatter([r["step_ms"] for r in pts], [max(r["saved_bytes"], 1) / MiB for r in pts],
                       marker=marker, color=color, alpha=0.5, label=f"{name} points")
            front = pareto(pts)
            ax.step([r["step_ms"] for r in front], [max(r["saved_bytes"], 1) / MiB for r in front],
                    where="post", color=color, label=f"{name} frontier")
            for r in pts:
                ax.annotate(r["variant"].replace("torch_compile_", "tc_"),
                            (r["step_ms"], max(r["saved_bytes"], 1) / MiB),
                            textcoords="offset points", xytext=(3, 3), fontsize=6, color=color)
        if any(r["saved_bytes"] > 0 for r in _sel(rows, model, depth, "jax") + _sel(rows, model, depth, "torch")):
            ax.set_yscale("log")
        ax.set_xlabel("median step time (ms)")
        ax.set_ylabel("saved for backward, no params (MiB, log)")
        ax.set_title(f"{model}, {depth} blocks")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(groups):]:
        ax.set_visible(False)
    fig.suptitle("saved bytes against step time: remat vs PyTorch (eager and torch.compile)")
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png")
    plt.close(fig)
    return os.fspath(path)
