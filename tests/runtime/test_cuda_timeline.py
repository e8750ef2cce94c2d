"""The kernel timeline (KILN_CUDA_TIMELINE=1): each kiln kernel of a graph replay recorded once, in launch order."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import BACKENDS

# Run in a child: the switch is read once, and compiles every kernel with the recording, which the rest of the
# suite must not get.
_CHILD = r"""
import statistics
import cupy as cp
import kiln
from kiln.models.llm import export_llm
from kiln.models.zoo import tiny_decoder
from kiln.runtime.backends.cuda import timeline

program = kiln.load(export_llm(tiny_decoder("llama"), max_context=48, prefill_chunk=8).to_bytes())
session = program.session("cuda")
inputs = (cp.asarray([[5]]), cp.asarray([3]))
session.run("decode", *inputs)
window = timeline.Window()
session.run("decode", *inputs)
window.close()
assert session.captured_graphs.get("decode"), "not captured"
for _ in range(3):
    timeline.reset()
    session.run("decode", *inputs)
    cp.cuda.Device().synchronize()
    spans = window.spans()
releases = [s.released_ns for s in spans]
assert releases == sorted(releases) and releases[0] == 0, releases
assert all(s.span_ns > 0 for s in spans[:-1]) and spans[-1].span_ns is None
assert all(s.started_ns <= s.released_ns for s in spans)
print(len(spans), sorted({s.name.split("<")[0] for s in spans}))
timeline.reset()
session.run("decode", *inputs)
session.run("decode", *inputs)
cp.cuda.Device().synchronize()
try:
    window.spans()
except RuntimeError as e:
    print("two replays:", e)
"""


@pytest.mark.cuda
@pytest.mark.skipif("cuda" not in BACKENDS, reason="needs an NVIDIA GPU with CuPy")
def test_timeline_records_every_kiln_kernel_of_a_replay_in_order(tmp_path) -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "KILN_CUDA_TIMELINE": "1",
           "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=600,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    count, names = done.stdout.splitlines()[0].split(" ", 1)
    assert int(count) > 10 and "gemv" in names, done.stdout
    assert "kernels recorded" in done.stdout.splitlines()[1], done.stdout

