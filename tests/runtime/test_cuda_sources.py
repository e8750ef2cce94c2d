"""The CUDA kernel sources, read as text (no GPU needed): every kernel is launched early (launch.py), so each must
call grid_dependency_sync in every block before it reads or writes what an earlier kernel may touch. A kernel that
returned before the call, or made it only on some path, would let the kernels after it read unfinished results."""

from __future__ import annotations

import re

import pytest

from kiln.runtime.backends.cuda import sources

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
    return [(f"{source}.cu", name, body) for source in sources.names()
            for name, body in _bodies(sources.read(source)).items()]


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


@pytest.mark.parametrize("name", sources.names())
def test_every_kernel_is_instantiated(name: str) -> None:
    """nvrtc.py compiles the instances sources.instances lists: a __global__ kernel its pattern misses (a comment
    between the launch bounds and the name, say) is never compiled, and one without its `<N>:` line fails to load,
    both found only on a GPU but for this test."""
    text = sources.read(name)
    kernels, templates = sources.kernel_count(text)
    assert kernels == templates, f"{name}.cu: {kernels - templates} __global__ kernel(s) that no instance names"
    expressions = sources.instances(text, name)
    assert len(expressions) == len(set(expressions)), f"{name}.cu declares an instance twice"
    assert {e.split("<")[0] for e in expressions} == {n for _, n in sources.TEMPLATE.findall(text)}


def test_a_sized_kernel_without_its_list_is_an_error() -> None:
    text = "template <class S, int N>\n__global__ void kernel_a(int x) {}\n"
    with pytest.raises(ValueError, match="kernel_a"):
        sources.instances(text, "made_up")
    listed = sources.instances(text + "// kernel_a<N>: 1 2\n// kernel_a<N>: 4\n// kernel_a<S>: BF16\n", "made_up")
    assert listed == ["kernel_a<BF16, 1>", "kernel_a<BF16, 2>", "kernel_a<BF16, 4>"]


def _cuda_check():
    """scripts/cuda_check.py as a module (scripts/ is not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "cuda_check.py"
    spec = importlib.util.spec_from_file_location("cuda_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_compile_check_reads_ptxas_and_names_every_instance() -> None:
    """scripts/cuda_check.py's parts that need no nvcc: ptxas's report read per entry (spills counted only where
    ptxas reports them), and the translation unit naming each instance nvrtc.py compiles."""
    check = _cuda_check()
    log = ("ptxas info    : Compiling entry function '_Z1aI4BF16EEvv' for 'sm_90'\n"
           "ptxas info    : Function properties for _Z1aI4BF16EEvv\n"
           "    8 bytes stack frame, 12 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 80 registers, used 1 barriers\n"
           "ptxas info    : Compiling entry function '_Z1bI3F32EEvv' for 'sm_90'\n"
           "ptxas info    : Function properties for _Z1bI3F32EEvv\n"
           "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 32 registers\n")
    assert check.ptxas_report(log) == [("_Z1aI4BF16EEvv", 80, 16), ("_Z1bI3F32EEvv", 32, 0)]
    unit = check.translation_unit("fused")
    expressions = sources.instances(sources.read("fused"), "fused")
    assert expressions and all(f"(void*)&{e};" in unit for e in expressions)
