"""`kiln bench`, the timing core it shares with benchmarks/ (kiln.runtime.bench) and the per-op profiler.

No timing assertions: only that it runs, reports the fields it promises, and fails with clear messages.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import kiln
from kiln.cli import main
from kiln.runtime.bench import Contestant, Stats, run_interleaved, stats_table, traced_peak
from kiln.runtime.profile import OpProfiler


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x):
        self.calls.add_(1)
        return torch.relu(self.fc(x)) + self.calls


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    torch.manual_seed(0)
    seq = torch.export.Dim("seq", min=1, max=64)
    path = tmp_path_factory.mktemp("bench") / "net.kiln"
    kiln.export(Net(), (torch.randn(2, 5, 8),), dynamic_shapes={"x": {1: seq}}).save(path)
    return str(path)


def bench(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["bench", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_bench_random_inputs_prints_every_field(model, capsys):
    code, out, err = bench(capsys, model, "--dim", "seq=16", "--warmup", "1", "--repeat", "5")
    assert code == 0, err
    assert "method 'forward' on cpu" in out
    assert "in_0 x: float32[2, 16, 8]" in out
    assert "runs: 1 warm-up, 5 timed" in out
    assert re.search(r"latency ms: median [\d.]+ +min [\d.]+ +max [\d.]+ +mean [\d.]+", out), out
    assert re.search(r"peak memory: .+ allocated during one run \(tracemalloc\), peak RSS \+", out), out


def test_bench_no_graphs_is_accepted_everywhere(model, capsys):
    code, out, err = bench(capsys, model, "--dim", "seq=4", "--repeat", "2", "--no-memory", "--no-graphs")
    assert code == 0, err
    assert "latency ms" in out


def test_bench_npy_inputs_and_profile(model, tmp_path, capsys):
    x = tmp_path / "x.npy"
    np.save(x, np.random.default_rng(0).standard_normal((2, 3, 8), dtype=np.float32))
    code, out, err = bench(capsys, model, "-i", str(x), "--repeat", "3", "--no-memory", "--profile", "5")
    assert code == 0, err
    assert "in_0 x: float32[2, 3, 8]" in out
    assert "peak memory" not in out
    assert "ops by time" in out
    assert re.search(r"^linear +1 ", out, re.MULTILINE), out  # one linear node, one call per run


@pytest.mark.parametrize("argv, message", [
    ([], "--dim seq=N"),
    (["--dim", "seq=16", "--repeat", "0"], "--repeat must be >= 1"),
    (["--dim", "seq=16", "--warmup", "-1"], "--warmup must be >= 0"),
    (["--dim", "nope=3"], "has no symbol 'nope'"),
    (["--dim", "seq=16", "--method", "decode"], "no method 'decode'"),
    (["--dim", "seq=100"], "outside the bounds"),
])
def test_bench_errors_are_clear(model, capsys, argv, message):
    code, out, err = bench(capsys, model, *argv)
    assert code == 2
    assert message in err, err
    assert "Traceback" not in err


def test_bench_missing_file(tmp_path, capsys):
    code, _, err = bench(capsys, str(tmp_path / "absent.kiln"))
    assert code == 2 and "no such file" in err


def test_bench_dim_with_inputs_is_refused(model, tmp_path, capsys):
    x = tmp_path / "x.npy"
    np.save(x, np.zeros((2, 3, 8), np.float32))
    code, _, err = bench(capsys, model, "-i", str(x), "--dim", "seq=3")
    assert code == 2 and "--dim" in err


def test_run_interleaved_rotates_and_counts():
    order: list[str] = []
    setups: list[str] = []
    contestants = [Contestant(n, lambda n=n: order.append(n), setup=lambda n=n: setups.append(n)) for n in "abc"]
    stats = run_interleaved(contestants, warmup=2, repeat=3)
    assert [len(s.times) for s in stats.values()] == [3, 3, 3]
    assert order[:6] == list("aabbcc")  # warm-up: each contestant's own
    assert order[6:] == list("abcbcacab")  # timed: round-robin, each round starting one further
    assert setups == order  # setup runs before every call, warm-up included
    with pytest.raises(ValueError, match="unique"):
        run_interleaved([contestants[0], contestants[0]])
    with pytest.raises(ValueError, match="repeat"):
        run_interleaved(contestants, repeat=0)


def test_stats_table_ratios_against_baseline():
    stats = {"kiln": Stats("kiln", [0.003, 0.004, 0.005]), "eager": Stats("eager", [0.002, 0.002, 0.002])}
    table = stats_table(stats, baseline="eager")
    kiln_row = next(line for line in table.splitlines() if line.startswith("kiln"))
    assert kiln_row.split()[1] == "4.000" and kiln_row.split()[-1] == "2.00"
    with pytest.raises(ValueError, match="baseline"):
        stats_table(stats, baseline="ort")


def test_traced_peak_sees_numpy_allocations():
    assert traced_peak(lambda: np.ones(1 << 20, np.float64)) >= 8 << 20


def test_profiler_counts_each_kernel_call(model):
    program = kiln.load(model)
    session = program.session()
    profiler = OpProfiler().attach(session)
    x = np.random.default_rng(0).standard_normal((2, 4, 8), dtype=np.float32)
    for _ in range(2):
        session.run("forward", x)
    ops = [n.op for n in program.method("forward").nodes]
    assert {name: t.calls for name, t in profiler.by_op.items()} == {op: 2 * ops.count(op) for op in set(ops)}
    assert "linear float32[2, 4, 8]" in profiler.table(sites=True)
    # the CPU lowers this method to its native executor: what ran is timed per instruction, not a Python path
    from kiln.runtime.backends.cpu import native

    assert bool(profiler.plans) == (native.library() is not None)


def test_bench_never_imports_torch(model):
    script = (f"import sys\nfrom kiln.cli import main\n"
              f"assert main(['bench', {model!r}, '--dim', 'seq=4', '--repeat', '2', '--profile', '3']) == 0\n"
              "print('TORCH:', sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "TORCH: []" in result.stdout


@pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="needs MLX")
@pytest.mark.parametrize("graphs", [[], ["--no-graphs"]], ids=["compiled", "op_by_op"])
def test_bench_on_mlx(model, capsys, graphs):
    code, out, err = bench(capsys, model, "--dim", "seq=4", "--repeat", "3", "--no-memory", "--backend", "mlx",
                           *graphs)
    assert code == 0, err
    assert "method 'forward' on mlx" in out and "latency ms" in out
