"""The mlx backend beyond op-for-op parity (tests/ops and tests/models run every op and model on it): a clear
error without MLX; arrays in and out; constants converted once per program; each method compiled per input-shape
signature, bounded, with a way out; the KV cache updated without a copy; kiln's quantized weights and rotary tables
mapped onto MLX's own formats and fused RoPE, exactly as the definitions say."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import kiln
from kiln.runtime.llm.decoding import greedy_generate

REPO = Path(__file__).resolve().parents[2]
HAS_MLX = importlib.util.find_spec("mlx") is not None
needs_mlx = pytest.mark.skipif(not HAS_MLX, reason="needs MLX (pip install 'mlx[cpu]')")
PROMPT = [11, 13, 6, 40, 41, 42, 43, 44, 45, 46, 47]

NO_MLX = """
import sys
sys.modules["mlx"] = None  # any `import mlx...` now raises ImportError
import kiln
try:
    kiln.load(sys.argv[1]).session("mlx")
except kiln.BackendUnavailableError as e:
    print(e)
"""


def test_without_mlx_the_error_says_what_to_install(tmp_path):
    path = kiln.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),)).save(tmp_path / "linear.kiln")
    result = subprocess.run([sys.executable, "-c", NO_MLX, str(path)], capture_output=True, text=True, timeout=120,
                            cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    want = "pip install mlx" if sys.platform == "darwin" else 'pip install "mlx[cpu]"'
    assert "the mlx backend needs MLX" in result.stdout and want in result.stdout


@pytest.fixture(scope="module")
def llama_program():
    from kiln.models.llm import export_llm
    from kiln.models.zoo import tiny_decoder

    return export_llm(tiny_decoder("llama"), max_context=48, prefill_chunk=8).load()


@needs_mlx
def test_llm_runs_like_the_cpu_with_numpy_or_mlx_arrays(llama_program):
    import mlx.core as mx

    cpu = greedy_generate(llama_program.session("cpu"), PROMPT, 24)
    session = llama_program.session("mlx")
    assert greedy_generate(session, PROMPT, 24) == cpu
    logits = session.run("decode", np.array([[5]]), np.array([35]))[0]
    assert isinstance(logits, mx.array)
    again = session.run("decode", mx.array([[5]], dtype=mx.int64), mx.array([35], dtype=mx.int64))[0]
    np.testing.assert_allclose(session.backend.to_numpy(again), session.backend.to_numpy(logits), rtol=1e-6,
                               atol=1e-6)
    with pytest.raises(kiln.InputError, match="expected dtype int64"):
        session.run("decode", mx.array([[5]], dtype=mx.int32), mx.array([35]))


@needs_mlx
def test_constants_are_converted_once_per_program(llama_program):
    first, second = llama_program.session("mlx"), llama_program.session("mlx")
    assert first.backend.constant(0) is second.backend.constant(0)


@needs_mlx
def test_methods_are_compiled_per_signature_and_bounded(llama_program, monkeypatch):
    import kiln.runtime.session as session_module
    from kiln.runtime.graphs import Compiled

    compiled = llama_program.session("mlx")
    assert compiled.graphs, "compiling is the default"
    op_by_op = llama_program.session("mlx", graphs=False)
    want = greedy_generate(op_by_op, PROMPT, 24)
    assert greedy_generate(compiled, PROMPT, 24) == want
    assert compiled.captured_graphs == {"decode": 1} and not op_by_op.captured_graphs
    (plan,) = compiled._plans["decode"].values()
    assert isinstance(plan.replay, Compiled) and plan.replay.calls == 23  # 24 decode steps, the first op by op

    monkeypatch.setattr(session_module, "MAX_GRAPHS_PER_METHOD", 2)
    session = llama_program.session("mlx")
    for length in (2, 3, 4, 2):
        for _ in range(3):
            session.run("prefill", np.arange(length)[None] + 5, np.arange(length))
    assert [dict(key)["seq"] for key in session._graphed["prefill"]] == [4, 2]


@needs_mlx
def test_a_method_that_cannot_compile_runs_op_by_op(llama_program, monkeypatch, caplog):
    """A kernel that reads a value back to the host cannot be traced: the method runs op by op, correctly."""
    from kiln.runtime.backends.mlx.kernels import MLX_KERNELS

    want = greedy_generate(llama_program.session("mlx", graphs=False), PROMPT, 6)
    rms_norm = MLX_KERNELS.kernels["rms_norm"]

    def reads_back(x, *args, **attrs):
        assert float(x.reshape(-1)[0].item()) == float(x.reshape(-1)[0].item())
        return rms_norm(x, *args, **attrs)

    monkeypatch.setitem(MLX_KERNELS.kernels, "rms_norm", reads_back)
    session = llama_program.session("mlx")
    assert greedy_generate(session, PROMPT, 6) == want
    assert "compiling it failed" in caplog.text
    assert all(plan.replay is False for plan in session._plans["decode"].values())


class CacheStep(torch.nn.Module):
    """A 16 MiB state buffer written at one position per call, in place (the shape of a KV-cache update)."""

    SLOTS = 4096

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, 8, self.SLOTS, 128))

    def forward(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(2, position, x)
        return self.cache[:, :, :4].sum()


@needs_mlx
@pytest.mark.parametrize("graphs", [True, False], ids=["compiled", "op_by_op"])
def test_a_state_update_in_place_does_not_copy_the_buffer(graphs):
    import mlx.core as mx

    program = kiln.export(CacheStep(), (torch.ones(1, 8, 1, 128), torch.tensor([0]))).load()
    update = [n for n in program.ir.methods["forward"].nodes if n.op == "index_put"]
    assert update and update[0].attrs["in_place"], "the exporter marks the write in place"
    session = program.session("mlx", graphs=graphs)
    cache_bytes = 8 * CacheStep.SLOTS * 128 * 4
    for step in range(6):
        x = np.full((1, 8, 1, 128), step + 1, np.float32)
        mx.eval(session.state)
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        out = session.run("forward", x, np.array([step]))[0]
        mx.eval(out, session.state)
        grown = mx.get_peak_memory() - before
        assert grown < cache_bytes / 4, f"step {step}: peak memory grew by {grown} bytes, a copy of the cache"
    cache = session.backend.to_numpy(session.state[0])
    written = np.arange(1, 7, dtype=np.float32)[None, :, None]
    assert np.all(cache[0, :, :6, :] == written) and not cache[..., 6:, :].any()


@needs_mlx
@pytest.mark.parametrize("bits,group_size,symmetric,k", [
    (4, 32, False, 64), (4, 64, True, 128), (4, 256, False, 512), (8, 96, False, 96), (8, 64, True, 128),
    (8, 192, False, 192)], ids=["int4_g32", "int4_g64_sym", "int4_g256", "int8_channel", "int8_g64_sym",
                                "int8_channel_192"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_quantized_weights_convert_exactly_to_mlx_format(bits, group_size, symmetric, k, dtype):
    import mlx.core as mx

    from kiln.export.quantize import quantize_rows
    from kiln.runtime.backends.array_api.quant import dequantize
    from kiln.runtime.backends.mlx.quantized import convert

    w = np.random.default_rng(bits * 1000 + group_size).standard_normal((16, k)) * 0.05
    q, scale, zero = quantize_rows(w, bits, group_size, symmetric)
    scale, zero = scale.astype(dtype), None if zero is None else zero.astype(dtype)
    packed, scales, biases, size = convert(q, scale, zero, bits, group_size)
    assert size in (32, 64, 128) and group_size % size == 0 and packed.dtype == np.uint32
    want = dequantize(np, q, scale, zero, bits, group_size)  # kiln's definition, float32
    got = np.array(mx.dequantize(mx.array(packed), mx.array(scales), mx.array(biases), group_size=size,
                                 bits=bits).astype(mx.float32))
    # q_u * scale + bias rounds the product, the bias and the sum once each, in the scale's type
    eps = float(np.finfo(dtype).eps)
    unsigned = np.abs(want) + np.abs(np.repeat(biases.astype(np.float64), size, axis=1))
    np.testing.assert_array_less(np.abs(got - want), 2 * eps * unsigned + 1e-30)


def _quantized_on_mlx_and_cpu(family: str, mode: str, monkeypatch):
    """(program, mlx session) of a tiny `family` decoder quantized in groups of 32, whose prefill and decode logits
    on MLX were checked against the CPU's float path (KILN_QUANT_DOT=float)."""
    from kiln.export import Quantize
    from kiln.models.llm import export_llm
    from kiln.models.zoo import tiny_decoder

    program = export_llm(tiny_decoder(family), max_context=48, prefill_chunk=8,
                         quantize=Quantize(mode, group_size=32)).load()
    session = program.session("mlx", graphs=False)
    monkeypatch.setenv("KILN_QUANT_DOT", "float")
    cpu = program.session("cpu")
    for method, args in (("prefill", (np.array([PROMPT[:8]]), np.arange(8))), ("decode", (np.array([[7]]), [8]))):
        got = session.backend.to_numpy(session.run(method, *args)[0])
        np.testing.assert_allclose(got, cpu.run(method, *args)[0], rtol=1e-4, atol=1e-4)
    return program, session


@needs_mlx
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_programs_run_on_mlx_quantized_kernels(llama_program, mode, monkeypatch):
    """Against the CPU's float path (KILN_QUANT_DOT=float): its default rounds decode inputs to int8 (qdot.c), ~2%
    on this 32-wide model's logits, which is the CPU's choice, not the op's meaning."""
    _, session = _quantized_on_mlx_and_cpu("llama", mode, monkeypatch)
    kinds = {step.node.op: step.kernel.__qualname__ for plan in session._plans["decode"].values()
             for step in plan.steps if step.node.op.startswith("quantized")}
    assert kinds == {"quantized_linear": "linear_kernel.<locals>.quantized_linear",
                     "quantized_embedding": "embedding_kernel.<locals>.quantized_embedding"}


@needs_mlx
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_experts_run_on_gather_qmm(mode, monkeypatch):
    """A MoE program's quantized expert stacks are converted once and read by mx.gather_qmm (prefill's rows and a
    decode step's) where MLX has a group size for their rows, equal to the CPU's float path."""
    program, session = _quantized_on_mlx_and_cpu("qwen3_moe", mode, monkeypatch)
    kinds = {program.ir.methods["decode"].values[step.node.inputs[0]].shape[-1]: step.kernel.__qualname__
             for plan in session._plans["decode"].values() for step in plan.steps
             if step.node.op == "gathered_quantized_linear"}
    # gate/up's rows (K = 32) on gather_qmm; down's rows of K = 16 fit no MLX group: the composed kernel
    assert kinds == {32: "gathered_kernel.<locals>.gathered_quantized_linear", 16: "gathered_quantized_linear"}


@needs_mlx
def test_weights_mlx_has_no_group_for_keep_kiln_kernels():
    """Rows of 40 fit no MLX group (32, 64, 128): the composed kernel runs them, as exactly."""
    model = torch.nn.Sequential(torch.nn.Linear(40, 24), torch.nn.ReLU())
    x = torch.randn(3, 40)
    program = kiln.export(model, (x,), quantize=kiln.export.Quantize("int8")).load()
    session = program.session("mlx", graphs=False)
    got = session.backend.to_numpy(session.run("forward", x.numpy())[0])
    np.testing.assert_allclose(got, program.session("cpu").run("forward", x.numpy())[0], rtol=1e-5, atol=1e-5)
    (plan,) = session._plans["forward"].values()
    (step,) = [s for s in plan.steps if s.node.op == "quantized_linear"]
    assert step.kernel.__module__.endswith("kernels.quant")


def _rotary_tables(scaling: dict | None = None, factor: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=512, rope_scaling=scaling)
    rotary = LlamaRotaryEmbedding(config)
    cos, sin = rotary(torch.zeros(()), torch.arange(512)[None])
    return cos[0].numpy() * factor, sin[0].numpy() * factor, rotary.inv_freq.numpy()


@needs_mlx
@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}],
                         ids=["default", "llama3"])
def test_rotary_tables_give_back_their_frequencies(scaling):
    from kiln.runtime.backends.mlx.rope import frequencies

    cos, sin, inv_freq = _rotary_tables(scaling)
    np.testing.assert_allclose(frequencies(cos, sin, interleaved=False), inv_freq, rtol=1e-6)
    assert frequencies(cos, sin, interleaved=True) is None, "the halves layout is not the interleaved one"
    scaled = _rotary_tables(scaling, factor=1.1)  # an attention factor (YaRN): not cos/sin of an angle
    assert frequencies(scaled[0], scaled[1], interleaved=False) is None


@needs_mlx
def test_llm_rope_runs_on_fast_rope_from_the_positions(llama_program):
    session = llama_program.session("mlx", graphs=False)
    session.run("prefill", np.array([PROMPT[:8]]), np.arange(8))
    (plan,) = session._plans["prefill"].values()
    steps = [s for s in plan.steps if s.node.op == "rope_cache_update"]
    assert steps and all(s.kernel.__qualname__.startswith("rope_cache_update_kernel") for s in steps)
    positions = {s.inputs[-1] for s in steps}
    assert len(positions) == 1 and positions.isdisjoint(steps[0].node.inputs), "an extra input: the positions"
    assert not any(positions & set(s.free) for s in plan.steps[:plan.steps.index(steps[-1])]), "kept until read"


@needs_mlx
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64", "int64", "uint8", "bool"])
def test_arrays_cross_between_numpy_and_mlx_exactly(dtype):
    import ml_dtypes

    from kiln.runtime.backends.mlx.arrays import to_mlx, to_numpy

    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    values = (np.random.default_rng(0).standard_normal((3, 5)) * 100).astype(np_dtype)
    for x in (values, values.T, values[0, 0]):  # contiguous, strided, 0-d
        back = to_numpy(to_mlx(x))
        assert back.dtype == x.dtype and back.shape == x.shape
        np.testing.assert_array_equal(back, x)


def test_visible_key_buckets():
    from kiln.runtime.backends.mlx.visible import bucket

    assert [bucket(n, 4096) for n in (1, 64, 65, 96, 97, 129, 193, 257, 385, 513, 769, 1025)] == \
        [64, 64, 96, 96, 128, 192, 256, 384, 512, 768, 1024, 1536]
    assert bucket(300, 320) == 320 and bucket(10, 48) == 48


@needs_mlx
def test_decode_attends_over_the_keys_its_position_sees():
    """A 256-slot cache: each decode step's plan is specialized to the bucket of keys its position needs (a hint
    computed on the host from the mask's inputs), its attention reads only those, and the logits stay the CPU's."""
    import mlx.core as mx

    from kiln.models.llm import export_llm
    from kiln.models.zoo import tiny_decoder
    from kiln.runtime.backends.mlx import visible

    program = export_llm(tiny_decoder("llama"), max_context=256, prefill_chunk=8).load()
    session, cpu = program.session("mlx"), program.session("cpu")
    for s in (session, cpu):
        for lo in range(0, 200, 8):  # the cache filled with 200 positions
            s.run("prefill", np.arange(lo, lo + 8)[None] % 100 + 5, np.arange(lo, lo + 8))
    decode = program.method("decode")
    buckets = []
    for position in (10, 63, 64, 70, 100, 199, 250):
        want = cpu.run("decode", np.array([[9]]), np.array([position]))[0]
        for _ in range(3):  # op by op, then compiled
            got = session.run("decode", np.array([[9]]), np.array([position]))[0]
            np.testing.assert_allclose(session.backend.to_numpy(got), want, rtol=1e-5, atol=1e-5)
        hints = session.backend.plan_hints(decode, [mx.array([[9]]), mx.array([position])], {})
        assert any(n.startswith(visible.EVERY_ROW_HINT) for n in hints)
        buckets.append([v for n, v in hints.items() if n.startswith(visible.HINT)])
    assert buckets == [[64], [64], [96], [96], [128], [], []]  # the key count is position + 1
    # (prefill's chunks saw 64, 96, 128, 192 and all 256 keys: the last only once, so it was not compiled)
    assert len(session._plans["decode"]) == 4 and session.captured_graphs == {"prefill": 4, "decode": 4}
    for key, plan in session._plans["decode"].items():
        narrowed = any(n.startswith(visible.HINT) for n in dict(key))
        kernels = {s.kernel.__qualname__.split(".")[0] for s in plan.steps if s.node.op == "sdpa"}
        assert kernels == {"narrowed_sdpa"}, kernels  # (every row sees a key: no NaN guard either way)
        assert narrowed or all(n.startswith(visible.EVERY_ROW_HINT) for n in dict(key))


@needs_mlx
def test_slotted_decode_gathers_the_keys_its_positions_reach():
    """A slotted program's slot_attention reads the bucket of keys the batch's furthest position needs (a hint
    from its positions input), and the logits stay the CPU's."""
    import mlx.core as mx

    from kiln.models.llm import export_llm
    from kiln.models.zoo import tiny_decoder
    from kiln.runtime.backends.mlx import visible
    from kiln.runtime.llm.decoding import decode_batch, prefill

    program = export_llm(tiny_decoder("llama"), max_context=256, prefill_chunk=8, slots=3).load()
    session, cpu = program.session("mlx"), program.session("cpu")
    for s in (session, cpu):
        prefill(s, list(range(5, 105)), 0, 2)
        prefill(s, list(range(7, 17)), 0, 0)
    decode = program.method("decode")
    for positions, keys in (([10, 100], 128), ([10, 12], 64), ([200, 10], None)):
        want = decode_batch(cpu, [9, 4], positions, [0, 2])
        for _ in range(3):  # op by op, then compiled
            np.testing.assert_allclose(decode_batch(session, [9, 4], positions, [0, 2]), want, rtol=1e-5, atol=1e-5)
        inputs = [mx.array([[9], [4]]), mx.array(positions), mx.array([0, 2])]
        hints = session.backend.plan_hints(decode, inputs, {"batch": 2})
        assert [v for n, v in hints.items() if n.startswith(visible.HINT)] == ([keys] if keys else [])
    gathered = {getattr(s.kernel, "keywords", {}).get("visible_keys") for p in session._plans["decode"].values()
                for s in p.steps if s.node.op == "slot_attention"}
    assert gathered == {128, 64, None}  # (None: the whole cache)
