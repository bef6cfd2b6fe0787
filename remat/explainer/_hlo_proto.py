"""XLA's ``HloProto`` (an optimized module and its buffer assignment) read from its wire format.

XLA's protobuf classes do not ship with jaxlib, so the few messages :func:`remat.explain`
needs are decoded here by field number (``xla/service/hlo.proto``, ``xla/xla_data.proto``):
instructions with their op metadata and stack frames, the schedule, logical buffers,
allocations and the heap simulator's trace. Unknown fields are skipped, so newer XLA
versions that add fields still read.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator

# xla_data.proto's PrimitiveType, for shape strings
_ELEMENT_TYPES = {1: "pred", 2: "s8", 3: "s16", 4: "s32", 5: "s64", 6: "u8", 7: "u16", 8: "u32", 9: "u64",
                  10: "f16", 11: "f32", 12: "f64", 13: "tuple", 14: "opaque", 15: "c64", 16: "bf16", 17: "token",
                  18: "c128", 19: "f8e5m2", 20: "f8e4m3fn", 21: "s4", 22: "u4"}
_EVENT_KINDS = {0: "alloc", 1: "free", 2: "share"}


def _varint(data: bytes, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[i]
        i += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return result, i


def _fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """``(field number, value)`` pairs: ints for varints, bytes for length-delimited fields."""
    i, n = 0, len(data)
    while i < n:
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
            yield number, value
        elif wire == 2:
            size, i = _varint(data, i)
            yield number, data[i:i + size]
            i += size
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")


def _message(data: bytes) -> dict[int, list]:
    fields: dict[int, list] = {}
    for number, value in _fields(data):
        fields.setdefault(number, []).append(value)
    return fields


def _int(fields: dict[int, list], number: int, default: int = 0) -> int:
    values = fields.get(number)
    if not values:
        return default
    value = values[-1]
    return value - (1 << 64) if value >= 1 << 63 else value  # int64 two's complement


def _ints(fields: dict[int, list], number: int) -> tuple[int, ...]:
    """A repeated integer field, packed or not."""
    out: list[int] = []
    for value in fields.get(number, ()):
        if isinstance(value, int):
            out.append(value)
            continue
        i = 0
        while i < len(value):
            x, i = _varint(value, i)
            out.append(x)
    return tuple(out)


def _str(fields: dict[int, list], number: int) -> str:
    values = fields.get(number)
    return values[-1].decode("utf-8", "replace") if values else ""


@dataclasses.dataclass(frozen=True)
class Frame:
    """One source frame of an operation: ``file:line`` in ``function``."""

    file: str
    line: int
    function: str


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction of the optimized module.

    Attributes:
      frames: the Python stack that traced it, innermost frame first.
      shape: e.g. ``"f32[8,64]"`` (tuples as ``"(f32[2], s32[])"``).
    """

    id: int
    name: str
    opcode: str
    computation: str
    op_name: str
    frames: tuple[Frame, ...]
    shape: str
    operand_ids: tuple[int, ...]
    called_computation_ids: tuple[int, ...]
    parameter_number: int
    element_shapes: tuple[str, ...] = ()  # a tuple's elements

    def shape_at(self, index: tuple[int, ...]) -> str:
        """The shape of the value at ``index`` of the instruction's output (a tuple element)."""
        if index and self.element_shapes and 0 <= index[0] < len(self.element_shapes):
            return self.element_shapes[index[0]]
        return self.shape


@dataclasses.dataclass(frozen=True)
class LogicalBuffer:
    """A value XLA assigns memory to: defined by an instruction at a shape index."""

    id: int
    size: int
    instruction_id: int
    shape_index: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Allocation:
    """A block of memory: an entry parameter, an output, the temp buffer, a constant, ...

    Attributes:
      assigned: ``(logical buffer id, offset, size)`` for every value placed in it.
    """

    index: int
    size: int
    is_entry_parameter: bool
    parameter_number: int
    maybe_live_out: bool
    is_thread_local: bool
    is_constant: bool
    is_tuple: bool
    color: int
    assigned: tuple[tuple[int, int, int], ...]

    @property
    def is_temp(self) -> bool:
        """The preallocated temp buffer (``temp_size_in_bytes``)."""
        return not (self.is_entry_parameter or self.maybe_live_out or self.is_thread_local or self.is_constant)


@dataclasses.dataclass(frozen=True)
class HeapEvent:
    """One step of XLA's heap simulation: ``alloc``, ``free`` or ``share`` (reuse another's memory)."""

    kind: str
    buffer_id: int
    computation: str
    instruction: str
    share_with: int


@dataclasses.dataclass(frozen=True)
class HeapTrace:
    allocation_index: int
    whole_module: bool
    events: tuple[HeapEvent, ...]


@dataclasses.dataclass(frozen=True)
class HloProgram:
    """An optimized HLO module and XLA's buffer assignment for it.

    Attributes:
      instructions: by id (ids are unique across the module's computations).
      computations: computation id -> name.
      schedule: computation id -> its instruction ids in execution order.
      roots: computation name -> the id of its root instruction.
    """

    name: str
    entry: str
    instructions: dict[int, Instruction]
    computations: dict[int, str]
    schedule: dict[int, tuple[int, ...]]
    buffers: dict[int, LogicalBuffer]
    allocations: tuple[Allocation, ...]
    traces: tuple[HeapTrace, ...]
    roots: dict[str, int] = dataclasses.field(default_factory=dict)

    def entry_outputs(self) -> tuple[int, ...]:
        """The instructions whose values the entry computation returns, in output order."""
        root = self.instructions.get(self.roots.get(self.entry, -1))
        if root is None:
            return ()
        return root.operand_ids if root.opcode == "tuple" else (root.id,)

    def instruction_named(self) -> dict[tuple[str, str], Instruction]:
        """``(computation name, instruction name) -> instruction``."""
        return {(i.computation, i.name): i for i in self.instructions.values()}


def _shape(data: bytes) -> str:
    fields = _message(data)
    element = _int(fields, 2)
    if element == 13:
        return "(" + ", ".join(_shape(s) for s in fields.get(4, ())) + ")"
    dims = ",".join(str(d) for d in _ints(fields, 3))
    return f"{_ELEMENT_TYPES.get(element, f'type{element}')}[{dims}]"


def _frames(index: dict[int, list]) -> dict[int, tuple[Frame, ...]]:
    """Stack frame id -> frames, innermost first (ids are 1-based, 0 means none)."""
    files = [b.decode("utf-8", "replace") for b in index.get(1, ())]
    functions = [b.decode("utf-8", "replace") for b in index.get(2, ())]
    locations = [_message(b) for b in index.get(3, ())]
    stack = [_message(b) for b in index.get(4, ())]
    memo: dict[int, tuple[Frame, ...]] = {0: ()}

    def frames(frame_id: int) -> tuple[Frame, ...]:
        chain: list[int] = []
        while frame_id not in memo and 0 < frame_id <= len(stack) and len(chain) < 10_000:
            chain.append(frame_id)
            frame_id = _int(stack[frame_id - 1], 2)
        tail = memo.get(frame_id, ())
        for fid in reversed(chain):
            loc = locations[_int(stack[fid - 1], 1) - 1] if 0 < _int(stack[fid - 1], 1) <= len(locations) else {}
            file_id, fn_id = _int(loc, 1), _int(loc, 2)
            frame = Frame(files[file_id - 1] if 0 < file_id <= len(files) else "",
                          _int(loc, 3), functions[fn_id - 1] if 0 < fn_id <= len(functions) else "")
            tail = memo[fid] = (frame, *tail)
        return tail

    return {i: frames(i) for i in range(1, len(stack) + 1)}


def parse_hlo_proto(data: bytes) -> HloProgram:
    """Reads a serialized ``xla.HloProto`` (module and buffer assignment).

    Args:
      data: the bytes XLA dumps as ``*after_optimizations.hlo.pb``.

    Returns:
      An :class:`HloProgram`.
    """
    proto = _message(data)
    module = _message(proto[1][0]) if 1 in proto else {}
    frames = _frames(_message(module[17][0])) if 17 in module else {0: ()}
    instructions: dict[int, Instruction] = {}
    computations: dict[int, str] = {}
    roots: dict[str, int] = {}
    for comp_bytes in module.get(3, ()):
        comp = _message(comp_bytes)
        comp_name = _str(comp, 1)
        computations[_int(comp, 5)] = comp_name
        roots[comp_name] = _int(comp, 6)
        for ins_bytes in comp.get(2, ()):
            ins = _message(ins_bytes)
            meta = _message(ins[7][0]) if 7 in ins else {}
            stack = frames.get(_int(meta, 15), ())
            if not stack and _str(meta, 3):  # older XLA: one source location in the metadata
                stack = (Frame(_str(meta, 3), _int(meta, 4), ""),)
            shape = _message(ins[3][0]) if 3 in ins else {}
            instructions[_int(ins, 35)] = Instruction(
                _int(ins, 35), _str(ins, 1), _str(ins, 2), comp_name, _str(meta, 2), stack,
                _shape(ins[3][0]) if 3 in ins else "", _ints(ins, 36), _ints(ins, 38), _int(ins, 9),
                tuple(_shape(e) for e in shape.get(4, ())))
    schedule: dict[int, tuple[int, ...]] = {}
    if 7 in module:
        for entry in _message(module[7][0]).get(1, ()):
            kv = _message(entry)
            schedule[_int(kv, 1)] = _ints(_message(kv[2][0]), 1) if 2 in kv else ()
    assignment = _message(proto[3][0]) if 3 in proto else {}
    buffers = {}
    for b in assignment.get(1, ()):
        fields = _message(b)
        where = _message(fields[3][0]) if 3 in fields else {}
        buffers[_int(fields, 1)] = LogicalBuffer(_int(fields, 1), _int(fields, 2), _int(where, 4), _ints(where, 3))
    allocations = []
    for a in assignment.get(3, ()):
        f = _message(a)
        assigned = tuple((_int(x, 1), _int(x, 2), _int(x, 3)) for x in map(_message, f.get(9, ())))
        allocations.append(Allocation(_int(f, 1), _int(f, 2), bool(_int(f, 5)), _int(f, 6), bool(_int(f, 7)),
                                      bool(_int(f, 3)), bool(_int(f, 12)), bool(_int(f, 11)), _int(f, 8), assigned))
    traces = []
    for t in assignment.get(4, ()):
        f = _message(t)
        events = tuple(HeapEvent(_EVENT_KINDS.get(_int(e, 1), "alloc"), _int(e, 2), _str(e, 3), _str(e, 4),
                                 _int(e, 5)) for e in map(_message, f.get(1, ())))
        traces.append(HeapTrace(_int(f, 3), bool(_int(f, 2)), events))
    return HloProgram(_str(module, 1), _str(module, 2), instructions, computations, schedule, buffers,
                      tuple(allocations), tuple(traces), roots)
