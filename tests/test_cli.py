"""The `kiln` command line: export -> inspect -> run through `main([...])`, error exits, and torch-free run/inspect."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import runpy
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.cli import main
from kiln.ir import ops

FACTORIES = textwrap.dedent('''
    import torch
    import kiln.export


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 4)
            self.register_buffer("calls", torch.zeros(1))

        def forward(self, x):
            self.calls.add_(1)
            return torch.relu(self.fc(x)), x.sum(-1)

        def double(self, x):
            return x * 2


    def make():
        torch.manual_seed(0)
        seq = torch.export.Dim("seq", min=1, max=64)
        return Net(), (torch.randn(2, 5, 8),), {"x": {1: seq}}


    def multi():
        return Net(), {"forward": kiln.export.Method((torch.randn(2, 5, 8),)),
                       "double": kiln.export.Method((torch.randn(3),))}


    class Svd(torch.nn.Module):
        def forward(self, x):
            return torch.linalg.svd(x)[0]


    def unsupported():
        return Svd(), (torch.randn(3, 3),)


    def only_module():
        return Net()
''')


def cli(*argv: str | Path) -> tuple[int, str, str]:
    """Run `kiln argv...` in this process; returns (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def factories(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "factories.py"
    path.write_text(FACTORIES)
    return path


@pytest.fixture(scope="module")
def exported(factories: Path) -> tuple[Path, str]:
    """`kiln export factories.py:make` once for the module: (the .kiln path, what export printed)."""
    path = factories.parent / "net.kiln"
    code, out, err = cli("export", f"{factories}:make", "-o", path, "--meta", "origin=test")
    assert code == 0, err
    return path, out


def eager(factories: Path, x: np.ndarray) -> list[np.ndarray]:
    model = runpy.run_path(str(factories))["make"]()[0].eval()  # seeded: the same weights as the export
    with torch.no_grad():
        return [t.numpy() for t in model(torch.from_numpy(x))]


def test_export_prints_progress_and_summary(exported):
    path, out = exported
    assert path.is_file()
    for expected in ("capturing and lowering forward", "captured forward", "lowered forward", f"writing {path}",
                     "methods: forward (", "constants: 3,", "MB", "state buffers: 1 (calls)", "done in"):
        assert expected in out, (expected, out)


def test_inspect_text(exported):
    code, out, _ = cli("inspect", exported[0])
    assert code == 0
    for expected in (f"format version 1, op set version {ops.OPSET_VERSION}", "origin: test", "method forward:",
                     "x: float32[2, seq, 8]", "float32[2, seq, 4]", "symbols: seq in [1, 64]",
                     "updates state: calls", "1  linear", "calls: float32[1], 4 B, initially zeros",
                     "constants: 3"):
        assert expected in out, (expected, out)


def test_inspect_json(exported):
    path = exported[0]
    code, out, _ = cli("inspect", path, "--json")
    assert code == 0
    info = json.loads(out)
    assert info["file_bytes"] == path.stat().st_size
    assert info["metadata"]["origin"] == "test"
    (method,) = info["methods"]
    assert method["inputs"] == [{"name": "x", "dtype": "float32", "shape": [2, "seq", 8]}]
    assert [o["shape"] for o in method["outputs"]] == [[2, "seq", 4], [2, "seq"]]
    assert method["symbols"] == [{"name": "seq", "min": 1, "max": 64}]
    assert sum(method["ops"].values()) == method["nodes"]
    assert list(method["ops"].values()) == sorted(method["ops"].values(), reverse=True)
    assert method["ops"]["linear"] == 1 and method["updates_state"] == ["calls"]
    assert info["constants"]["count"] == 3 and info["constants"]["blobs"] <= 3
    assert info["constants"]["bytes"] >= (8 * 4 + 4) * 4  # the linear's weight and bias at least
    assert info["states"] == [{"name": "calls", "dtype": "float32", "shape": [1], "bytes": 4, "initial": "zeros"}]


def test_run_with_inputs_matches_eager(exported, factories, tmp_path):
    x = np.random.default_rng(0).standard_normal((2, 7, 8)).astype(np.float32)  # seq 7, exported with 5
    np.save(tmp_path / "x.npy", x)
    code, out, err = cli("run", exported[0], "-i", tmp_path / "x.npy", "-o", tmp_path / "res", "--repeat", "3")
    assert code == 0, err
    assert "out_0 output_0" in out and "float32[2, 7, 4]" in out and "float32[2, 7]" in out
    assert "latency: first run" in out and "median of 3 more" in out
    outs = [np.load(tmp_path / "res" / f"out_{k}.npy") for k in range(2)]
    for got, want in zip(outs, eager(factories, x), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_run_random_matches_eager(exported, factories, tmp_path):
    code, out, err = cli("run", exported[0], "--random", "--dim", "seq=3", "--seed", "1", "-o", tmp_path)
    assert code == 0, err
    x = np.load(tmp_path / "in_0.npy")
    assert x.dtype == np.float32 and x.shape == (2, 3, 8) and np.std(x) > 0.1
    for k, want in enumerate(eager(factories, x)):
        np.testing.assert_allclose(np.load(tmp_path / f"out_{k}.npy"), want, rtol=1e-5, atol=1e-5)


def test_multi_method_factory_exports_chosen_method(factories, tmp_path):
    path = tmp_path / "double.kiln"
    code, out, err = cli("export", f"{factories}:multi", "-o", path, "--method", "double")
    assert code == 0, err
    assert "methods: double (1 node)" in out
    assert [m["name"] for m in json.loads(cli("inspect", path, "--json")[1])["methods"]] == ["double"]
    x = np.arange(3, dtype=np.float32) - 1.5
    np.save(tmp_path / "x.npy", x)
    code, out, err = cli("run", path, "-i", tmp_path / "x.npy", "-o", tmp_path)  # the only method: no --method
    assert code == 0, err
    np.testing.assert_array_equal(np.load(tmp_path / "out_0.npy"), x * 2)


def test_unsupported_op_exits_2_and_writes_nothing(factories, tmp_path):
    path = tmp_path / "svd.kiln"
    code, out, err = cli("export", f"{factories}:unsupported", "-o", path)
    assert code == 2
    assert "aten._linalg_svd" in err and "nothing was written" in err and "factories.py" in err
    assert "Traceback" not in err + out
    assert not path.exists()


@pytest.mark.parametrize("spec, message", [
    ("{f}", "has no factory after ':'"),
    ("{d}/missing.py:make", "no such file"),
    ("{f}:nothing", "has no attribute 'nothing'; callables there: Net, Svd, make"),
    ("no_such_package_xyz.models:make", "no module named 'no_such_package_xyz'"),
    ("{f}:only_module", "returned Net; it must return (module, example_args"),
    ("{f}:multi --method nope", "--method nope: the factory defines methods ['forward', 'double']"),
])
def test_bad_spec_exits_2_with_message(factories, tmp_path, spec, message):
    spec, *rest = spec.format(f=factories, d=factories.parent).split()
    code, out, err = cli("export", spec, "-o", tmp_path / "x.kiln", *rest)
    assert code == 2
    assert message in err, err
    assert "Traceback" not in err


def test_run_errors_exit_2_with_message(exported, tmp_path):
    path = exported[0]
    np.save(tmp_path / "x64.npy", np.ones((2, 3, 8)))  # float64, the model takes float32
    truncated = tmp_path / "truncated.kiln"
    truncated.write_bytes(path.read_bytes()[:100])
    cases = [
        (("run", path, "-i", tmp_path / "x64.npy"), "expected dtype float32"),
        (("run", path, "-i", tmp_path / "absent.npy"), "does not exist"),
        (("run", path, "--random"), "give --dim seq=N (seq in [1, 64])"),
        (("run", path, "--random", "--dim", "seq=65"), "outside the bounds of symbol seq in [1, 64]"),
        (("run", path, "--random", "--dim", "len=4"), "no symbol 'len'"),
        (("run", path, "--method", "decode", "--random"), "no method 'decode'"),
        (("run", truncated, "--random"), "truncated"),
        (("inspect", truncated), "truncated"),
        (("inspect", tmp_path / "absent.kiln"), "absent.kiln: no such file"),
    ]
    for argv, message in cases:
        code, out, err = cli(*argv)
        assert code == 2, (argv, out, err)
        assert message in err, (argv, err)
        assert "Traceback" not in err


@pytest.mark.parametrize("command", ["export", "run", "inspect"])
def test_each_command_has_help_with_example(command):
    code, out, _ = cli(command, "--help")
    assert code == 0
    assert "example" in out and f"kiln {command} " in out


def test_subprocess_entry_points_and_torch_free_run_inspect(exported):
    """`python -m kiln.cli`, `python -m kiln`, and run/inspect in a fresh process that never imports torch."""
    help_out = subprocess.run([sys.executable, "-m", "kiln.cli", "--help"], capture_output=True, text=True,
                              timeout=60)
    assert help_out.returncode == 0 and "export" in help_out.stdout and "inspect" in help_out.stdout
    run_help = subprocess.run([sys.executable, "-m", "kiln", "run", "--help"], capture_output=True, text=True,
                              timeout=60)
    assert run_help.returncode == 0 and "--random" in run_help.stdout
    script = textwrap.dedent(f'''
        import sys
        from kiln.cli import main
        assert main(["inspect", {str(exported[0])!r}]) == 0
        assert main(["run", {str(exported[0])!r}, "--random", "--dim", "seq=4"]) == 0
        leaked = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        print("TORCH:", leaked)
    ''')
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "TORCH: []" in result.stdout, result.stdout
    assert "latency: first run" in result.stdout


@pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="needs MLX")
def test_run_on_mlx_matches_eager(exported, factories, tmp_path):
    x = np.random.default_rng(0).standard_normal((2, 7, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    code, out, err = cli("run", exported[0], "-i", tmp_path / "x.npy", "-o", tmp_path / "res", "--backend", "mlx")
    assert code == 0, err
    assert "on mlx" in out
    for k, want in enumerate(eager(factories, x)):
        np.testing.assert_allclose(np.load(tmp_path / "res" / f"out_{k}.npy"), want, rtol=1e-5, atol=1e-5)


def test_threads_option_reaches_the_kernels_and_is_checked(exported, factories, tmp_path, monkeypatch):
    """--threads sets the compiled kernels' thread count for the command only (KILN_THREADS while it runs, put
    back after); the results do not change; a count below 1 is a usage error."""
    from kiln.runtime.backends.cpu import native

    seen = []
    counted = native.threads
    monkeypatch.setattr(native, "threads", lambda: seen.append(counted()) or seen[-1])
    monkeypatch.setenv("KILN_THREADS", "3")
    x = np.random.default_rng(1).standard_normal((2, 5, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    code, _, err = cli("run", exported[0], "-i", tmp_path / "x.npy", "-o", tmp_path / "res", "--threads", "2")
    assert code == 0, err
    assert seen and set(seen) == {2}
    import os

    assert os.environ["KILN_THREADS"] == "3"
    for k, want in enumerate(eager(factories, x)):
        np.testing.assert_allclose(np.load(tmp_path / "res" / f"out_{k}.npy"), want, rtol=1e-5, atol=1e-5)
    code, _, err = cli("run", exported[0], "--random", "--threads", "0")
    assert code == 2 and "positive integer" in err


def test_commands_show_the_gpu_backends_progress_on_stderr(monkeypatch, capsys) -> None:
    """The CUDA backend's INFO lines (its first compile of the kernels on a machine) reach stderr once a command
    runs, through one handler however many commands run in the process."""
    import logging

    from kiln import cli

    logger = logging.getLogger("kiln.runtime.cuda")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "propagate", logger.propagate)
    monkeypatch.setattr(logger, "level", logger.level)
    cli.show_progress()
    cli.show_progress()
    assert len(logger.handlers) == 1
    logger.info("compiling quant.cu's 162 CUDA kernel instances")
    assert capsys.readouterr().err == "kiln: compiling quant.cu's 162 CUDA kernel instances\n"
