"""What a backend provides to a session: kernels by op name, and array conversions."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np

from kiln.ir.graph import Method, Node, StateBuffer, ValueKind
from kiln.registry import register_once

Kernel = Callable[..., Any]
Prepared = tuple[Kernel, tuple[int, ...]]
"""A kernel specialized at plan time and the values it reads (Backend.prepare)."""


class KernelRegistry:
    """Kernels of one backend by kiln op name; registering an op twice is a bug."""

    def __init__(self, backend: str):
        self.backend = backend
        self.kernels: dict[str, Kernel] = {}

    def register(self, *names: str) -> Callable[[Kernel], Kernel]:
        return register_once(self.kernels, f"{self.backend} kernel", names)

    def add(self, name: str, fn: Kernel) -> None:
        self.register(name)(fn)

    def adopt(self, portable: dict[str, Kernel], xp: Any) -> None:
        """The portable kernels (kiln.runtime.backends.array_api) bound to array module xp, and the compositions of
        fused ops (kiln.runtime.backends.composite), for every op this backend has no kernel of its own for. Called
        once, after the backend's own kernels are registered."""
        from kiln.runtime.backends.array_api import bind

        for name, fn in portable.items():
            if name not in self.kernels:
                self.kernels[name] = bind(fn, xp)
        self.compose()

    def compose(self) -> None:
        """The compositions of fused ops (kiln.runtime.backends.composite) for every fused op this backend has no
        kernel of its own for."""
        from kiln.runtime.backends.composite import COMPOSITES
        from kiln.runtime.backends.composite import bind as bind_composite

        for name, composite in COMPOSITES.items():
            if name not in self.kernels:
                self.kernels[name] = bind_composite(composite, self.kernels)


class PreparerRegistry:
    """A backend's plan-time specializations by op name (Backend.prepare): fn(context, method, node, env) gives a
    Prepared or None, `context` being what the backend reads constants through (the program, or the program's
    arrays in the backend's own format)."""

    def __init__(self, backend: str):
        self.backend = backend
        self.preparers: dict[str, Callable[..., Prepared | None]] = {}

    def register(self, *ops: str) -> Callable[[Callable[..., Prepared | None]], Callable[..., Prepared | None]]:
        return register_once(self.preparers, f"{self.backend} preparer", ops)

    def prepare(self, context: Any, method: Method, node: Node, env: dict[str, int]) -> Prepared | None:
        fn = self.preparers.get(node.op)
        return None if fn is None else fn(context, method, node, env)


def constant_ref(method: Method, node: Node, position: int) -> int | None:
    """The program constant that input `position` of node is, or None (not a constant, or absent)."""
    if position >= len(node.inputs) or node.inputs[position] < 0:
        return None
    v = method.values[node.inputs[position]]
    return v.ref if v.kind == ValueKind.CONSTANT else None


def absent(node: Node, position: int) -> bool:
    """Whether optional input `position` of node is left out."""
    return position >= len(node.inputs) or node.inputs[position] < 0


class Backend:
    """A backend instance bound to one program and one session."""

    name: str = ""
    kernels: dict[str, Kernel] = {}
    can_capture: bool = False
    """Whether `capture` works: sessions then replay each method as a graph (kiln.runtime.graphs)."""
    can_compile: bool = False
    """Whether `compile` works: sessions then run each method as one compiled function of its inputs and state
    (kiln.runtime.graphs); state stays functional (each run returns new state arrays)."""
    graphs_by_default: bool = False
    """Whether sessions capture (or compile) unless told otherwise."""
    threads: int | None = None
    """Threads this backend's kernels may use (the session's `threads=`; CPU only, None: KILN_THREADS or every
    core)."""
    attends_rows_in_place: bool = False
    """Whether slot_attention reads each row's slot where it lies, so many rows of one slot cost what their keys
    cost: a serving engine then feeds prompt chunks as rows of its decode steps (kiln.runtime.serve.engine). A
    backend that copies a slot's keys per row would pay a whole slot for every prompt token."""
    samples_on_device: bool = False
    """Whether a serving engine samples temperature-only sequences with sample_rows_here (their logits then stay
    where they are), rather than bringing the rows to the host's Sampler."""

    def constant(self, index: int) -> Any:
        raise NotImplementedError

    def initial_state(self, index: int, buffer: StateBuffer) -> Any:
        raise NotImplementedError

    def asarray(self, x: Any) -> Any:
        raise NotImplementedError

    def to_numpy(self, x: Any) -> np.ndarray:
        raise NotImplementedError

    def argmax_rows(self, x: Any) -> np.ndarray:
        """The index of the largest value of each row of x ([rows, n]; the first of ties) as NumPy int64, computed
        where x lives: a GPU hands back `rows` integers, not the rows themselves (a serving engine's greedy
        sequences, whose logits over a large vocabulary would otherwise cross to the host every step)."""
        return np.argmax(self.to_numpy(x).reshape(x.shape[0], -1), axis=1)

    def argmax_rows_here(self, x: Any) -> Any:
        """argmax_rows left where x lives (int64 [rows], this backend's array): a serving engine feeds a step's
        greedy picks to the next step without waiting for them (kiln.runtime.serve.engine's overlap)."""
        return self.argmax_rows(x)

    def sample_rows_here(self, x: Any, inv_temperature: np.ndarray, seeds: np.ndarray, counters: np.ndarray) -> Any:
        """Each row's sampled token (int64 [rows], this backend's array), as kernels/argmax.cu's sample_rows: the
        argmax of x * inv_temperature + Gumbel noise of (seed, counter) (no noise where inv_temperature is 0; -1
        for a row with a NaN). Here in NumPy (sampling.sample_rows_reference)."""
        from kiln.runtime.llm.sampling import sample_rows_reference

        return self.asarray(sample_rows_reference(self.to_numpy(x), inv_temperature, seeds, counters))

    def upload(self, x: np.ndarray) -> Any:
        """x as this backend's array without waiting for the device's queued work (a GPU copies it from pinned
        memory, in order on its stream): the next step's inputs while the step before it still runs."""
        return self.asarray(x)

    def fetch(self, x: Any) -> Callable[[], np.ndarray]:
        """Start copying x to the host; the returned function waits for that copy alone (not for work queued
        after it) and gives the NumPy array."""
        arr = self.to_numpy(x)
        return lambda: arr

    def put_rows(self, target: Any, rows: np.ndarray, source: Any, picks: np.ndarray) -> Any:
        """target (this backend's 1-d array) with target[rows] = source[picks], source another array of it."""
        out = np.array(self.to_numpy(target))
        out[rows] = self.to_numpy(source)[picks]
        return self.asarray(out)

    def numpy_dtype(self, x: Any) -> np.dtype:
        """x's element type as a NumPy dtype (the type the program's specs are written in)."""
        return x.dtype

    def empty_like(self, x: Any) -> Any:
        """A new uninitialized array of this backend with x's shape and dtype."""
        raise NotImplementedError

    def copy_into(self, target: Any, source: Any) -> None:
        """Write source (of target's shape and dtype; a host or a backend array) into target."""
        target[...] = source

    def copy(self, x: Any) -> Any:
        return x.copy()

    def capture(self, body: Callable[[], list[Any]]) -> tuple[Any, list[Any]]:
        """Record body's kernels as one graph without running them: (graph with launch(), body's outputs), or
        CaptureError when body cannot be captured."""
        raise NotImplementedError

    def compile(self, fn: Callable[[list[Any], list[Any]], tuple[list[Any], list[Any]]]) -> Callable[..., Any]:
        """fn(inputs, states) -> (outputs, new states), compiled for the input shapes it is first called with
        (compiling, if it fails, fails at that first call, with CaptureError)."""
        raise NotImplementedError

    def dispatch(self, arrays: list[Any]) -> None:
        """Start computing `arrays` where the backend builds them lazily (MLX), so work does not wait for the first
        read and state does not grow into an ever longer chain of pending operations; nothing on eager backends."""

    def plan_hints(self, method: Method, arrays: list[Any], env: dict[str, int]) -> dict[str, int]:
        """Facts about this run's inputs that a plan may be specialized to, as entries added to the symbols' values
        (their names never clash with a symbol's): runs with equal hints share a plan (and its graph). Asked before
        every run, so it must be cheap; none by default."""
        return {}

    def prepare(self, method: Method, node: Node, kernel: Kernel,
                env: dict[str, int]) -> tuple[Kernel, tuple[int, ...]] | None:
        """A form of `node`'s kernel specialized to this program (and to the plan's symbols and hints, `env`), and
        the values it reads (the node's inputs, or others of the method); None to run `kernel` on the node's
        inputs. A session asks once per node and plan: where a backend converts constants to its own layouts once
        (quantized weights) or maps a pattern of the graph onto one of its primitives."""
        return None

    def lower(self, method: Method, steps: list[tuple[Node, dict[str, Any]]],
              env: dict[str, int]) -> Callable[[list[Any], list[Any]], list[Any] | None] | None:
        """`method` (its nodes with their resolved attributes, for the plan's symbols `env`) as one function
        run(inputs, state) -> outputs that updates the state buffers in place and returns None where it cannot
        take this run's values (the session then runs the nodes one by one, which raise the op's error); None
        when the backend does not lower it (the CPU's native executor: cpu/executor.py)."""
        return None

    def lower_runs(self, method: Method, steps: list[tuple[Node, dict[str, Any]]], reads: list[tuple[int, ...]],
                   env: dict[str, int]) -> list[Any]:
        """Where `lower` does not take a whole method: runs of its consecutive steps as functions of their own,
        each with .start, .end (the steps it replaces), .plan(*arrays of .plan.values) -> arrays of .outputs or None
        (its steps then run one by one), and .outputs (the values later steps read); reads[k] is what step k
        reads. [] when the backend lowers none."""
        return []

    def execution_context(self) -> contextlib.AbstractContextManager:
        """Entered around each run (e.g. the CPU backend's floating-point error mode)."""
        return contextlib.nullcontext()
