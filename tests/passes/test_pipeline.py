"""The pass pipeline: statistics in the file, `kiln inspect --passes`, `kiln export -v`, and the passes on the
real model graphs (HF Llama, Whisper) with outputs unchanged."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kiln
from kiln.export.passes import PIPELINE
from kiln.ir.graph import PASS_STATS_KEY
from kiln.models.llm import StaticCacheLM, export_llama
from kiln.models.zoo import WhisperDecoder, WhisperEncoder, tiny_whisper
from tests.passes.common import export_checked
from tests.test_cli import cli


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    path = tmp_path_factory.mktemp("pipeline") / "llama.kiln"
    export_llama(LlamaForCausalLM(config).eval(), 32, 4).save(path)
    return path


def test_statistics_are_stored_per_method_and_pass(llama_file) -> None:
    stats = json.loads(kiln.load(llama_file).ir.metadata[PASS_STATS_KEY])
    assert set(stats) == {"prefill", "decode"}
    for s in stats.values():
        assert [p[0] for p in s["passes"]] == [p.name for p in PIPELINE]
        # no pass adds nodes, but stacking projections: one linear and a slice (a view) for each it replaces
        before = s["nodes"]
        for name, _, after in s["passes"]:
            assert after <= before or name == "fuse_projections", name
            before = after
        fired = {name: changed for name, changed, _ in s["passes"]}
        assert fired["fuse_projections"] == 3 * 5  # q/k/v and gate/up of each layer
        assert fired["cse"] > 0 and fired["absorb_repeat_kv"] == 6 and fired["fuse_rms_norm"] == 7
        assert fired["in_place_state_writes"] == 6 and fired["fuse_rope"] == 6 and fired["fuse_gated_mlp"] == 3
        assert fired["fuse_residual_norm"] == 6  # every norm but the first layer's, which reads the embeddings
        assert fired["fuse_rope_cache_update"] == 3  # each layer's RoPE of q and k with its two cache writes
        assert fired["fuse_gated_linear"] == 3  # each layer's gate/up projection and its activation
    # every add_rms_norm into the projection after it, but the prefill's final norm: a slice (the last position)
    # stands between it and the LM head
    assert [p[1] for p in stats["decode"]["passes"] if p[0] == "fuse_norm_linear"] == [6]
    assert [p[1] for p in stats["prefill"]["passes"] if p[0] == "fuse_norm_linear"] == [5]
    decode = stats["decode"]
    assert decode["passes"][-1][2] < 0.75 * decode["nodes"]  # the decode step loses over a quarter of its nodes


def test_inspect_passes_prints_the_table(llama_file) -> None:
    code, out, _ = cli("inspect", llama_file, "--passes")
    assert code == 0
    assert "method decode:" in out and "nodes as lowered" in out
    for p in PIPELINE:
        assert p.name in out
    code, out, _ = cli("inspect", llama_file)
    assert code == 0 and PASS_STATS_KEY not in out  # the raw JSON stays out of the text view
    code, out, _ = cli("inspect", llama_file, "--passes", "--json")
    assert json.loads(out)["decode"]["nodes"] > 0


def test_export_verbose_prints_the_table(tmp_path) -> None:
    factory = tmp_path / "f.py"
    factory.write_text("import torch\n"
                       "def make():\n"
                       "    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), (torch.randn(2, 4),)\n")
    code, out, err = cli("export", f"{factory}:make", "-o", tmp_path / "m.kiln", "-v")
    assert code == 0, err
    assert "nodes as lowered" in out and "fold_constants" in out


def test_skip_passes_is_checked() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="unknown passes"):
        kiln.export(model, (torch.randn(1, 2),), skip_passes={"no_such_pass"})
    program = kiln.export(model, (torch.randn(1, 2),), skip_passes={"cse"}).load()
    stats = json.loads(program.ir.metadata[PASS_STATS_KEY])["forward"]
    assert "cse" not in [p[0] for p in stats["passes"]]


def test_passes_fire_on_whisper_and_keep_its_outputs() -> None:
    model = tiny_whisper()
    features = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(3))
    encoder = export_checked(WhisperEncoder(model), (features,), tol=1e-4)
    with torch.no_grad():
        hidden = model.get_encoder()(input_features=features).last_hidden_state
    decoder = export_checked(WhisperDecoder(model), (torch.tensor([[1, 5, 9, 33, 7]]), hidden), tol=1e-4)
    for program in (encoder, decoder):
        stats = json.loads(program.ir.metadata[PASS_STATS_KEY])["forward"]
        assert stats["passes"][-1][2] < stats["nodes"]
    fired = {name: n for name, n, _ in json.loads(decoder.ir.metadata[PASS_STATS_KEY])["forward"]["passes"]}
    assert fired["fold_constants"] > 0 and fired["collapse_chains"] > 0  # positions and mask of a static length


def test_llama_outputs_unchanged_by_the_passes(llama_file) -> None:
    """The prefill logits of the program built with every pass equal eager's."""
    torch.manual_seed(0)
    program = kiln.load(llama_file)
    tokens = np.array([[3, 1, 4, 1]], np.int64)
    with_passes = program.session().run("prefill", tokens, np.arange(4, dtype=np.int64))[0]
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    eager = StaticCacheLM(LlamaForCausalLM(config).eval(), 32)
    with torch.no_grad():
        want = eager.prefill(torch.from_numpy(tokens), torch.arange(4)).numpy()
    np.testing.assert_allclose(with_passes, want, rtol=1e-4, atol=1e-4)
