"""Each byte of a compiled step's peak, attributed: kind, module, source line, region and rule.

The inputs are one compiled program read with its buffer assignment
(:class:`~remat.explainer._hlo_proto.HloProgram`), its temp buffer over time
(:class:`~remat.explainer.timeline.HeapTimeline`) and the checkpointed regions of its
jaxpr (:mod:`remat.explainer._region_residuals`). Buffers are read through the metadata XLA keeps
on the instruction that defines them: the op name (JAX's name stack, with the module
paths :mod:`remat.explainer._module_names` put there) and the Python stack.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

from remat.explainer._hlo_proto import HloProgram, Instruction
from remat.explainer._module_names import module_of
from remat.explainer._region_residuals import RegionInfo, kept_index
from remat.explainer._sources import format_source, user_frame
from remat.explainer.timeline import Gap, HeapTimeline, split_forward_backward

KINDS = ("parameter", "optimizer state", "input", "residual", "recomputed value", "gradient", "other temporary")
_OPTIMIZER_WORDS = re.compile(r"opt|(?<![a-z])(mu|nu|count)(?![a-z])", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class PeakBuffer:
    """One buffer live at the peak of a compiled step (or a packing gap charged to its holder).

    Attributes:
      bytes: its size.
      kind: one of :data:`KINDS`.
      source: ``"file.py:LINE"`` of the user's code that produced it, or None.
      module: the module path that produced it (``"blocks.3.mlp"``), or None.
      region: for a residual, recomputed value or gradient of a checkpointed region: the
        region (its module path, or ``"region at file.py:LINE"``); else None.
      rule: why it is there: the policy rule that kept a residual, "not checkpointed", a
        packing gap, ...; or None.
      shape: XLA's shape, e.g. ``"f32[8,128,512]"``.
      op: the operation that produced it (the last part of JAX's op name).
      allocation: ``"temp"`` (counted in ``temp_bytes``), ``"argument"`` or ``"output"``.
      live: False for a gap in XLA's packing: bytes of the temp buffer free at the peak,
        charged to the value XLA placed there nearest in time.
    """

    bytes: int
    kind: str
    source: str | None
    module: str | None
    region: str | None
    rule: str | None
    shape: str = ""
    op: str = ""
    allocation: str = "temp"
    live: bool = True

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def phase(instruction: Instruction | None) -> str | None:
    """``"recompute"``, ``"backward"``, ``"forward"`` or None (no JAX op name)."""
    if instruction is None or not instruction.op_name:
        return None
    name = instruction.op_name.split(";")[0]
    if "rematted_computation" in name:
        return "recompute"
    if "transpose(" in name:
        return "backward"
    return "forward" if "/" in name or "(" in name else None


def _op(instruction: Instruction) -> str:
    return instruction.op_name.split(";")[0].rsplit("/", 1)[-1] or instruction.opcode


def _source(instruction: Instruction) -> str | None:
    return format_source(user_frame((f.file, f.line, f.function) for f in instruction.frames))


def _argument_module(path: str) -> str | None:
    """``params['blocks'][0]['mlp']['fc']['kernel'].value`` -> ``blocks.0.mlp.fc``."""
    parts = re.findall(r"\[['\"]?([^\]'\"]+)['\"]?\]|\.(\w+)", path)
    keys = [a or b for a, b in parts]
    while keys and keys[-1] in ("value", "raw_value"):
        keys.pop()
    return ".".join(keys[:-1]) or None


def argument_kind(path: str, first_argument: str | None) -> str:
    """``parameter``, ``optimizer state`` or ``input``, from an argument's path in the step's signature."""
    if _OPTIMIZER_WORDS.search(path):
        return "optimizer state"
    top = re.match(r"[A-Za-z_]\w*(\[\d+\])?", path)
    name = top.group(0) if top else path
    if name in (first_argument, "args[0]", "arg0") or (first_argument is None and name.endswith("[0]")):
        return "parameter"
    return "input"


class Attributor:
    """Attributes one compiled step's buffers; see :func:`peak_buffers`."""

    def __init__(self, program: HloProgram, timeline: HeapTimeline, regions: list[RegionInfo],
                 first_argument: str | None, output_paths: list[str] | None = None):
        self.program = program
        self.timeline = timeline
        self.regions = regions
        self.first_argument = first_argument
        self.output_paths = output_paths or []
        self.index = kept_index(regions)
        self._users: dict[int, list[int]] | None = None
        self.step_phase = [phase(self.defining(b)) for b in timeline.step_buffers]
        self.backward_step = split_forward_backward(
            lambda i: None if self.step_phase[i] is None else self.step_phase[i] != "forward", timeline.steps)

    def defining(self, buffer_id: int) -> Instruction | None:
        """The instruction that defines a buffer; for one XLA made without metadata (a constant
        broadcast, a copy), the nearest user or operand that has JAX's metadata."""
        buffer = self.program.buffers.get(buffer_id)
        ins = self.program.instructions.get(buffer.instruction_id) if buffer else None
        if ins is None or ins.op_name:
            return ins
        return self._with_metadata(ins) or ins

    def _with_metadata(self, ins: Instruction) -> Instruction | None:
        if self._users is None:
            self._users = {}
            for other in self.program.instructions.values():
                for operand in other.operand_ids:
                    self._users.setdefault(operand, []).append(other.id)
        seen, frontier = {ins.id}, [ins.id]
        for _ in range(4):  # a few hops through metadata-less copies and bitcasts
            nxt = []
            for i in frontier:
                for j in (*self._users.get(i, ()), *self.program.instructions[i].operand_ids):
                    if j in seen or j not in self.program.instructions:
                        continue
                    seen.add(j)
                    other = self.program.instructions[j]
                    if other.op_name and other.opcode not in ("parameter", "tuple", "get-tuple-element"):
                        return dataclasses.replace(ins, op_name=other.op_name, frames=other.frames)
                    nxt.append(j)
            frontier = nxt
        return None

    def region_of_module(self, module: str | None) -> RegionInfo | None:
        """The checkpointed region whose module contains ``module`` (the innermost)."""
        if module is None:
            return self.regions[0] if len(self.regions) == 1 and self.regions[0].module is None else None
        best = None
        for r in self.regions:
            if r.module and (module == r.module or module.startswith(r.module + ".")):
                if best is None or len(r.module) > len(best.module or ""):
                    best = r
        return best

    def temp_buffer(self, buffer_id: int, start: int, end: int, size: int) -> PeakBuffer:
        """A value of the temp buffer, live during steps ``[start, end)``."""
        ins = self.defining(buffer_id)
        if ins is None:
            return PeakBuffer(size, "other temporary", None, None, None, None)
        module, source, kind = module_of(ins.op_name), _source(ins), "other temporary"
        region = rule = None
        which = phase(ins)
        if which == "recompute":
            kind, owner = "recomputed value", self.region_of_module(module)
            region = owner.label if owner else None
            rule = f"recomputed in the backward pass{f' of {region} (policy {owner.policy})' if owner else ''}"
        elif which == "backward":
            kind = "gradient"
            owner = self.region_of_module(module) if "checkpoint" in ins.op_name else None
            region = owner.label if owner else None
        elif which == "forward" and self.backward_step is not None and end > self.backward_step:
            # made by the forward pass and still alive when the backward pass begins
            kind = "residual"
            nbytes = self.program.buffers[buffer_id].size
            found = self.index.get((module, source, nbytes)) or self.index.get((None, source, nbytes))
            looped = [r.label for r in self.regions if r.in_loop]
            if ins.opcode == "while":  # a loop's stacked outputs: what every iteration keeps
                region = " or ".join(dict.fromkeys(looped)) or None
                rule = ("stacked by a loop over layers: what each iteration's checkpointed region keeps"
                        if looped else "stacked by a loop: what each iteration keeps for the backward pass")
            elif found:
                regions = list(dict.fromkeys(r.label for r, _ in found))
                region = regions[0] if len(regions) == 1 else " or ".join(regions)
                rule = found[0][1].rule
            else:
                rule = "kept for the backward pass by code outside any checkpointed region"
        shape = ins.shape_at(self.program.buffers[buffer_id].shape_index)
        return PeakBuffer(size, kind, source, module, region, rule, shape, _op(ins))

    def peak_buffers(self, entries_for: tuple[str, ...] = ("temp", "argument", "output")) -> list[PeakBuffer]:
        """Every buffer live at the peak, and the packing gaps there, largest first."""
        out: list[PeakBuffer] = []
        t = self.timeline
        if "temp" in entries_for:
            for occ in t.live_at(t.peak):
                out.append(self.temp_buffer(occ.buffer_id, occ.start, occ.end, occ.size))
            for gap in t.gaps_at(t.peak):
                out.append(self._gap(gap))
        if "argument" in entries_for or "output" in entries_for:
            out.extend(self._parameters_and_outputs())
        return sorted(out, key=lambda b: (-b.bytes, b.allocation, b.kind, b.source or ""))

    def _gap(self, gap: Gap) -> PeakBuffer:
        if gap.holder is None and gap.placed is not None:
            placed = self.temp_buffer(gap.placed.buffer_id, 0, 0, gap.size)
            what = f"this {placed.op or 'value'} ({placed.kind})"
            rule = (f"padding: alignment of XLA's packing, the end of the slot of {what} placed right below"
                    if gap.padding else f"placed outside the schedule XLA's heap trace shows: bytes of {what}, "
                    "a value of a computation the step calls (a conditional's branch, say)")
            return dataclasses.replace(placed, kind="other temporary", region=None, rule=rule, live=False)
        if gap.holder is None:
            return PeakBuffer(gap.size, "other temporary", None, None, None,
                              "padding: never used (alignment of XLA's packing)", live=False)
        holder = self.temp_buffer(gap.holder.buffer_id, gap.holder.start, gap.holder.end, gap.size)
        steps = gap.holder.start - self.timeline.peak if gap.holder.start > self.timeline.peak \
            else self.timeline.peak - gap.holder.end + 1
        when = "after" if gap.holder.start > self.timeline.peak else "before"
        rule = (f"packing gap: free at the peak; XLA's heap packing keeps these bytes for this "
                f"{holder.op or 'value'} ({holder.kind}), live {steps} step{'s' * (steps != 1)} {when} the peak")
        return dataclasses.replace(holder, kind="other temporary", region=None, rule=rule, live=False)

    def _parameter(self, allocation: Any) -> Instruction | None:
        """The entry computation's parameter instruction an argument allocation holds."""
        for b, _, _ in allocation.assigned:
            buffer = self.program.buffers.get(b)
            ins = self.program.instructions.get(buffer.instruction_id) if buffer else None
            if ins is not None and ins.opcode == "parameter":
                return ins
        return None

    def _parameters_and_outputs(self) -> list[PeakBuffer]:
        out = []
        order = {i: n for seq in self.program.schedule.values() for n, i in enumerate(seq)}
        outputs = {i: p for i, p in zip(self.program.entry_outputs(), self.output_paths)}
        parameter_paths = set()
        for a in self.program.allocations:
            if a.is_entry_parameter:
                ins = self._parameter(a)
                if ins is not None and argument_kind(ins.op_name, self.first_argument) == "parameter":
                    parameter_paths.add(re.sub(r"^[A-Za-z_]\w*(\[\d+\])?", "", ins.op_name))
        for a in self.program.allocations:
            if a.is_entry_parameter:
                ins = self._parameter(a)
                path = ins.op_name if ins is not None else f"argument {a.parameter_number}"
                kind = argument_kind(path, self.first_argument)
                out.append(PeakBuffer(a.size, kind, None, _argument_module(path) if kind == "parameter" else None,
                                      None, f"argument {path}", ins.shape if ins else "", "parameter",
                                      "argument"))
            elif a.maybe_live_out and not a.is_tuple:
                written = [(self.defining(b), self.program.buffers[b]) for b, _, _ in a.assigned
                           if b in self.program.buffers]
                written = [(i, b) for i, b in written if i is not None]
                if not written:
                    continue
                last, buffer = max(written, key=lambda w: order.get(w[0].id, -1))
                path = next((outputs[i.id] for i, _ in written if i.id in outputs), "")
                out.append(PeakBuffer(a.size, self._output_kind(last, path, parameter_paths), _source(last),
                                      module_of(last.op_name), None, f"output {path}".rstrip(),
                                      last.shape_at(buffer.shape_index), _op(last), "output"))
        return out

    def _output_kind(self, last: Instruction, path: str, parameter_paths: set[str]) -> str:
        """A gradient (computed by the backward pass), the step's new parameters or optimizer state, or other."""
        if phase(last) in ("backward", "recompute"):
            return "gradient"
        if path and _OPTIMIZER_WORDS.search(path):
            return "optimizer state"
        if path and re.sub(r"^\[\d+\]", "", path) in parameter_paths:
            return "parameter"
        return "other temporary"
