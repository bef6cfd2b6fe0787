"""The mistakes :func:`remat.explain` names, each with its fix.

A region's policy that keeps nothing or everything, a checkpoint that does not lower the
peak, the largest residual left unchecked.
"""
from __future__ import annotations

import difflib

from remat._core.residuals import format_bytes
from remat.explainer._attribution import Attributor, PeakBuffer
from remat.explainer._module_names import module_of
from remat.explainer._region_residuals import RegionInfo


def mistakes(attributor: Attributor, labels: dict[int, PeakBuffer], buffers: list[PeakBuffer]) -> list[str]:
    """Every mistake found in one explained step, as warnings with their fix.

    Args:
      attributor: the step's attribution (its regions, timeline and buffers).
      labels: each temp buffer's attribution, by buffer id.
      buffers: the buffers at the peak, largest first.
    """
    return (_policy_warnings(attributor.regions) + _saves_nothing(attributor, labels)
            + _largest_residual_unchecked(buffers, attributor.regions))


def _policy_warnings(infos: list[RegionInfo]) -> list[str]:
    """A warning for each region whose policy keeps nothing in it (a misspelled name, say), and for
    each whose policy keeps everything (it recomputes nothing, so its checkpoint saves nothing)."""
    out = []
    for info in infos:
        if info.keeps_everything:
            out.append(f"{info.label}: policy {info.policy} keeps every value its backward pass needs (it "
                       "recomputes nothing the policy would not keep), so the checkpoint saves no memory; fix: a "
                       "policy that keeps less (policy='nothing', 'dots', names), or do not checkpoint it")
            continue
        if not info.policy_matches_nothing:
            continue
        text = f"{info.label}: policy {info.policy} matches nothing in this region, so it keeps only its inputs"
        missing = [n for n in info.saveable_names if n not in info.names]
        if missing and info.names:
            guesses = {n: difflib.get_close_matches(n, info.names, n=1) for n in missing}
            fixed = [guesses[n][0] if guesses.get(n) else n for n in info.saveable_names]
            text += (f"; the names in it are {list(info.names)}"
                     + (f"; fix: policy={fixed!r}" if fixed != list(info.saveable_names) else ""))
        elif missing:
            text += "; no value in it is tagged with remat.checkpoint_name"
        else:
            text += "; fix: policy='nothing' says the same, or pick a policy that matches its operations"
        out.append(text)
    return out


def _saves_nothing(attributor: Attributor, labels: dict[int, PeakBuffer]) -> list[str]:
    """The region whose backward runs first (the last layer, or the whole function) saves no
    memory when undoing its checkpoint would not raise the peak: estimated from the schedule
    as the live bytes between its forward and its backward plus what its backward recomputes."""
    regions, t = attributor.regions, attributor.timeline
    if not regions or not t.steps:
        return []
    first = regions[0]
    if first.module is None and len(regions) > 1:
        return []  # regions without module names cannot be told apart in the compiled program

    def mine(module: str | None) -> bool:
        return first.module is None or (module is not None and (module == first.module
                                                               or module.startswith(first.module + ".")))

    forward, backward = [], []
    for step, buffer_id in enumerate(t.step_buffers):
        ins = attributor.defining(buffer_id)
        if ins is None or not mine(module_of(ins.op_name)):
            continue
        which = attributor.step_phase[step]
        if which == "forward":
            forward.append(step)
        elif which in ("backward", "recompute") and "checkpoint" in ins.op_name:
            backward.append(step)
    last_forward = max(forward, default=-1)  # none: XLA dropped a forward whose value is unused
    if not backward or last_forward >= min(backward):
        return []
    gap_live = max(t.live_bytes[max(last_forward, 0):min(backward)], default=0)
    recomputed = [o for o in t.occupancies if labels[o.buffer_id].kind == "recomputed value"
                  and mine(labels[o.buffer_id].module)]
    steps = range(min(backward), max(backward) + 1)
    restored = max((sum(o.size for o in recomputed if o.live_at(s)) for s in steps), default=0)
    peak_live = t.live_bytes[t.peak]
    if restored == 0 or gap_live + restored > peak_live:
        return []
    if first.module:
        path = tuple(int(p) if p.isdigit() else p for p in first.module.split("."))
        what, fix = first.label, (f"do not checkpoint it, e.g. remat.apply_checkpointing(model, lambda path, m: "
                                  f"<your test> and path != {path!r})")
    else:
        what = f"the checkpoint {first.label.removeprefix('region ')}"
        fix = "checkpoint the blocks inside it instead, e.g. remat.apply_checkpointing(model, Block)"
    return [f"{what} is checkpointed but that does not lower the peak: its backward pass runs right after "
            f"its forward, so it recomputes {format_bytes(restored)} at once; the step peaks at "
            f"{format_bytes(peak_live)} live with the checkpoint and would at about "
            f"{format_bytes(max(peak_live, gap_live + restored))} without; fix: {fix}"]


def _largest_residual_unchecked(buffers: list[PeakBuffer], regions: list[RegionInfo]) -> list[str]:
    """The largest residual at the peak comes from code no checkpointed region covers."""
    if not regions:
        return []
    residuals = [b for b in buffers if b.kind == "residual" and b.allocation == "temp" and b.live]
    if not residuals or residuals[0].region is not None:
        return []
    b = residuals[0]
    where = b.module or b.source or b.op
    if b.module:
        # at the depth the step's regions are checkpointed at (blocks.3, not blocks.3.mlp.fc)
        depth = min((len(r.module.split(".")) for r in regions if r.module), default=len(b.module.split(".")))
        parts = b.module.split(".")[:max(depth, 1)]
        where = ".".join(parts)
        path = tuple(int(p) if p.isdigit() else p for p in parts)
        fix = f"remat.apply_checkpointing(model, lambda path, m: path == {path!r}) checkpoints it"
    else:
        fix = f"wrap the code at {b.source or 'its source'} in remat.checkpoint"
    return [f"the largest residual at the peak, {format_bytes(b.bytes)} ({b.shape} from {b.op} at "
            f"{b.source or '?'}{f' in {b.module}' if b.module else ''}), is kept by {where}, which is not "
            f"checkpointed; fix: {fix}"]
