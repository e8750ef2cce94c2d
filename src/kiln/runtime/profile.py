"""Per-op timing of a session: where a model's time goes, kernel by kernel. Torch-free.

`OpProfiler.attach(session)` swaps the session's kernel table for timed wrappers (and drops its cached plans, which
hold the kernels they were built with), so the next runs record, for each kiln op and for each (op, input shapes),
the number of calls and the total time. The wrappers cost a few microseconds a call, so profile to rank ops, and
time the model without the profiler. Methods (or runs of nodes) the CPU backend lowers to its native executor stay
lowered, as they run unprofiled: their plans time each instruction in C (NativePlan.profile), reported under the
op of the node that emitted it with its input and output shapes.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from kiln.runtime.bench import format_table


@dataclass
class OpTime:
    calls: int = 0
    seconds: float = 0.0


def _shape_key(args: tuple[Any, ...]) -> str:
    shapes = [f"{getattr(a, 'dtype', '')}{list(a.shape)}" for a in args if hasattr(a, "shape")]
    return " ".join(shapes)


class OpProfiler:
    """Accumulates kernel time by op name and by op and input shapes over every run of the attached sessions."""

    def __init__(self) -> None:
        self.kernel_op: dict[str, OpTime] = defaultdict(OpTime)
        self.kernel_site: dict[tuple[str, str], OpTime] = defaultdict(OpTime)
        self.plans: list[Any] = []
        """Lowered plans (cpu executor) timing their instructions."""

    def _folded(self) -> tuple[dict[str, OpTime], dict[tuple[str, str], OpTime]]:
        """The kernels' times with the lowered plans' instructions added by the op that emitted them."""
        by_op = defaultdict(OpTime, {k: OpTime(v.calls, v.seconds) for k, v in self.kernel_op.items()})
        by_site = defaultdict(OpTime, {k: OpTime(v.calls, v.seconds) for k, v in self.kernel_site.items()})
        for plan in self.plans:
            runs = max(plan.runs, 1)
            for origin, ns in zip(plan.origins, plan.times, strict=True):
                op, _, shapes = origin.partition(" ")
                for table, key in ((by_op, op), (by_site, (op, shapes))):
                    table[key].calls += runs
                    table[key].seconds += float(ns) * 1e-9
        return by_op, by_site

    @property
    def by_op(self) -> dict[str, OpTime]:
        return self._folded()[0]

    @property
    def by_site(self) -> dict[tuple[str, str], OpTime]:
        return self._folded()[1]

    def attach(self, session: Any) -> OpProfiler:
        """Time every kernel `session` runs from now on; returns self."""
        original = session.backend.kernels
        session.backend.kernels = {name: self._wrap(name, fn) for name, fn in original.items()}
        prepare = session.backend.prepare

        def timed_prepare(method: Any, node: Any, kernel: Any, env: dict[str, int]) -> Any:
            """Kernels the backend specializes at plan time (Backend.prepare) are timed under their node's op."""
            prepared = prepare(method, node, kernel, env)
            return None if prepared is None else (self._wrap(node.op, prepared[0]), prepared[1])

        session.backend.prepare = timed_prepare
        lower, lower_runs = session.backend.lower, session.backend.lower_runs

        def timed_lower(*args: Any) -> Any:
            """A lowered method runs no kernel from Python: its plan times its own instructions."""
            plan = lower(*args)
            if plan is not None and hasattr(plan, "profile"):
                plan.profile()
                self.plans.append(plan)
            return plan

        def timed_lower_runs(*args: Any) -> list[Any]:
            runs = lower_runs(*args)
            for run in runs:
                run.plan.profile()
                self.plans.append(run.plan)
            return runs

        session.backend.lower = timed_lower
        session.backend.lower_runs = timed_lower_runs
        session._plans.clear()  # plans built before hold the unwrapped kernels
        session.graphs = False  # a replayed graph calls no kernel from Python: time them one by one
        return self

    def _wrap(self, name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            result = fn(*args, **kwargs)
            dt = time.perf_counter() - t0
            op = self.kernel_op[name]
            op.calls += 1
            op.seconds += dt
            site = self.kernel_site[(name, _shape_key(args))]
            site.calls += 1
            site.seconds += dt
            return result
        timed.__name__ = getattr(fn, "__name__", name)
        return timed

    def reset(self) -> None:
        self.kernel_op.clear()
        self.kernel_site.clear()
        for plan in self.plans:
            plan.profile()

    @property
    def total(self) -> float:
        return sum(t.seconds for t in self.by_op.values())

    def table(self, top: int = 15, runs: int = 1, sites: bool = False) -> str:
        """The `top` ops (or op+shape sites) by total time, as time per run (over `runs` runs) and share of all."""
        items = self.by_site.items() if sites else self.by_op.items()
        ranked = sorted(items, key=lambda kv: kv[1].seconds, reverse=True)[:top]
        total = self.total or 1.0
        rows = []
        for key, t in ranked:
            name = f"{key[0]} {key[1]}" if sites else key
            rows.append([name, str(t.calls // max(runs, 1)), f"{t.seconds / runs * 1e3:.3f}",
                         f"{100 * t.seconds / total:.1f}%"])
        header = ["op and input shapes" if sites else "op", "calls/run", "ms/run", "share"]
        return format_table(rows, header)


__all__ = ["OpProfiler", "OpTime"]
