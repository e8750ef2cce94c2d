"""A session runs the methods of one program on one backend, with its own state buffers.

It builds a plan once per method and input-shape signature: for each node the kernel, its input and output slots,
its attributes with symbols resolved, and the values to drop after it (the exporter's memory plan). `run` is then
a tight loop over that plan.

On a backend that captures graphs (cuda), a plan that has run once is captured on its next run and then replayed
as one graph (kiln.runtime.graphs): the Python loop, and every kernel launch it makes, collapse into one launch.
State buffers then keep their identity for the session's life (updates and resets are written into them), since a
graph reads and writes fixed addresses. On a backend that compiles (mlx), the plan becomes one compiled function
of the inputs and the state buffers that returns the outputs and the new state: the Python loop runs once, when it
is traced, and the backend fuses what it can.

A session runs one method at a time: `run` holds the session's lock, so threads that share a session take turns
(see Session).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.errors import InputError, KernelError, KilnError
from kiln.ir import ops
from kiln.ir.graph import NO_VALUE, Method, Node, ValueKind
from kiln.ir.ops import REQUIRED, AttrType
from kiln.ir.symbolic import UNBOUNDED, ExprError, format_shape, parse, resolve, resolve_shape
from kiln.runtime import backends
from kiln.runtime.graphs import MAX_GRAPHS_PER_METHOD, WARMUP_RUNS, CaptureError, Compiled, Replay
from kiln.runtime.program import Program

log = logging.getLogger("kiln.runtime")

MAX_PLANS_PER_METHOD = 64


@dataclass
class _Step:
    kernel: Any
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    attrs: dict[str, Any]
    free: tuple[int, ...]
    node: Node
    steps: list[_Step] | None = None
    """A lowered run (Backend.lower_runs): the steps it replaces, run one by one where its kernel returns None."""


@dataclass
class _Plan:
    steps: list[_Step]
    env: dict[str, int]
    runs: int = 0
    replay: Replay | Compiled | bool | None = None  # None: not captured yet; False: op by op (capture failed or off)
    lowered: Any = None
    """The whole method as one backend function (Backend.lower), or None: step by step."""


class Session:
    """Independent execution context: several threads may each run their own session of one program, in parallel.

    Threads that share one session take turns: `run` (and `reset_state`) hold the session's lock, so a second
    thread's call waits until the first one's returns, and each run sees the state the previous one left. Runs that
    interleave corrupt each other: the CPU's native plans bind arrays into one table and temporaries into one arena
    per plan, a captured graph uses fixed buffers, and two runs that both read a state buffer (a KV cache) before
    either writes it back lose an update. (Before this lock, four threads sharing a CPU session lost most of the
    state updates, got wrong outputs, and at times crashed the process; MLX crashed too.) A turn is one `run`, not
    a sequence of them: a conversation that spans several runs (prefill, then decode steps) needs a session of its
    own, or its caller's lock around the whole sequence. A run that calls back into its own session from the same
    thread (a kernel that runs the session) raises KilnError instead of waiting forever on itself.
    """

    def __init__(self, program: Program, backend: str = "cpu", validate: bool = False, graphs: bool | None = None,
                 threads: int | None = None):
        """threads: CPU threads this session's kernels may split their work over (default: KILN_THREADS, else
        every core the process may run on); results do not depend on it.
        validate: check every kernel's output dtype and shape against the program (slow; for debugging).
        graphs: capture and replay each method as a graph where the backend can (cuda: on unless
        KILN_CUDA_GRAPHS=0), or compile it (mlx: on unless KILN_MLX_COMPILE=0); False runs every kernel from
        Python, for debugging and per-op profiling."""
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise InputError(f"threads must be a positive integer, got {threads!r}")
        self.program = program
        self.backend = backends.create(backend, program)
        self.backend.threads = threads
        self.validate = validate
        self.graphs = self.backend.graphs_by_default if graphs is None else graphs
        if self.graphs and not (self.backend.can_capture or self.backend.can_compile):
            raise KilnError(f"the {self.backend.name} backend cannot capture or compile graphs; use graphs=False")
        self.graphs = self.graphs and not validate
        self._fixed_state = self.graphs and self.backend.can_capture
        """Whether state buffers keep their identity (captured graphs address them), updates written into them."""
        self.state = [self.backend.initial_state(i, s) for i, s in enumerate(program.ir.states)]
        self._plans: dict[str, dict[tuple, _Plan]] = {}
        self._graphed: dict[str, OrderedDict[tuple, _Plan]] = {}
        self._lock = threading.Lock()
        """Held by the one run (or reset) in progress: plans, their arenas and graphs, and the state are its alone."""
        self._owner: int | None = None
        """The thread that holds _lock, so a run re-entered from that thread fails rather than waits on itself."""

    def reset_state(self) -> None:
        """Put every state buffer (e.g. a KV cache) back to its initial contents (after a run in progress on another
        thread returns)."""
        with self._turn():
            initial = [self.backend.initial_state(i, s) for i, s in enumerate(self.program.ir.states)]
            if self._fixed_state:  # captured graphs hold the buffers' addresses
                for target, value in zip(self.state, initial, strict=True):
                    self.backend.copy_into(target, value)
            else:
                self.state = initial

    @property
    def captured_graphs(self) -> dict[str, int]:
        """Graphs (captured or compiled) this session holds, per method (one per input-shape signature, at most
        MAX_GRAPHS_PER_METHOD): what a benchmark reports to show its runs replayed rather than went op by op."""
        with self._turn():
            return {method: len(graphed) for method, graphed in self._graphed.items()}

    def _acquire(self) -> None:
        """This thread's turn at the session (see _wait)."""
        if not self._lock.acquire(blocking=False):
            self._wait()
        self._owner = threading.get_ident()

    def _wait(self) -> None:
        """Waits for the run in progress on another thread to return; raises KilnError where this thread is the one
        running (a kernel that calls back into its own session would wait forever)."""
        if self._owner == threading.get_ident():
            raise KilnError("this session is already running a method on this thread (a kernel or callback "
                            "called back into it); run the nested call on a session of its own")
        self._lock.acquire()

    def _release(self) -> None:
        self._owner = None
        self._lock.release()

    @contextlib.contextmanager
    def _turn(self) -> Iterator[None]:
        self._acquire()
        try:
            yield
        finally:
            self._release()

    def run(self, method: str, *inputs: Any) -> list[Any]:
        """Run `method` on `inputs`; returns its outputs as the backend's arrays (NumPy on the CPU). Safe to call
        from several threads at once: they take turns (see Session)."""
        # (_acquire and _release written out: their calls would add ~0.2 us to a tiny model's ~20 us run)
        if not self._lock.acquire(blocking=False):
            self._wait()
        self._owner = threading.get_ident()
        try:
            return self._run(method, inputs)
        finally:
            self._owner = None
            self._lock.release()

    def _run(self, method: str, inputs: tuple[Any, ...]) -> list[Any]:
        m = self.program.method(method)
        arrays = self._check_inputs(m, inputs)
        env = self._bind_symbols(m, arrays)
        env.update(self.backend.plan_hints(m, arrays, env))
        key = tuple(sorted(env.items()))
        plans = self._plans.setdefault(method, {})
        plan = plans.get(key)
        if plan is None:
            if len(plans) >= MAX_PLANS_PER_METHOD:
                plans.pop(next(iter(plans)))
            plan = plans[key] = self._build_plan(m, env)
        if self.graphs and plan.replay is not False:
            replayed = self._replay(m, key, plan, arrays)
            if replayed is not None:
                return replayed
        if plan.lowered is not None:
            outputs = plan.lowered(arrays, self.state)
            if outputs is not None:
                return outputs
        slots = self._slots(m, arrays)
        with self.backend.execution_context():
            self._execute(m, plan, slots)
        self._update_state(m, slots, arrays)
        outputs = []
        for i in m.outputs:
            out = self.backend.asarray(slots[i])
            outputs.append(self.backend.copy(out) if any(_may_alias(out, s) for s in self.state) else out)
        # Nothing here may hold the old state buffers any more: a lazy backend (mlx) then writes their updates in
        # their memory rather than into a copy.
        del slots
        self.backend.dispatch(outputs + self.state)
        return outputs

    def _update_state(self, m: Method, slots: list[Any], arrays: list[Any]) -> None:
        """The state buffers take their new values. State must not share memory with the caller's inputs or with
        the outputs handed back: a caller who refills an input buffer or edits an output in place would otherwise
        rewrite the state (a KV cache) behind our back."""
        for update in m.state_updates:
            new = slots[update.value]
            if self._fixed_state:
                if new is not self.state[update.state]:
                    self.backend.copy_into(self.state[update.state], new)
            else:
                aliased = any(_may_alias(new, a) for a in arrays)
                self.state[update.state] = self.backend.copy(new) if aliased else new

    def _slots(self, m: Method, arrays: list[Any], state: list[Any] | None = None) -> list[Any]:
        """One slot per value of `m`: constants, state buffers (the session's, or `state`) and inputs filled in,
        the rest empty."""
        state = self.state if state is None else state
        slots: list[Any] = [None] * len(m.values)
        for v_index, value in enumerate(m.values):
            if value.kind == ValueKind.CONSTANT:
                slots[v_index] = self.backend.constant(value.ref)
            elif value.kind == ValueKind.STATE:
                slots[v_index] = state[value.ref]
        for v_index, arr in zip(m.inputs, arrays, strict=True):
            slots[v_index] = arr
        return slots

    def _replay(self, m: Method, key: tuple, plan: _Plan, arrays: list[Any]) -> list[Any] | None:
        """The outputs of `plan` run as its captured graph (capturing it first, after WARMUP_RUNS runs op by op),
        or None when this run goes op by op."""
        if plan.replay is None:
            plan.runs += 1
            if plan.runs <= WARMUP_RUNS:  # the first runs compile kernels and build cuBLAS plans outside capture
                return None
            plan.replay = self._capture(m, plan, arrays)
            if plan.replay is False:
                return None
            graphed = self._graphed.setdefault(m.name, OrderedDict())
            graphed[key] = plan
            if len(graphed) > MAX_GRAPHS_PER_METHOD:  # the oldest signature gives its graph (and memory) back
                _, oldest = graphed.popitem(last=False)
                oldest.replay, oldest.runs = None, 0
        else:
            self._graphed[m.name].move_to_end(key)
        replay = plan.replay
        if isinstance(replay, Compiled):
            return self._run_compiled(m, key, plan, replay, arrays)
        assert isinstance(replay, Replay)
        for buffer, arr in zip(replay.inputs, arrays, strict=True):
            self.backend.copy_into(buffer, arr)
        replay.graph.launch()
        return [self.backend.copy(out) for out in replay.outputs]  # the next replay rewrites replay.outputs

    def _run_compiled(self, m: Method, key: tuple, plan: _Plan, compiled: Compiled,
                      arrays: list[Any]) -> list[Any] | None:
        """The outputs of `plan`'s compiled function, the state replaced by the new state it returns; None (and
        the plan runs op by op from now on) where its first call, which compiles it, fails."""
        try:
            outputs, updates = compiled.function(arrays, self.state)
        except Exception as e:  # noqa: BLE001 - any failure to trace or compile: the plan ran op by op before
            if compiled.calls:
                raise
            log.warning("%s backend: method %r (%s) runs op by op, compiling it failed: %s: %s",
                        self.backend.name, m.name, plan.env, type(e).__name__, e)
            plan.replay = False
            del self._graphed[m.name][key]
            return None
        compiled.calls += 1
        for update, new in zip(m.state_updates, updates, strict=True):
            self.state[update.state] = new
        self.backend.dispatch(outputs + self.state)
        return outputs

    def _capture(self, m: Method, plan: _Plan, arrays: list[Any]) -> Replay | Compiled | bool:
        if self.backend.can_compile:
            return self._compile(m, plan)
        inputs = [self.backend.empty_like(a) for a in arrays]
        for buffer, arr in zip(inputs, arrays, strict=True):
            self.backend.copy_into(buffer, arr)
        slots = self._slots(m, inputs)

        def body() -> list[Any]:
            self._execute(m, plan, slots)
            for update in m.state_updates:
                new, target = slots[update.value], self.state[update.state]
                if new is not target:
                    self.backend.copy_into(target, new)
            return [slots[i] for i in m.outputs]

        try:
            graph, outputs = self.backend.capture(body)
        except CaptureError as e:
            log.warning("%s backend: method %r (%s) runs op by op, its capture failed: %s",
                        self.backend.name, m.name, plan.env, e)
            return False
        return Replay(inputs, outputs, graph)

    def _compile(self, m: Method, plan: _Plan) -> Compiled:
        """`plan` as a function of (inputs, state) -> (outputs, new values of the updated state), compiled."""
        def body(inputs: list[Any], state: list[Any]) -> tuple[list[Any], list[Any]]:
            slots = self._slots(m, inputs, state)
            self._execute(m, plan, slots)
            return [slots[i] for i in m.outputs], [slots[u.value] for u in m.state_updates]

        return Compiled(self.backend.compile(body))

    def _execute(self, m: Method, plan: _Plan, slots: list[Any]) -> None:
        self._execute_steps(m, plan.steps, plan.env, slots)

    def _execute_steps(self, m: Method, steps: list[_Step], env: dict[str, int], slots: list[Any]) -> None:
        for step in steps:
            if step.steps is not None:  # a lowered run
                result = step.kernel(*[slots[i] for i in step.inputs])
                if result is None:
                    self._execute_steps(m, step.steps, env, slots)
                    continue
                for i, r in zip(step.outputs, result, strict=True):
                    slots[i] = r
                for i in step.free:
                    slots[i] = None
                continue
            try:
                result = step.kernel(*[slots[i] if i != NO_VALUE else None for i in step.inputs], **step.attrs)
            except KilnError:
                raise
            except Exception as e:
                raise KernelError(f"{self.backend.name} kernel for node {step.node.op!r} failed: "
                                  f"{type(e).__name__}: {e}" + _where(step.node)) from e
            if len(step.outputs) == 1:
                slots[step.outputs[0]] = result
            else:
                for i, r in zip(step.outputs, result, strict=False):
                    slots[i] = r
            if self.validate:
                self._check_outputs(m, step, slots, env)
            for i in step.free:
                slots[i] = None

    def _check_outputs(self, m: Method, step: _Step, slots: list[Any], env: dict[str, int]) -> None:
        for i in step.outputs:
            spec, got = m.values[i], slots[i]
            want = resolve_shape(spec.shape, env)
            if self.backend.numpy_dtype(got) != spec.dtype.numpy or tuple(got.shape) != want:
                raise KernelError(f"{self.backend.name} kernel for {step.node.op!r} produced "
                                  f"{self.backend.numpy_dtype(got)}{list(got.shape)} for {spec.name}, expected "
                                  f"{spec.dtype.name}{list(want)}" + _where(step.node))

    def _check_inputs(self, m: Method, inputs: tuple[Any, ...]) -> list[Any]:
        specs = m.input_specs()
        if len(inputs) != len(specs):
            listing = ", ".join(v.spec() for v in specs)
            raise InputError(f"method {m.name!r} takes {len(specs)} input(s) ({listing}), got {len(inputs)}")
        arrays = []
        for k, (x, spec) in enumerate(zip(inputs, specs, strict=True)):
            arr = self.backend.asarray(x)
            dtype = self.backend.numpy_dtype(arr)
            if dtype != spec.dtype.numpy:
                raise InputError(f"input {k} '{spec.name}' of {m.name!r}: expected dtype {spec.dtype.name} "
                                 f"({spec.spec()}), got {dtype}; convert it with .astype(...)")
            if arr.ndim != len(spec.shape):
                raise InputError(f"input {k} '{spec.name}' of {m.name!r}: expected {len(spec.shape)} dimensions "
                                 f"({spec.spec()}), got shape {list(arr.shape)}")
            arrays.append(arr)
        return arrays

    def _bind_symbols(self, m: Method, arrays: list[Any]) -> dict[str, int]:
        """Bind each symbol from the first input dimension that is exactly that symbol; check every other dim."""
        env: dict[str, int] = {}
        specs = m.input_specs()
        for spec, arr in zip(specs, arrays, strict=True):
            for d, size in zip(spec.shape, arr.shape, strict=True):
                if isinstance(d, str) and parse(d).is_symbol and d not in env:
                    env[d] = int(size)
        for s in m.symbols:
            if s.name not in env:
                continue
            value = env[s.name]
            if value < s.min or (s.max != UNBOUNDED and value > s.max):
                where = _symbol_site(m, s.name)
                raise InputError(f"{where} is {value}, outside the bounds of symbol {s.describe()} "
                                 f"that {m.name!r} was exported with")
        for k, (spec, arr) in enumerate(zip(specs, arrays, strict=True)):
            for axis, (d, size) in enumerate(zip(spec.shape, arr.shape, strict=True)):
                try:
                    want = resolve(d, env)
                except KeyError as e:
                    raise InputError(f"input '{spec.name}': symbol {e} cannot be bound from the inputs") from None
                except ExprError as e:
                    raise InputError(f"input '{spec.name}' dimension {axis} ({d}): {e}") from None
                if want != size:
                    raise InputError(f"input {k} '{spec.name}' of {m.name!r}: dimension {axis} is {size}, expected "
                                     f"{d}{'' if isinstance(d, int) else f' = {want}'} (spec {spec.spec()}, "
                                     f"got shape {list(arr.shape)})")
        return env

    def _build_plan(self, m: Method, env: dict[str, int]) -> _Plan:
        kernels = self.backend.kernels
        steps = []
        for node in m.nodes:
            kernel = kernels.get(node.op)
            if kernel is None:
                raise KilnError(f"the {self.backend.name} backend has no kernel for op {node.op!r}" + _where(node))
            try:
                attrs = resolve_attrs(ops.OPS[node.op], node.attrs, env)
            except (KeyError, ExprError) as e:
                raise InputError(f"node {node.op!r}: cannot resolve its attributes for {env}: "
                                 f"{type(e).__name__}: {e}" + _where(node)) from None
            inputs = tuple(node.inputs)
            prepared = self.backend.prepare(m, node, kernel, env)
            if prepared is not None:
                kernel, inputs = prepared
            steps.append(_Step(kernel, inputs, tuple(node.outputs), attrs, tuple(node.free_after), node))
        _keep_extra_inputs(steps)
        if self.validate:
            return _Plan(steps, env)
        nodes = [(s.node, s.attrs) for s in steps]
        lowered = self.backend.lower(m, nodes, env)
        if lowered is None:
            steps = _with_runs(steps, self.backend.lower_runs(m, nodes, [s.inputs for s in steps], env))
        return _Plan(steps, env, lowered=lowered)


def _with_runs(steps: list[_Step], runs: list[Any]) -> list[_Step]:
    """`steps` with each lowered run in place of the steps it covers: it reads what its plan binds, gives the values
    later steps read, and frees what its steps freed of the values made before it."""
    out: list[_Step] = []
    k = 0
    for run in sorted(runs, key=lambda r: r.start):
        out += steps[k:run.start]
        covered = steps[run.start:run.end]
        made = {i for step in covered for i in step.outputs}
        free = tuple(i for step in covered for i in step.free if i not in made)
        out.append(_Step(run.plan, tuple(run.plan.values), tuple(run.outputs), {}, free, covered[0].node, covered))
        k = run.end
    return out + steps[k:]


def _keep_extra_inputs(steps: list[_Step]) -> None:
    """A prepared step may read values its node does not (Backend.prepare): each such value is freed after its
    last reader among the steps, not where the exporter's memory plan freed it."""
    extra = {i for step in steps for i in step.inputs if i != NO_VALUE and i not in step.node.inputs}
    freed = {i for step in steps for i in step.free}
    extra &= freed  # (values the plan never frees, outputs and state updates, stay that way)
    if not extra:
        return
    last = {i: k for k, step in enumerate(steps) for i in step.inputs if i in extra}
    for k, step in enumerate(steps):
        step.free = tuple(i for i in step.free if i not in extra) + tuple(i for i in extra if last[i] == k)


def resolve_attrs(opdef: ops.OpDef, attrs: dict[str, Any], env: dict[str, int]) -> dict[str, Any]:
    """A node's attributes as its kernel takes them: defaults filled in, symbolic sizes resolved under `env`."""
    out = {}
    for adef in opdef.attrs:
        value = attrs.get(adef.name, None if adef.default is REQUIRED else adef.default)
        if adef.type == AttrType.SYMINT and value is not None:
            value = resolve(value, env)
        elif adef.type == AttrType.SYMINTS and value is not None:
            value = resolve_shape(tuple(value), env)
        out[adef.name] = value
    return out


def _symbol_site(m: Method, name: str) -> str:
    for spec in m.input_specs():
        for axis, d in enumerate(spec.shape):
            if d == name:
                return f"input '{spec.name}' dimension {axis} ({name}, spec {spec.name}{format_shape(spec.shape)})"
    return f"symbol {name}"


def _where(node: Node) -> str:
    return f"\n  from: {node.source}" if node.source else ""


def _may_alias(a: Any, b: Any) -> bool:
    """Whether two arrays may share memory (NumPy's bounds check; identity for other array types)."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return np.may_share_memory(a, b)
    return a is b or getattr(a, "base", None) is b or getattr(b, "base", None) is a
