"""benchmarks/serve_load.py's accounting of the server's processes, on the CPU: it finds a spawned child beside
multiprocessing's resource tracker, and charges each process the CPU it used (Linux /proc)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

PARENT = """
import multiprocessing, os, sys, time

def busy(parent):
    end = time.time() + 30
    while time.time() < end and os.getppid() == parent:  # ends with its parent
        pass

if __name__ == "__main__":
    multiprocessing.get_context("spawn").Process(target=busy, args=(os.getpid(),), daemon=True).start()
    print("ready", flush=True)
    sys.stdin.readline()
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux /proc")
def test_server_processes_finds_the_spawned_engine_and_charges_its_cpu(tmp_path) -> None:
    sys.path.insert(0, str(BENCHMARKS))
    from serve_load import process_cpu_seconds, server_processes

    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert parent.stdout.readline().strip() == "ready"
        deadline = time.time() + 20
        while "engine" not in (found := server_processes(parent.pid)) and time.time() < deadline:
            time.sleep(0.05)
        assert found["http"] == parent.pid and found["engine"] != parent.pid
        before = {name: process_cpu_seconds(pid) for name, pid in found.items()}
        time.sleep(0.6)
        used = {name: process_cpu_seconds(pid) - before[name] for name, pid in found.items()}
        assert used["engine"] > 0.2  # the busy child, on a core of its own or shared
        assert used["http"] < used["engine"]  # the parent waits on its stdin
    finally:
        parent.kill()
        parent.wait(10)
    assert process_cpu_seconds(parent.pid) != process_cpu_seconds(parent.pid)  # gone: NaN
