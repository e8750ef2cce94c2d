"""The CUDA kernel sources, read as text (no GPU needed): every kernel is launched early (launch.py), so each must
call grid_dependency_sync in every block before it reads or writes what an earlier kernel may touch. A kernel that
returned before the call, or made it only on some path, would let the kernels after it read unfinished results."""

from __future__ import annotations

import re
from importlib import resources

import pytest

SOURCES = resources.files("kiln.runtime.backends.cuda").joinpath("kernels")  # (the kernels package needs CuPy)
KERNEL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(")


def _bodies(source: str) -> dict[str, str]:
    """Each __global__ kernel's body, by name."""
    bodies = {}
    for match in KERNEL.finditer(source):
        start = source.index("{", source.index(")", match.end()))  # (no parameter holds a brace)
        depth, i = 0, start
        while True:
            depth += {"{": 1, "}": -1}.get(source[i], 0)
            if depth == 0:
                break
            i += 1
        bodies[match.group(1)] = source[start + 1:i]
    return bodies


def _kernels() -> list[tuple[str, str, str]]:
    found = []
    for file in sorted(f.name for f in SOURCES.iterdir() if f.name.endswith(".cu")):
        found += [(file, name, body) for name, body in _bodies(SOURCES.joinpath(file).read_text()).items()]
    return found


def test_every_source_has_kernels() -> None:
    names = {name for _, name, _ in _kernels()}
    assert {"gemv", "attend_chunk", "attend_combine", "rope_cache_update", "flash_attention"} <= names


@pytest.mark.parametrize("file,name,body", _kernels(), ids=lambda v: v if len(v) < 40 else "")
def test_kernel_waits_for_the_kernel_before_it(file: str, name: str, body: str) -> None:
    call = body.find("grid_dependency_sync();")
    assert call >= 0, f"{file}: {name} never calls grid_dependency_sync"
    before = body[:call]
    assert "return" not in before, f"{file}: {name} may return before grid_dependency_sync"
    assert before.count("{") == before.count("}"), f"{file}: {name} calls grid_dependency_sync inside a block"
