"""The CPU backend's large constants in huge pages (backends/cpu/resident.py): the same values as the file's, read
only, held once per program, in a mapping advised for huge pages; off with KILN_HUGE_PAGES=0."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import kiln
from kiln.runtime.backends.cpu import resident


class TwoLinears(nn.Module):
    """A 512 KiB weight (held resident) and a 4 KiB one (left a view of the file)."""

    def __init__(self):
        super().__init__()
        self.big = nn.Linear(256, 512)
        self.small = nn.Linear(512, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(torch.relu(self.big(x)))


@pytest.fixture(scope="module")
def program_file(tmp_path_factory) -> str:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("resident") / "two.kiln"
    kiln.export(TwoLinears().eval(), (torch.randn(3, 256),)).save(path)
    return str(path)


@pytest.fixture
def huge_pages(monkeypatch):
    """huge_pages_available() re-read under the test's environment, and again after it."""
    resident.huge_pages_available.cache_clear()
    yield monkeypatch
    resident.huge_pages_available.cache_clear()


def constant_indices(program: kiln.Program) -> tuple[int, int]:
    sizes = [program.ir.blobs[c.blob].nbytes for c in program.ir.constants]
    return sizes.index(max(sizes)), sizes.index(2 * 512 * 4)


def vm_flags(address: int) -> str:
    """The VmFlags line of the mapping holding address (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(part, 16) for part in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("source", ["path", "bytes"])
def test_resident_copy_has_the_file_values_and_is_read_only(program_file, source):
    program = kiln.load(program_file if source == "path" else open(program_file, "rb").read())
    big, small = constant_indices(program)
    held = resident.ResidentConstants(program)
    array = held.constant(big)
    view = program.constant(big)
    np.testing.assert_array_equal(array, view)
    assert array.dtype == view.dtype and array.shape == view.shape
    assert not np.shares_memory(array, view)
    assert not array.flags.writeable
    assert array.ctypes.data % 64 == 0
    assert held.constant(big) is array
    assert held.constant(small) is program.constant(small)  # under MIN_BYTES: the file's own view


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")
def test_resident_mapping_is_advised_for_huge_pages(program_file, huge_pages):
    program = kiln.load(program_file)
    big, _ = constant_indices(program)
    array = resident.ResidentConstants(program).constant(big)
    assert " hg" in vm_flags(array.ctypes.data)


def test_sessions_give_the_same_outputs_with_and_without(program_file, huge_pages):
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    outputs = {}
    for setting in ("0", "1"):
        huge_pages.setenv("KILN_HUGE_PAGES", setting)
        resident.huge_pages_available.cache_clear()
        program = kiln.load(program_file)
        outputs[setting] = program.session("cpu").run("forward", x)[0]
        held = program.backend_cache.get(resident.CACHE_KEY)
        if setting == "0":
            assert held is None
        elif resident.huge_pages_available():
            assert isinstance(held, resident.ResidentConstants) and held.filled
    np.testing.assert_array_equal(outputs["0"], outputs["1"])
