"""benchmarks/gpu_ab.py, the A/B of source trees, on the CPU: a stand-in benchmark reports the time its variant's
kiln package declares, so the table shows which tree each run imported. No GPU and no timing involved."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

AB = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_ab.py"

STAND_IN = textwrap.dedent("""
    import json, sys
    import kiln
    args = sys.argv[1:]
    assert "--no-compile" in args and "--prefill" in args
    if kiln.SECONDS is None:
        raise SystemExit(3)
    cases = {"decode at 128": {"medians": {"kiln cuda": kiln.SECONDS, "torch eager": 1.0}, "roofline": 0.5e-3},
             "prefill 128 tokens": {"medians": {"kiln cuda": 2 * kiln.SECONDS}, "roofline": None}}
    open(args[args.index("--json") + 1], "w").write(json.dumps(cases))
""")


def _variant(root: Path, name: str, seconds: float | None) -> str:
    package = root / name / "kiln"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"SECONDS = {seconds!r}\n")
    return f"{name}={package.parent}"


def _ab(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    return subprocess.run([sys.executable, str(AB), *args, "--script", str(script), "--", "--prefill", "128"],
                          capture_output=True, text=True, timeout=60)


def test_each_run_imports_its_variant_and_the_table_compares_medians(tmp_path) -> None:
    result = _ab(tmp_path, _variant(tmp_path, "main", 1.0e-3), _variant(tmp_path, "new", 0.8e-3), "--rounds", "3",
                 "--markdown")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "median against main's" in lines[0]
    assert lines[1].split("|")[1:-1] == [" case ", " main ms ", " new ms ", " new/main ", " main % roofline ",
                                         " new % roofline "]
    decode = next(line for line in lines if line.startswith("| decode at 128"))
    assert [c.strip() for c in decode.split("|")[1:-1]] == [
        "decode at 128", "1.000, 1.000, 1.000 (1.000)", "0.800, 0.800, 0.800 (0.800)", "0.800", "50%", "62%"]
    prefill = next(line for line in lines if line.startswith("| prefill 128"))
    assert prefill.split("|")[-3:-1] == [" - ", " - "]
    assert result.stderr.count("run ") >= 6 and "run 6/6: new (round 3)" in result.stderr


def test_a_failing_run_stops_the_ab_with_its_exit_status(tmp_path) -> None:
    result = _ab(tmp_path, _variant(tmp_path, "main", 1.0e-3), _variant(tmp_path, "broken", None))
    assert result.returncode == 3
    assert "broken: stand_in.py exited with 3" in result.stderr


@pytest.mark.parametrize("specs,message", [
    (["main"], "a variant is NAME=SRC"),
    (["main=."], "holds no kiln package"),
])
def test_variants_are_checked_before_anything_runs(tmp_path, specs, message) -> None:
    result = _ab(tmp_path, *specs)
    assert result.returncode == 2 and message in result.stderr


def test_one_variant_is_not_an_ab(tmp_path) -> None:
    result = _ab(tmp_path, _variant(tmp_path, "main", 1.0e-3))
    assert result.returncode == 2 and "at least two variants" in result.stderr


def test_gpu_llm_writes_the_results_gpu_ab_reads(tmp_path, monkeypatch) -> None:
    """gpu_llm.py's --json file, from rows as it builds them, read back into gpu_ab.py's table."""
    monkeypatch.syspath_prepend(str(AB.parent))
    import gpu_ab
    import gpu_llm

    rows = [("prefill 128 tokens", {"kiln cuda": 2.4e-3, "torch eager": 1.4e-2}, None, "130 TFLOP/s"),
            ("decode at 128", {"kiln cuda": 1.2e-3, "torch eager": 1.2e-2}, 0.84e-3, "850 tok/s")]
    gpu_llm.write_results(tmp_path / "r.json", rows)
    run = json.loads((tmp_path / "r.json").read_text())
    header, body = gpu_ab.ab_table({"a": [run], "b": [run]})
    assert body == [["prefill 128 tokens", "2.400", "2.400", "1.000", "-", "-"],
                    ["decode at 128", "1.200", "1.200", "1.000", "70%", "70%"]]


def test_quantized_kernel_names_and_their_variants(monkeypatch) -> None:
    """gpu_harness.quant_kernel_choice: a kernel name with variant suffixes in any order, the defaults for "", and a
    clear error for a name it does not know."""
    monkeypatch.syspath_prepend(str(AB.parent))
    from gpu_harness import quant_kernel_choice, variant_suffixes

    default = {"QGEMV": "staged", "QUANT_DOT": None, "QGEMV_GATED": True, "QDOT_INTERLEAVED": None,
               "QDOT_WAVE_ROWS": True, "QGEMM": True, "GEMM_ROWS_PACKED": True,
               "GEMM_ROWS_STAGES": None, "GEMM_ROWS_TWO_TILES": False, "ADD_RMS_NORM_ROW": True,
               "DECODE_MMA": True, "DECODE_PREFETCH_VISIBLE": True}
    assert quant_kernel_choice("") == default
    assert quant_kernel_choice("dot") == {**default, "QUANT_DOT": True}
    both = {**default, "QUANT_DOT": True, "QDOT_INTERLEAVED": True, "ADD_RMS_NORM_ROW": False}
    assert quant_kernel_choice("dot-interleaved-fusednorm") == quant_kernel_choice("dot-fusednorm-interleaved") == both
    assert quant_kernel_choice("dot-stagefirst") == {**default, "QUANT_DOT": True, "QDOT_INTERLEAVED": False}
    assert quant_kernel_choice("dot-onerow")["QDOT_WAVE_ROWS"] is False
    assert quant_kernel_choice("dot-dequant")["QGEMM"] is False
    assert quant_kernel_choice("dot-unpacked")["GEMM_ROWS_PACKED"] is False
    assert quant_kernel_choice("dot-ring3-unpacked")["GEMM_ROWS_STAGES"] == 3
    assert quant_kernel_choice("dot-ring4")["GEMM_ROWS_STAGES"] == 4
    assert quant_kernel_choice("dot-twotiles-ring3")["GEMM_ROWS_TWO_TILES"] is True
    assert quant_kernel_choice("dot-prefetchall")["DECODE_PREFETCH_VISIBLE"] is False
    assert quant_kernel_choice("dot-chunk")["DECODE_MMA"] is quant_kernel_choice("-chunk")["DECODE_MMA"] is False
    assert quant_kernel_choice("staged-apart") == {**default, "QUANT_DOT": False, "QGEMV_GATED": False}
    assert [variant_suffixes(n) for n in ("dot", "dot-chunk", "staged-apart-chunk", "")] == \
        ["", "-chunk", "-apart-chunk", ""]
    with pytest.raises(ValueError, match="no quantized kernel 'dott'"):
        quant_kernel_choice("dott-apart")
