"""kiln's cache of compiled CUDA modules (module_cache.py), without a GPU: what keys a module, that a stored module
comes back with its instances' C++ names, and that a damaged or partial entry is compiled again, not loaded."""

from __future__ import annotations

import json

import pytest

from kiln.runtime.backends.cuda import module_cache
from kiln.runtime.cache_dir import cache_dir

NAMES = {"qgemv_dot<BF16, 141>": "_Z9qgemv_dotI4BF16Li141EEvPKtS2_", "rms_norm<F32>": "_Z8rms_normI3F32EvPKf"}


def test_the_key_changes_with_everything_that_changes_the_binary() -> None:
    base = ("source", ("--std=c++17",), ["k<F32>"], "sm90 nvrtc(13, 0) cupy14.2.0")
    first = module_cache.key(*base)
    assert module_cache.key(*base) == first
    for changed in (("source ", *base[1:]), (base[0], ("--std=c++17", "-DKILN_TIMELINE"), *base[2:]),
                    (*base[:2], ["k<F32>", "k<BF16>"], base[3]), (*base[:3], "sm80 nvrtc(13, 0) cupy14.2.0")):
        assert module_cache.key(*changed) != first


def test_a_stored_module_comes_back_with_its_names(tmp_path) -> None:
    folder = tmp_path / "cuda"
    assert module_cache.stored(folder, "quant", "k1") is None
    path = module_cache.store(folder, "quant", "k1", b"\x7fELF cubin bytes", NAMES)
    assert path is not None and path.read_bytes() == b"\x7fELF cubin bytes"
    assert module_cache.stored(folder, "quant", "k1") == (path, NAMES)
    assert module_cache.stored(folder, "quant", "k2") is None and module_cache.stored(folder, "gemv", "k1") is None
    assert sorted(p.name for p in folder.iterdir()) == ["quant-k1.cubin", "quant-k1.json"]  # (no temporary left)


@pytest.mark.parametrize("damage", ["binary changed", "binary missing", "record missing", "record not JSON",
                                    "record without names"])
def test_a_damaged_entry_is_compiled_again(tmp_path, damage) -> None:
    path = module_cache.store(tmp_path, "quant", "k1", b"cubin", NAMES)
    record = path.with_suffix(".json")
    if damage == "binary changed":
        path.write_bytes(b"cubiN")
    elif damage == "binary missing":
        path.unlink()
    elif damage == "record missing":
        record.unlink()
    elif damage == "record not JSON":
        record.write_text("{")
    else:
        record.write_text(json.dumps({"sha256": json.loads(record.read_text())["sha256"]}))
    assert module_cache.stored(tmp_path, "quant", "k1") is None


def test_a_folder_that_cannot_be_written_leaves_the_module_to_this_process(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert module_cache.store(blocker / "cuda", "quant", "k1", b"cubin", NAMES) is None


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir("cuda") == tmp_path / "mine" / "cuda"
    monkeypatch.delenv("KILN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir("native") == tmp_path / "xdg" / "kiln" / "native"


@pytest.mark.cuda
def test_a_source_compiled_once_is_loaded_from_the_cache_and_runs(monkeypatch, tmp_path) -> None:
    """On the GPU: fused.cu compiled into an empty cache folder, then loaded from it without NVRTC, its rms_norm
    launched from the loaded module."""
    from tests.conftest import BACKENDS

    if "cuda" not in BACKENDS:
        pytest.skip("needs an NVIDIA GPU with CuPy")
    import cupy as cp
    import numpy as np
    from cupy.cuda import compiler

    from kiln.runtime.backends.cuda import nvrtc, sources

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    source = sources.read("fused")
    expressions = sources.instances(source, "fused")
    first = nvrtc._cached_module("fused", source, nvrtc.OPTIONS, expressions)
    assert first is not None and set(first.names) == set(expressions)
    assert len(list((tmp_path / "cuda").iterdir())) == 2
    monkeypatch.setattr(compiler, "compile_using_nvrtc", lambda *a, **kw: pytest.fail("compiled again"))
    second = nvrtc._cached_module("fused", source, nvrtc.OPTIONS, expressions)
    assert second is not None and second.names == first.names
    kernel = second.get_function("rms_norm<F32>")
    assert isinstance(kernel, cp.RawKernel) and kernel.num_regs > 0
    x = cp.full((1, 64), 2.0, dtype=cp.float32)
    y = cp.empty_like(x)
    kernel((1,), (64,), (x, x, x, x, y, np.int32(64), np.float32(0.0), np.int32(0), np.int32(0)))
    np.testing.assert_allclose(cp.asnumpy(y), 1.0, rtol=1e-6)


@pytest.mark.cuda
def test_a_module_the_cache_cannot_keep_is_compiled_once_and_runs(monkeypatch, tmp_path) -> None:
    """On the GPU: where the cache cannot store the binary, the process loads the binary it compiled (from a
    temporary file) rather than compiling the source a second time through RawModule."""
    from tests.conftest import BACKENDS

    if "cuda" not in BACKENDS:
        pytest.skip("needs an NVIDIA GPU with CuPy")
    import cupy as cp
    import numpy as np
    from cupy.cuda import compiler

    from kiln.runtime.backends.cuda import nvrtc, sources

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(module_cache, "store", lambda *a, **kw: None)
    compiles = []
    real = compiler.compile_using_nvrtc
    monkeypatch.setattr(compiler, "compile_using_nvrtc", lambda *a, **kw: compiles.append(1) or real(*a, **kw))
    source = sources.read("fused")
    loaded = nvrtc._cached_module("fused", source, nvrtc.OPTIONS, sources.instances(source, "fused"))
    assert loaded is not None and len(compiles) == 1
    x = cp.full((1, 64), 2.0, dtype=cp.float32)
    y = cp.empty_like(x)
    loaded.get_function("rms_norm<F32>")((1,), (64,), (x, x, x, x, y, np.int32(64), np.float32(0.0), np.int32(0),
                                                        np.int32(0)))
    np.testing.assert_allclose(cp.asnumpy(y), 1.0, rtol=1e-6)
