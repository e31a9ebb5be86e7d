"""The native whole-stack program: a model's one Python definition, recorded once into native ops.

`record_program(model)` runs `model.hidden_states` once on a two-token dummy step with the model's NativeOps
replaced by a `ProgramRecorder`: every op the layer modules call is appended to a NativeProgram
(csrc/native_program.cpp) instead of running, its tensor arguments resolved to program values (the step's ids and
positions, an earlier op's result, or a column slice of one), its weights and constants handed over once. Each step
then runs the whole stack in one native call (`NativeProgram.run`), so a batch-1 decode step pays one Python call
instead of ~10 per layer. Nothing here knows an architecture: a new one records as it is written.

What a definition may do between native ops: take column slices of op results (`split`, `narrow`, slicing the last
dimension) and pass values along; anything else (arithmetic on tensors, reshapes that copy) produces a tensor no op
made, which the recorder refuses (ProgramUnsupported) - a new computation is a new NativeOps method and program op.
tests/test_native_program.py checks per architecture that the program computes bit for bit what the Python
definition computes on the native ops.

One rewrite happens at the end: each `linear -> silu/gelu_and_mul -> linear` (a gated MLP) whose intermediates
nothing else reads becomes one `gated_mlp` op that runs in row chunks of 64-512 (as many as a 6 MiB scratch holds,
or, if more, the room in a buffer that no live value uses there), so a 512-token prefill of a 1.7B model holds at
most a [96, 2I] intermediate of its own (6 MiB; the activation is written over its gate half) instead of a [512, 2I]
one and a [512, I] one (48 MiB); where the weights take slabs (GGUF blocks below the amx level) a step too long for
one chunk runs slab by slab of I instead, in the same room (every weight panel decoded once, not once a chunk);
each row's bits are those of the three ops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from pdserve.model.attention import AttentionMetadata, ForwardContext
from pdserve.model.native_ops import KernelSelection, NativeOps, Weight


class Recordable(Protocol):
    """What the recorder needs of a model (model/causal_lm.py's CausalLM, which imports this module)."""

    @property
    def kernels(self) -> KernelSelection: ...

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      ctx: ForwardContext) -> torch.Tensor: ...


RECORD_TOKENS = 2  # rows of the dummy step: more than one, so that row strides are seen
# ops whose output buffer the executor allocates (slots)
OWNED_OPS = ("rms_norm", "attention", "silu_and_mul", "gelu_tanh_and_mul", "linear", "moe", "gated_mlp")
GATED_ACTS = {"silu_and_mul": 0, "gelu_tanh_and_mul": 1}  # the gated_mlp op's activation codes


class ProgramUnsupported(ValueError):
    """The definition does something the native program cannot express (the model runs its Python loop)."""


@dataclass
class _Instr:
    op: str
    inputs: list[int]
    out: int = -1
    width: int = 0  # of `out`, for ops in OWNED_OPS
    ints: list[int] = field(default_factory=list)
    floats: list[float] = field(default_factory=list)


@dataclass
class _Value:
    root: int  # the value whose buffer this one views (itself for a buffer)
    width: int  # columns; 0 for the 1-D step inputs
    col: int = 0  # first column within the root


class ProgramRecorder(NativeOps):
    """NativeOps that record instead of running (see the module docstring). Results are fresh empty tensors of the
    right shape, kept alive so that no address is reused while recording."""

    def __init__(self, lib: Any, ids: torch.Tensor, positions: torch.Tensor) -> None:
        super().__init__(lib)
        self.prog = lib.NativeProgram()
        self.instrs: list[_Instr] = []
        self.values: list[_Value] = []
        self._by_storage: dict[int, int] = {}  # storage address -> root value
        self._views: dict[tuple[int, int, int], int] = {}  # (root, col, cols) -> value
        self._consts: dict[int, int] = {}
        self._weights: dict[int, int] = {}
        self._alive: list[Any] = []
        self.frees: dict[int, list[int]] = {}  # instruction -> values released after it (set by finish)
        for t in (ids, positions):  # values 0 and 1
            self._by_storage[t.untyped_storage().data_ptr()] = len(self.values)
            self.values.append(_Value(len(self.values), 0))
            self._alive.append(t)

    # ---- values, constants and weights ------------------------------------------------------------------------
    def _new(self, width: int) -> tuple[torch.Tensor, int]:
        t = torch.empty(RECORD_TOKENS, width, dtype=torch.float32)
        vid = len(self.values)
        self._by_storage[t.untyped_storage().data_ptr()] = vid
        self.values.append(_Value(vid, width))
        self._alive.append(t)
        return t, vid

    def _use(self, t: torch.Tensor) -> int:
        """The value `t` is: a step input, an op result, or a column slice of one (recorded as a narrow)."""
        root = self._by_storage.get(t.untyped_storage().data_ptr())
        if root is None:
            raise ProgramUnsupported(f"a tensor {tuple(t.shape)} that no native op produced (computed in Python "
                                     "between ops?)")
        base = self.values[root]
        if base.width == 0:
            if t.dim() != 1 or t.storage_offset() != 0:
                raise ProgramUnsupported("a step input must be passed whole")
            return root
        col, cols = int(t.storage_offset()), int(t.shape[-1]) if t.dim() == 2 else -1
        if (t.dim() != 2 or t.shape[0] != RECORD_TOKENS or t.stride(0) != base.width
                or (t.stride(1) != 1 and cols > 1) or col + cols > base.width):
            raise ProgramUnsupported(f"{tuple(t.shape)} strides {t.stride()} is not a column slice of a "
                                     f"[T, {base.width}] result")
        if col == 0 and cols == base.width:
            return root
        key = (root, col, cols)
        if key not in self._views:
            self._views[key] = vid = len(self.values)
            self.values.append(_Value(root, cols, col))
            self.instrs.append(_Instr("narrow", [root], vid, ints=[col, cols]))
        return self._views[key]

    def _const(self, t: torch.Tensor) -> int:
        if id(t) not in self._consts:
            if t.dtype != torch.float32 or t.device.type != "cpu":
                raise ProgramUnsupported(f"constant of dtype {t.dtype} on {t.device}: the program runs float32 on "
                                         "the CPU")
            c = t.detach().contiguous()
            self._alive.append(t)
            self._consts[id(t)] = self.prog.add_const(c)
        return self._consts[id(t)]

    def _weight(self, w: Weight) -> int:
        if id(w) not in self._weights:
            self._alive.append(w)
            self._weights[id(w)] = self._add_weight(w)
        return self._weights[id(w)]

    def _add_weight(self, w: Weight) -> int:
        if isinstance(w, self.lib.PackedWeight):
            return int(self.prog.add_packed(w))
        raise ProgramUnsupported(f"a weight of type {type(w).__name__} has no native program form (the native path "
                                 "packs every matrix at load: model/packed_weights.py)")

    def _emit(self, op: str, inputs: list[torch.Tensor], width: int = 0, ints: list[int] | None = None,
              floats: list[float] | None = None) -> torch.Tensor | None:
        """Append `op`; a result of `width` columns is a new value (returned as its recording tensor)."""
        ins = [self._use(t) for t in inputs]
        result, out = None, -1
        if width:
            result, out = self._new(width)
        self.instrs.append(_Instr(op, ins, out, width, ints or [], floats or []))
        return result

    @contextlib.contextmanager
    def step(self, meta: AttentionMetadata) -> Iterator[None]:
        """Nothing to learn while recording: the program computes the row kinds of each run itself."""
        yield

    # ---- the ops (NativeOps' signatures) ----------------------------------------------------------------------
    def embedding(self, ids: torch.Tensor, weight: Weight) -> torch.Tensor:
        return self._result("embedding", [ids], weight.shape[1], [self._weight(weight)])

    def linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None) -> torch.Tensor:
        ints = [self._weight(weight), -1 if bias is None else self._const(bias)]
        return self._result("linear", [x], weight.shape[0], ints)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._result("rms_norm", [x], x.shape[1], [self._const(weight)], [eps])

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        self._emit("add_rms_norm", [x, residual], ints=[self._const(weight)], floats=[eps])

    def head_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        self._emit("head_rms_norm", [x], ints=[self._const(weight)], floats=[eps])

    def rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, head_dim: int) -> None:
        self._emit("rotary", [positions, q, k], ints=[self._const(cos), self._const(sin), head_dim])

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._result("silu_and_mul", [x], x.shape[1] // 2)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._result("gelu_tanh_and_mul", [x], x.shape[1] // 2)

    def scale(self, x: torch.Tensor, factor: float) -> None:
        self._emit("scale", [x], floats=[factor])

    def moe(self, x: torch.Tensor, logits: torch.Tensor, experts: Any) -> torch.Tensor:
        if id(experts) not in self._weights:
            self._alive.append(experts)
            self._weights[id(experts)] = int(self.prog.add_moe(experts))
        return self._result("moe", [x, logits], x.shape[1], [self._weights[id(experts)]])

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext, layer: int,
                  num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                  sliding_window: int = 0, softcap: float = 0.0, group: int = 0) -> torch.Tensor:
        return self._result("attention", [q, k, v], num_heads * head_dim,
                            [layer, num_heads, num_kv_heads, head_dim, sliding_window, group], [scale, softcap])

    def _result(self, op: str, inputs: list[torch.Tensor], width: int, ints: list[int] | None = None,
                floats: list[float] | None = None) -> torch.Tensor:
        out = self._emit(op, inputs, width, ints, floats)
        assert out is not None
        return out

    # ---- the program ------------------------------------------------------------------------------------------
    def finish(self, output: torch.Tensor) -> Any:
        """Hand the recorded instructions to the NativeProgram, with buffer slots and release points."""
        out = self._fuse_gated_mlps(self._use(output))
        last = self._last_uses(out)
        slot_of, spare_slot = self._assign_slots(last)
        scratch: dict[int, int] = {}  # width -> slot of the gated MLPs' [rows, 2I] scratch (shared, used within the op)
        for i, ins in enumerate(self.instrs):
            if ins.op == "gated_mlp":
                if ins.ints[5] not in scratch:
                    scratch[ins.ints[5]] = int(self.prog.add_slot(ins.ints[5]))
                ins.ints[5] = scratch[ins.ints[5]]
                ins.ints.append(spare_slot.get(i, -1))
        for vid, i in last.items():
            if i < len(self.instrs):
                self.frees.setdefault(i, []).append(vid)
        for i, ins in enumerate(self.instrs):
            self.prog.append(ins.op, ins.inputs, ins.out, slot_of.get(i, -1), ins.ints, ins.floats,
                             sorted(self.frees.get(i, [])), ins.width if i in slot_of else -1)
        self.prog.set_output(out)
        return self.prog

    def _fuse_gated_mlps(self, output: int) -> int:
        """Replace each `linear -> silu/gelu_and_mul -> linear` whose intermediates nothing else reads by one
        `gated_mlp` op, which runs in row chunks (no [T, 2I] buffer for a long prefill); then number the values
        again in instruction order, as the program requires. Returns the output's new number."""
        readers: dict[int, int] = {}  # value (or the root of a view) -> instructions reading it
        for ins in self.instrs:
            for v in ins.inputs:
                for r in {v, self.values[v].root}:
                    readers[r] = readers.get(r, 0) + 1
        fused: list[_Instr] = []
        i = 0
        while i < len(self.instrs):
            a, b, c = (self.instrs[i:i + 3] + [None, None])[:3]
            if (a and b and c and a.op == "linear" and b.op in GATED_ACTS and c.op == "linear"
                    and b.inputs == [a.out] and c.inputs == [b.out] and readers.get(a.out) == 1
                    and readers.get(b.out) == 1 and output not in (a.out, b.out)):
                fused.append(_Instr("gated_mlp", a.inputs, c.out, c.width,
                                    [a.ints[0], a.ints[1], c.ints[0], c.ints[1], GATED_ACTS[b.op],
                                     a.width]))  # the scratch width becomes a slot in finish()
                i += 3
            else:
                fused.append(self.instrs[i])
                i += 1
        if len(fused) == len(self.instrs):
            return output
        renumber = {0: 0, 1: 1}
        values = self.values[:2]
        for ins in fused:
            if ins.out >= 0:
                renumber[ins.out] = len(values)
                values.append(self.values[ins.out])
        for val in values[2:]:
            val.root = renumber[val.root]
        for ins in fused:
            ins.inputs = [renumber[v] for v in ins.inputs]
            ins.out = renumber.get(ins.out, -1)
        self.instrs, self.values = fused, values
        return renumber[output]

    def _last_uses(self, output: int) -> dict[int, int]:
        """Per value (step inputs aside), the last instruction reading it or a view of it (len(instrs): never)."""
        last: dict[int, int] = {}
        for i, ins in enumerate(self.instrs):
            if ins.out >= 0:
                last.setdefault(ins.out, i)
            for v in ins.inputs:
                last[v] = i
                last[self.values[v].root] = max(last.get(self.values[v].root, i), i)
        for v in (output, self.values[output].root):
            last[v] = len(self.instrs)
        for v in (0, 1):
            last.pop(v, None)
        return last

    def _assign_slots(self, last: dict[int, int]) -> tuple[dict[int, int], dict[int, int]]:
        """Instruction index -> slot of its executor-allocated output: a slot is reused by a later output no wider
        than the slot once the value holding it is dead (its last use before that instruction), the narrowest such
        slot first (e.g. a layer's o projection output in the buffer its qkv output no longer needs). Also, per
        gated MLP, the slot with the most room no live value uses there (columns per row): another slot whose value
        is dead, or the slot of the op's input when that input is the slot's value and narrower than the slot (the
        room past it: a 1.7B model's MLP input sits in its qkv output's buffer); that room may serve as scratch."""
        holder: list[int] = []  # slot -> value holding it
        widths: list[int] = []  # slot -> its width
        slot_of: dict[int, int] = {}
        spare_slot: dict[int, int] = {}
        for i, ins in enumerate(self.instrs):
            if ins.op not in OWNED_OPS:
                continue
            dead = [s for s, v in enumerate(holder) if last[v] < i]
            free = [s for s in dead if widths[s] >= ins.width]
            if free:
                slot = min(free, key=lambda s: (widths[s], s))
            else:
                slot = int(self.prog.add_slot(ins.width))
                holder.append(-1)
                widths.append(ins.width)
            if ins.op == "gated_mlp":
                room = {s: widths[s] for s in dead if s != slot}
                x = ins.inputs[0]
                for s, v in enumerate(holder):
                    if v == x and self.values[x].root == x and s != slot:
                        room[s] = widths[s] - self.values[x].width
                best = max(room, key=lambda s: (room[s], -s), default=-1)
                if best >= 0 and room[best] > 0:
                    spare_slot[i] = best
            holder[slot] = ins.out
            slot_of[i] = slot
        return slot_of, spare_slot


def record(model: Recordable) -> ProgramRecorder:
    """Record `model.hidden_states`; the recorder's `prog` is then the finished NativeProgram."""
    ops = model.kernels.ops
    ids = torch.zeros(RECORD_TOKENS, dtype=torch.long)
    positions = torch.arange(RECORD_TOKENS, dtype=torch.long)
    recorder = ProgramRecorder(ops.lib, ids, positions)
    empty = torch.empty(0, dtype=torch.long)
    ctx = ForwardContext(torch.empty(0), AttentionMetadata(empty, 0, None, None, []))  # never read while recording
    with model.kernels.recording(recorder), torch.inference_mode():
        hidden = model.hidden_states(ids, positions, ctx)
    recorder.finish(hidden)
    return recorder


def record_program(model: Recordable) -> Any:
    """The NativeProgram of `model.hidden_states` (see the module docstring)."""
    return record(model).prog
