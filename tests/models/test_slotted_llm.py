"""export_llm(slots=N): a KV cache of N sequences, prefilled one slot at a time and decoded as one batch, gives
each sequence exactly what a program of one sequence gives it, on every backend and decoder family."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

from kiln.errors import InputError  # noqa: E402
from kiln.models.llm import export_llama  # noqa: E402
from kiln.models.zoo import tiny_decoder  # noqa: E402
from kiln.runtime.llm import Generator  # noqa: E402
from kiln.runtime.llm.decoding import decode_batch, greedy_generate, prefill  # noqa: E402

FAMILIES = ("llama", "qwen3", "gemma3", "mistral", "phi3", "gpt2", "qwen3_moe", "mixtral", "gpt_oss")
PROMPTS = ([5, 9, 17, 33, 2, 70, 71, 72, 73, 74, 75], [3, 1, 4, 1, 5], [100, 101, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
SLOTS = (2, 0, 3)  # not in order, and one slot (1) left empty
STEPS = 10


def batched_greedy(session, prompts, slots, steps):
    """Each prompt prefilled into its slot, then `steps` decode steps of all of them together."""
    out = [[int(np.argmax(prefill(session, p, 0, s)))] for p, s in zip(prompts, slots)]
    positions = [len(p) for p in prompts]
    for _ in range(steps):
        logits = decode_batch(session, [o[-1] for o in out], positions, slots)
        for k, row in enumerate(logits):
            out[k].append(int(np.argmax(row)))
            positions[k] += 1
    return out


@pytest.fixture(scope="module")
def programs():
    cache = {}

    def get(family, slots):
        if (family, slots) not in cache:
            cache[family, slots] = export_llama(tiny_decoder(family), 40, 8, slots=slots).load()
        return cache[family, slots]
    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_decode_equals_one_sequence_at_a_time(programs, family, backend):
    single = programs(family, None).session(backend)
    want = [greedy_generate(single, p, STEPS + 1) for p in PROMPTS]
    assert batched_greedy(programs(family, 4).session(backend), PROMPTS, SLOTS, STEPS) == want


def test_decode_rotates_and_writes_each_layer_in_one_node(programs):
    """The decode step's RoPE of q and k and its two slot writes are one rope_cache_update per layer (its k taken
    before the transposes around the rotation); prefill, whose cos and sin differ per token, keeps them apart."""
    program = programs("llama", 4)
    decode = [n.op for n in program.ir.methods["decode"].nodes]
    layers = decode.count("slot_attention")
    assert decode.count("rope_cache_update") == layers and not {"rope", "index_put"} & set(decode)
    fused = next(n for n in program.ir.methods["decode"].nodes if n.op == "rope_cache_update")
    assert fused.attrs["dims"] == (0, 1) and fused.attrs["in_place"]
    prefill_ops = [n.op for n in program.ir.methods["prefill"].nodes]
    assert "rope_cache_update" not in prefill_ops and prefill_ops.count("index_put") == 2 * layers


def test_sequences_join_and_leave_the_batch(programs, backend):
    """A sequence prefilled while others are mid-decode, and one that leaves early, do not disturb the others;
    a freed slot's stale keys are never read by the sequence that reuses it."""
    single = programs("llama", None).session(backend)
    session = programs("llama", 4).session(backend)
    a, b, c = PROMPTS
    want_a = greedy_generate(single, a, 9)
    want_c = greedy_generate(single, c, 5)
    got_a = [int(np.argmax(prefill(session, a, 0, 1)))]
    got_b = [int(np.argmax(prefill(session, b, 0, 3)))]
    for step in range(8):
        if step == 3:  # b leaves, c takes its slot
            got_c = [int(np.argmax(prefill(session, c, 0, 3)))]
        rows = [(got_a, len(a), 1)] + ([(got_b, len(b), 3)] if step < 3 else [(got_c, len(c), 3)] if step < 7 else [])
        logits = decode_batch(session, [r[0][-1] for r in rows], [r[1] + len(r[0]) - 1 for r in rows],
                              [r[2] for r in rows])
        for (seq, _, _), row in zip(rows, logits):
            seq.append(int(np.argmax(row)))
    assert got_a == want_a and got_c == want_c


def test_generator_runs_a_slotted_program(programs):
    single = Generator(programs("qwen3", None))
    slotted = Generator(programs("qwen3", 3))
    for prompt in PROMPTS:
        assert slotted.generate(list(prompt), 6).token_ids == single.generate(list(prompt), 6).token_ids


def test_slot_inputs_are_checked(programs):
    session = programs("llama", 4).session()
    with pytest.raises(InputError, match=r"slots must be in \[0, 4\)"):
        prefill(session, [1, 2], 0, 4)
    with pytest.raises(InputError, match="holds one sequence"):
        decode_batch(programs("llama", None).session(), [1, 2], [3, 3], [0, 1])


def test_program_describes_its_slots(programs):
    program = programs("llama", 4)
    assert program.metadata["kiln.llm.slots"] == "4" and program.metadata["kiln.llm.decode_rows"] == "12"
    assert "where batch in [1, 12]" in program.info("decode").describe()  # 4 slots + a prefill chunk of 8
    assert "slot_attention" in {n.op for n in program.method("decode").nodes}


def test_logits_of_the_first_slots_rows_only(programs):
    """A step samples at most one row a slot, the sampled rows first: the LM head takes the first min(B, slots)
    rows (a slice, not a gather), and they are the rows a step of only them gives."""
    from kiln.runtime.llm.decoding import decode_batch

    program = programs("llama", 4)
    assert "-> (output: float32[min(4, batch), " in program.info("decode").describe()
    assert "index_select" not in {n.op for n in program.method("decode").nodes}
    session = program.session("cpu")
    rows = decode_batch(session, [9, 10, 11, 12, 13, 14, 15], [3, 5, 0, 2, 1, 2, 3], [0, 1, 2, 3, 2, 2, 2])
    assert rows.shape == (4, 128)
    session.reset_state()
    alone = decode_batch(session, [9, 10, 11, 12], [3, 5, 0, 2], [0, 1, 2, 3])
    np.testing.assert_allclose(rows, alone, rtol=1e-5, atol=1e-5)


def test_soft_capped_attention_is_refused_with_slots():
    with pytest.raises(NotImplementedError, match="soft-capped"):
        export_llama(tiny_decoder("gemma2"), 40, 8, slots=2)


def test_attention_sinks_are_slot_attentions_sinks(programs):
    """gpt-oss's per-head sink logits ride in each layer's slot_attention node (its sixth input, the layer's
    constant), in decode and prefill alike."""
    program = programs("gpt_oss", 4)
    for name in ("prefill", "decode"):
        method = program.ir.methods[name]
        attention = [n for n in method.nodes if n.op == "slot_attention"]
        assert attention and all(len(n.inputs) == 6 for n in attention), name
        assert all(method.values[n.inputs[5]].name.endswith("self_attn.sinks") for n in attention), name
