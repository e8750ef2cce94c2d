"""Image and text in, text out, with an exported image-and-text program (kiln.models.gemma3_vision), torch-free.

The image is preprocessed as the model's processor does it (a bilinear resize to the tower's S x S with Pillow,
then (x / 255 - mean) / std per channel: Gemma 3's processor without pan-and-scan), `encode_image` makes its N
embedding rows, and the prompt is <bos> <start_of_image> <image> x N <end_of_image> then the text: its rows come
from `embed`, the image tokens' rows are replaced by the image's, and `prefill_embeds` feeds them in chunks (the
image whole in the first: its tokens attend each other both ways, block id 0; text is -1). Decoding is greedy over
`decode` until a stop token, the token budget or a full cache, as transformers' greedy generate.

The program's metadata (keys below, namespaced `kiln.image_text.`) says how; the decoder's cache and tokenizer are
the LLM metadata of kiln.runtime.llm.info.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kiln.errors import InputError
from kiln.runtime.llm.decoding import greedy_continue, prefill_embedded
from kiln.runtime.llm.info import LLMInfo
from kiln.runtime.llm.tokenizer import LLMTokenizer
from kiln.runtime.program import Program, load

KIND_KEY = "kiln.image_text.kind"
"""The model family: "gemma3"."""
IMAGE_SIZE_KEY = "kiln.image_text.image_size"
IMAGE_TOKENS_KEY = "kiln.image_text.image_tokens"
"""Embedding rows one image becomes (Gemma 3: mm_tokens_per_image, 256)."""
MEAN_KEY = "kiln.image_text.mean"
STD_KEY = "kiln.image_text.std"
TOKEN_IDS_KEY = "kiln.image_text.token_ids"
"""JSON object: the ids of the image placeholder ("image"), the markers around it ("begin", "end") and "bos"."""
KINDS = ("gemma3",)


@dataclass(frozen=True)
class ImageTextInfo:
    """The image-and-text metadata of a program, parsed."""

    kind: str
    image_size: int
    image_tokens: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    token_ids: Mapping[str, int]

    @classmethod
    def from_metadata(cls, meta: Mapping[str, str]) -> ImageTextInfo:
        kind = meta.get(KIND_KEY)
        if kind not in KINDS:
            raise InputError(f"this program is not an image-and-text model (its {KIND_KEY!r} is {kind!r}; expected "
                             f"one of {list(KINDS)}): export one with kiln.models.gemma3_vision.export_gemma3_vision")
        try:
            return cls(kind, int(meta[IMAGE_SIZE_KEY]), int(meta[IMAGE_TOKENS_KEY]),
                       tuple(json.loads(meta[MEAN_KEY])), tuple(json.loads(meta[STD_KEY])),
                       {k: int(v) for k, v in json.loads(meta[TOKEN_IDS_KEY]).items()})
        except (KeyError, ValueError) as e:
            raise InputError(f"this image-and-text program's metadata is incomplete or malformed ({e})") from None


def preprocess(image: object, info: ImageTextInfo) -> np.ndarray:
    """[1, 3, S, S] float32 pixels of a Pillow image (or an image file's path), as the model's processor makes
    them."""
    from kiln.runtime.vision import load_image, pillow, to_nchw

    picture = load_image(image) if isinstance(image, (str, os.PathLike)) else image
    picture = picture.convert("RGB")
    size = (info.image_size, info.image_size)
    if picture.size != size:
        picture = picture.resize(size, pillow().Resampling.BILINEAR)
    return to_nchw(picture, info.mean, info.std)


class ImageTextModel:
    """Answers prompts about images with one image-and-text program on one backend (a session of its own)."""

    def __init__(self, program: Program | str | os.PathLike, backend: str = "cpu"):
        self.program = program if isinstance(program, Program) else load(program)
        self.info = ImageTextInfo.from_metadata(self.program.metadata)
        self.llm = LLMInfo.from_metadata(self.program.metadata)
        self.session = self.program.session(backend)
        self.tokenizer = LLMTokenizer.from_info(self.llm) if self.llm.tokenizer_json else None
        if self.llm.prefill_chunk < self.info.image_tokens + 2:
            raise InputError(f"this program's prefill chunk ({self.llm.prefill_chunk}) cannot hold an image's "
                             f"{self.info.image_tokens} tokens; export it again with a larger prefill_chunk")

    def prompt(self, text: str | Sequence[int]) -> list[int]:
        """<bos> <start_of_image> <image> x N <end_of_image>, then the text (its token ids, or ids given)."""
        t = self.info.token_ids
        if isinstance(text, str):
            if self.tokenizer is None:
                raise InputError("this program has no tokenizer; pass token ids instead of text")
            asked = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            asked = [int(i) for i in text]
        return [t["bos"], t["begin"], *[t["image"]] * self.info.image_tokens, t["end"], *asked]

    def encode_image(self, image: object) -> np.ndarray:
        """The image's [N, d] embedding rows."""
        pixels = preprocess(image, self.info)
        return np.asarray(self.session.backend.to_numpy(self.session.run("encode_image", pixels)[0]))

    def prefill(self, image: object, text: str | Sequence[int]) -> tuple[list[int], np.ndarray]:
        """(the prompt's token ids, the logits [vocab] after it): the image and `text` fed from an empty cache."""
        ids = self.prompt(text)
        is_image = np.asarray(ids) == self.info.token_ids["image"]
        # (chunks of prefill_chunk >= the image's tokens + 2: the image, at positions 2.., lies in the first)
        logits = prefill_embedded(self.session, ids, self.info.token_ids["image"], self.encode_image(image),
                                  self.llm, blocks=np.where(is_image, 0, -1).astype(np.int64))
        return ids, logits

    def generate(self, image: object, text: str | Sequence[int], max_new_tokens: int = 256) -> list[int]:
        """Greedy token ids answering `text` about `image` (a Pillow image or an image file's path)."""
        ids, logits = self.prefill(image, text)
        return greedy_continue(self.session, logits, len(ids), max_new_tokens, set(self.llm.stop_token_ids), self.llm)

    def answer(self, image: object, text: str, max_new_tokens: int = 256) -> str:
        """The model's answer to `text` about `image`, as text."""
        if self.tokenizer is None:
            raise InputError("this program has no tokenizer to decode its answer with")
        ids = [t for t in self.generate(image, text, max_new_tokens) if t not in self.llm.stop_token_ids]
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()


__all__ = ["ImageTextInfo", "ImageTextModel", "preprocess"]
