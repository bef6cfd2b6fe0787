"""From rows to results: JAX/PyTorch ratios, targets, Markdown, plot."""
from __future__ import annotations

import math
import os
from typing import Any

from benchmarks.cases import JAX_VARIANTS, PLAN_VARIANTS, TORCH_VARIANTS, add_overheads
from remat._names import NO_CHECKPOINT

MiB = 2**20


def _mib(n: Any) -> str:
    return "-" if n is None else f"{n / MiB:.1f}"


def _find(rows: list[dict], framework: str, model: str, depth: int, variant: str) -> dict | None:
    for r in rows:
        if (r["framework"], r["model"], r["depth"], r["variant"]) == (framework, model, depth, variant):
            return r
    return None


def _ratio(a: Any, b: Any) -> float | None:
    if a is None or b is None or not b:
        return None
    return a / b


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def models_depths(rows: list[dict]) -> list[tuple[str, int]]:
    return sorted({(r["model"], r["depth"]) for r in rows})


def jax_torch_ratios(rows: list[dict]) -> list[dict[str, Any]]:
    """For each variant both frameworks have: JAX/PyTorch step_ms and saved_bytes ratios."""
    out = []
    for model, depth in models_depths(rows):
        for v in TORCH_VARIANTS:
            j, t = _find(rows, "jax", model, depth, v), _find(rows, "torch", model, depth, v)
            if j is None or t is None:
                continue
            out.append({
                "model": model, "depth": depth, "variant": v,
                "step_ms_jax": j["step_ms"], "step_ms_torch": t["step_ms"],
                "step_ms_ratio": _ratio(j["step_ms"], t["step_ms"]),
                "saved_bytes_jax": j["saved_bytes"], "saved_bytes_torch": t["saved_bytes"],
                "saved_bytes_ratio": _ratio(j["saved_bytes"], t["saved_bytes"]),
                "peak_rss_ratio": _ratio(j["peak_rss_bytes"], t["peak_rss_bytes"]),
            })
    return out


def _target_depth(rows: list[dict], model: str, want: int = 16) -> int | None:
    depths = sorted({r["depth"] for r in rows if r["model"] == model})
    if not depths:
        return None
    return want if want in depths else depths[-1]


def targets(rows: list[dict]) -> list[dict[str, Any]]:
    """The issue's targets, each ``{"target", "met", "figures"}`` (``met`` None: not measurable)."""
    out: list[dict[str, Any]] = []

    def add(name: str, met: bool | None, figures: str) -> None:
        out.append({"target": name, "met": met, "figures": figures})

    d = _target_depth(rows, "transformer")
    if d is not None:
        none = _find(rows, "jax", "transformer", d, NO_CHECKPOINT)
        for variant, temp_max, ovh_max in (("nothing", 0.20, 1.40), ("dots", 0.60, 1.15)):
            r = _find(rows, "jax", "transformer", d, variant)
            if r is None or none is None:
                add(f"transformer {d} layers, {variant}", None, "not measured")
                continue
            temp = _ratio(r["temp_bytes"], none["temp_bytes"])
            ok = temp is not None and temp <= temp_max and r["overhead"] <= ovh_max
            add(f"transformer {d} layers, per-block {variant}: temp <= {temp_max:.0%} of no_checkpoint, "
                f"overhead <= {ovh_max:.2f}",
                ok, f"temp {_mib(r['temp_bytes'])} / {_mib(none['temp_bytes'])} MiB = {temp:.1%}; "
                    f"overhead {r['overhead']:.2f}")
    for model, depth in models_depths(rows):
        j, t = _find(rows, "jax", model, depth, "nothing"), _find(rows, "torch", model, depth, "nothing")
        if j is None or t is None:
            continue
        ok_t = j["step_ms"] <= t["step_ms"]
        ok_b = j["saved_bytes"] <= t["saved_bytes"]
        add(f"{model} {depth} layers, nothing: JAX step_ms <= PyTorch", ok_t,
            f"{j['step_ms']:.1f} vs {t['step_ms']:.1f} ms (ratio {j['step_ms'] / t['step_ms']:.2f})")
        add(f"{model} {depth} layers, nothing: JAX saved_bytes <= PyTorch", ok_b,
            f"{_mib(j['saved_bytes'])} vs {_mib(t['saved_bytes'])} MiB (ratio "
            f"{_fmt(_ratio(j['saved_bytes'], t['saved_bytes']))})")
    for model in sorted({r["model"] for r in rows}):
        ds = sorted({r["depth"] for r in rows if r["model"] == model and r["variant"] == "scan_nested"})
        if len(ds) < 2:
            continue
        lo, hi = (4, 16) if 4 in ds and 16 in ds else (ds[0], ds[-1])
        a, b = _find(rows, "jax", model, lo, "scan_nested"), _find(rows, "jax", model, hi, "scan_nested")
        growth = b["temp_bytes"] / a["temp_bytes"]
        bound = math.sqrt(hi / lo)
        add(f"{model} scan_nested: temp grows <= sqrt(depth) from {lo} to {hi} layers (<= {bound:.2f}x)",
            growth <= bound, f"{_mib(a['temp_bytes'])} -> {_mib(b['temp_bytes'])} MiB = {growth:.2f}x")
    return out


# --------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def results_table(rows: list[dict]) -> list[str]:
    order = {("jax", v): i for i, v in enumerate(JAX_VARIANTS + PLAN_VARIANTS)}
    order.update({("torch", v): 100 + i for i, v in enumerate(TORCH_VARIANTS)})
    body = []
    for model, depth in models_depths(rows):
        none = _find(rows, "jax", model, depth, NO_CHECKPOINT)
        sel = sorted((r for r in rows if (r["model"], r["depth"]) == (model, depth)),
                     key=lambda r: order.get((r["framework"], r["variant"]), 999))
        for r in sel:
            temp_rel = (_fmt(_ratio(r["temp_bytes"], none["temp_bytes"]))
                        if r["temp_bytes"] is not None and none else "-")
            body.append([
                model, str(depth), r["framework"], r["variant"], _mib(r["saved_bytes"]), _mib(r["temp_bytes"]),
                temp_rel, _mib(r["peak_rss_bytes"]), f"{r['step_ms']:.1f}", _fmt(r["overhead"]),
            ])
    return _table(["model", "depth", "framework", "variant", "saved MiB", "temp MiB", "temp / no_checkpoint",
                   "step peak RSS MiB", "step ms", "overhead"], body)


def markdown(rows: list[dict], meta: dict[str, Any]) -> str:
    """The whole ``results.md``."""
    add_overheads(rows)
    lines = [f"# remat benchmark ({meta.get('sizes', '?')})", ""]
    lines += [
        f"JAX {meta.get('jax', '?')}, PyTorch {meta.get('torch', '?')}, CPU, "
        f"{meta.get('threads', '?')} threads in both frameworks (XLA:CPU uses one per core; "
        f"`torch.set_num_threads({meta.get('threads', '?')})`). "
        f"XLA_FLAGS in the measuring processes: `{meta.get('xla_flags') or '(none)'}`. "
        f"Total run time {meta.get('wall_s', 0):.0f} s; load average at start {meta.get('loadavg', '?')}.",
        "",
        "Sizes: " + "; ".join(f"{m}: {', '.join(f'{k}={v}' for k, v in kw.items())}"
                              for m, kw in meta.get("model_sizes", {}).items()),
        "",
        "How each figure is measured:",
        "",
        "* **saved**: what the backward pass keeps, *parameters excluded*, inputs and targets "
        "included. JAX: `remat.analysis.saved_residuals` of the loss of the parameters, minus "
        "the residuals that are parameters or computed from them alone. PyTorch: tensors "
        "packed by `torch.autograd.graph.saved_tensors_hooks` during the forward (including "
        "what `torch.utils.checkpoint` saves for its recomputation), deduplicated by storage, "
        "parameter storages left out. (A JAX checkpoint takes the block's parameters as "
        "inputs, so they are residuals; PyTorch's closes over them; both keep them anyway.)",
        "* **temp**: XLA's compiled temp buffer of `jax.jit(jax.grad(loss))` (`memory_analysis()`); "
        "JAX only.",
        "* **step peak RSS**: the increase of the process's peak resident memory during one "
        "training step (high-water mark reset via `/proc/self/clear_refs` right before it), "
        "each (model, depth) in a fresh process, glibc's allocator set (`mallopt`) to mmap buffers "
        "over 128 KiB so freed ones return to the kernel (for the timed steps it is set back to "
        "reuse its heap). Includes the gradients the step returns.",
        "* **step ms**: median of the timed training steps (loss + gradients; JAX jitted, "
        "`block_until_ready`; PyTorch forward + `backward()`) after a warm-up; all variants of "
        "both frameworks for one (model, depth) timed in interleaved rounds in one process, "
        "each framework's variants back to back as in a training loop (a 20 ms pause and one "
        "untimed step whenever the timing switches framework, so neither's spinning threads "
        "slow the other). **overhead**: over the "
        "same framework's `no_checkpoint`.",
        f"* Variants: `names` saves {meta.get('names_policy', {})}; `sequential` uses "
        "round(sqrt(depth)) segments in both frameworks (`remat.checkpoint_sequential`, "
        "`torch.utils.checkpoint.checkpoint_sequential`, use_reentrant=False); PyTorch "
        "`nothing` is `torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)` per block.",
        "",
        "## Results",
        "",
    ]
    lines += results_table(rows)
    lines += ["", "## JAX / PyTorch (equal variants)", ""]
    ratios = jax_torch_ratios(rows)
    lines += _table(
        ["model", "depth", "variant", "JAX ms", "PyTorch ms", "step_ms ratio", "JAX saved MiB",
         "PyTorch saved MiB", "saved_bytes ratio", "peak RSS ratio"],
        [[r["model"], str(r["depth"]), r["variant"], f"{r['step_ms_jax']:.1f}", f"{r['step_ms_torch']:.1f}",
          _fmt(r["step_ms_ratio"]), _mib(r["saved_bytes_jax"]), _mib(r["saved_bytes_torch"]),
          _fmt(r["saved_bytes_ratio"]), _fmt(r["peak_rss_ratio"])] for r in ratios],
    )
    lines += ["", "## targets", ""]
    tg = targets(rows)
    lines += _table(["target", "met", "figures"],
                    [[t["target"], {True: "met", False: "missed", None: "n/a"}[t["met"]], t["figures"]] for t in tg])
    notes = meta.get("notes") or []
    if notes:
        lines += ["", "## notes", ""] + [f"* {n}" for n in notes]
    failures = meta.get("failures") or []
    if failures:
        lines += ["", "## failures", ""] + [f"* {f}" for f in failures]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------------------


def plot(rows: list[dict], path: str | os.PathLike) -> str:
    """``memory_vs_time.png``: per model (largest depth), step time vs measured step peak RSS
    (both frameworks) and vs saved bytes, one point per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows}) or ["-"]
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 4.2 * len(models)), dpi=110, squeeze=False)
    for ax_row, model in zip(axes, models):
        depths = sorted({r["depth"] for r in rows if r["model"] == model})
        depth = depths[-1] if depths else None
        sel = [r for r in rows if r["model"] == model and r["depth"] == depth]
        for ax, key, label in ((ax_row[0], "peak_rss_bytes", "step peak RSS increase (MiB)"),
                               (ax_row[1], "saved_bytes", "saved for backward, no params (MiB)")):
            for fw, marker, color in (("jax", "o", "tab:blue"), ("torch", "^", "tab:red")):
                pts = [r for r in sel if r["framework"] == fw and r[key] is not None]
                ax.scatter([r["step_ms"] for r in pts], [r[key] / MiB for r in pts], marker=marker,
                           color=color, label="JAX" if fw == "jax" else "PyTorch")
                for r in pts:
                    ax.annotate(r["variant"], (r["step_ms"], r[key] / MiB), textcoords="offset points",
                                xytext=(4, 3), fontsize=7, color=color)
            ax.set_xlabel("median step time (ms)")
            ax.set_ylabel(label)
            ax.set_title(f"{model}, {depth} layers")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("activation checkpointing: memory vs time")
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png")
    plt.close(fig)
    return os.fspath(path)
