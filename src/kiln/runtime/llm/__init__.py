"""Language models in the torch-free runtime: generate text with a program made by `kiln export-llm`.

    from kiln.llm import Generator
    gen = Generator("model.kiln")
    print(gen.generate("The capital of France is", max_new_tokens=16).text)

info.py is the metadata contract with the exporter; decoding.py the prefill/decode calls; sampling.py picks
tokens; tokenizer.py turns text into ids and back (optional `tokenizers` and `jinja2` packages); generator.py has
Generator and ChatSession. Nothing here imports torch.
"""

from kiln.runtime.llm.generator import (
    ChatSession,
    ContextFullError,
    GenerationResult,
    GenerationStats,
    Generator,
    Stream,
    TokenEvent,
)
from kiln.runtime.llm.info import LLMInfo
from kiln.runtime.llm.sampling import Sampler
from kiln.runtime.llm.tokenizer import IncrementalDetokenizer, LLMTokenizer

__all__ = ["ChatSession", "ContextFullError", "GenerationResult", "GenerationStats", "Generator",
           "IncrementalDetokenizer", "LLMInfo", "LLMTokenizer", "Sampler", "Stream", "TokenEvent"]
