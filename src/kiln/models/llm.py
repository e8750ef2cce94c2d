"""Decoder-only language models (Llama and its relatives in transformers) exported with a static KV cache.

`StaticCacheLM` wraps a transformers causal LM so that its KV cache lives in registered buffers of fixed shape
[1, kv_heads, max_context, head_dim] per layer. Writing a step's keys and values into them (`index_copy_` at the
step's cache positions) is a buffer mutation, which torch.export records and kiln turns into program state buffers
that `prefill` and `decode` share. The attention mask is built from the cache positions (key j is visible to
query i when j <= position[i]), so unwritten or stale cache slots are never read and a reset only needs zeros.

`export_llama` exports the two methods; `export_llm` is the recipe around it (load from a model, a checkpoint
folder or a GGUF file; store the tokenizer, chat template and stop tokens in the program), and
`kiln.llm.Generator` generates text with the result without torch.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel

from kiln.export import (
    Method,
    ProgramBuilder,
    Quantize,
    export,
    torch_ops,  # noqa: F401 - defines torch.ops.kiln.*
)
from kiln.models.llm_source import llm_metadata, load_causal_lm
from kiln.runtime.llm.info import (
    DECODE_ROWS_KEY,
    MAX_CONTEXT_KEY,
    NAME_KEY,
    PREFILL_CHUNK_KEY,
    RING_CACHE_KEY,
    SLOTS_KEY,
)

log = logging.getLogger("kiln.models.llm")

FAMILIES = ("llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "mistral", "phi3", "gpt2", "qwen3_moe",
            "qwen2_moe", "mixtral", "olmoe", "gpt_oss")
"""transformers model types the recipe is tested on (tests/models/test_zoo.py); others are tried with a warning."""


class _BufferCache:
    """The part of transformers' Cache interface that its decoder layers call: `update`, writing in place.

    It holds the wrapper's buffers as they are at call time (torch.export swaps a module's buffers for traced
    ones, so a cache made once in __init__ would write to stale tensors), and each layer's write slots (the
    positions themselves, or the positions modulo the ring size for a sliding-window layer).
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], slots: list[torch.Tensor]):
        self.keys, self.values, self.slots = keys, values, slots

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.keys[layer_idx].index_copy_(2, self.slots[layer_idx], key_states)
        self.values[layer_idx].index_copy_(2, self.slots[layer_idx], value_states)
        return self.keys[layer_idx], self.values[layer_idx]


class _SlotCache(_BufferCache):
    """The cache of a slotted StaticCacheLM: buffers [slots, max_context, kv_heads, head_dim], one slot per sequence;
    a step's keys and values [B, kv_heads, T, head_dim] go to (slots[b], positions[b, t]), one index_put_ each."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], slots: torch.Tensor,
                 positions: torch.Tensor):
        super().__init__(keys, values, [])
        self.rows, self.positions = slots[:, None], positions

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.keys[layer_idx].index_put_((self.rows, self.positions), key_states.transpose(1, 2))
        self.values[layer_idx].index_put_((self.rows, self.positions), value_states.transpose(1, 2))
        return self.keys[layer_idx], self.values[layer_idx]


SLOT_ATTENTION = "kiln_slot_attention"
"""The transformers attention implementation a slotted StaticCacheLM sets: kiln's slot_attention op."""
SINK_ATTENTION = "kiln_sink_attention"
"""The one a StaticCacheLM of one sequence sets during its steps where attention has sink logits: kiln's sdpa."""


@contextlib.contextmanager
def _leading_rows_to_head(model: PreTrainedModel, rows: int) -> Iterator[None]:
    """While it lasts, the model's output layer (LM head) takes only the first `rows` rows of its input: what
    follows it (soft-capping, scaling) is the model's own, on fewer rows."""
    def leading(_: torch.nn.Module, args: tuple) -> tuple:
        # (the rows by index, not a slice: a slice's bound makes torch.export guard on the batch's size)
        x = args[0]
        return (x.index_select(0, torch.arange(torch.sym_min(x.shape[0], rows), device=x.device)), *args[1:])

    handle = model.get_output_embeddings().register_forward_pre_hook(leading)
    try:
        yield
    finally:
        handle.remove()


def _attend_slots(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, scaling: float | None = None, dropout: float = 0.0, *,
                  kiln_slots: torch.Tensor, kiln_positions: torch.Tensor, kiln_windows: list[int],
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface over a slotted cache: key and value are the whole cache
    buffers the cache's update returned, and which slot and positions each sequence reads come from the step."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = torch.ops.kiln.slot_attention(query, key, value, kiln_slots, kiln_positions, float(scaling),
                                        int(kiln_windows[module.layer_idx]), kwargs.get("s_aux"))
    return out.transpose(1, 2).contiguous(), None


def _attend_with_sinks(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0, *,
                       s_aux: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface for attention with per-head sink logits (gpt-oss passes them as
    s_aux): kiln's sdpa with its sinks input (torch.ops.kiln.sdpa), one node where transformers' eager function is
    about ten; k and v arrive with their own (fewer) heads, as kiln's sdpa takes them."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = torch.ops.kiln.sdpa(query, key, value, attention_mask, s_aux, float(scaling))
    return out.transpose(1, 2).contiguous(), None


class _RotaryTable(torch.nn.Module):
    """A rotary embedding's cos and sin for the positions 0 .. max_context - 1, computed once by the model's own
    module: a step gathers its positions' rows (one lookup each) instead of computing the angles, their cos and sin,
    the scaling and the casts, about ten small kernels a step on a GPU, for the same values."""

    def __init__(self, rotary: torch.nn.Module, max_context: int, dtype: torch.dtype):
        super().__init__()
        device = rotary.inv_freq.device
        cos, sin = rotary(torch.zeros((), dtype=dtype, device=device), torch.arange(max_context, device=device)[None])
        self.register_buffer("cos", cos[0], persistent=False)
        self.register_buffer("sin", sin[0], persistent=False)
        self.train(rotary.training)

    @staticmethod
    def takes(module: torch.nn.Module) -> bool:
        """A transformers rotary embedding called as (x, position_ids) whose frequencies do not depend on the
        positions seen (the dynamic and long-rope types rescale them with the sequence length)."""
        rope_type = getattr(module, "rope_type", None)
        return (type(module).__name__.endswith("RotaryEmbedding") and isinstance(rope_type, str)
                and rope_type not in ("dynamic", "longrope")
                and isinstance(getattr(module, "inv_freq", None), torch.Tensor)
                and list(inspect.signature(module.forward).parameters) == ["x", "position_ids"])

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Indexing, not an embedding lookup: weight quantization (quantize=) rewrites embeddings, and these values
        # must stay as the module computed them.
        return self.cos[position_ids].to(x.dtype), self.sin[position_ids].to(x.dtype)


def _tabulate_rotary(model: torch.nn.Module, max_context: int) -> None:
    """Replaces the model's rotary embeddings that _RotaryTable takes by tables."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _RotaryTable.takes(child):
                setattr(parent, name, _RotaryTable(child, max_context, model.dtype))


EXPERTS_IMPLEMENTATION = "batched_mm"
"""The transformers experts implementation a mixture-of-experts model is exported with. Its default loops over the
experts some row picked, a loop whose trip count and shapes depend on the routing, which torch.export cannot
trace; "batched_mm" gathers each row's expert weights by index and multiplies them as a batch, which it traces,
and which the fuse_experts pass turns into gathered_linear nodes that read the picked experts in place."""


def _gather_experts(model: PreTrainedModel) -> None:
    """Switch a mixture-of-experts model's experts to EXPERTS_IMPLEMENTATION (in place, as the attention
    implementation is for slots); models without experts are left alone."""
    can_set = getattr(type(model), "_can_set_experts_implementation", None)
    if can_set is not None and can_set() and model.config._experts_implementation != EXPERTS_IMPLEMENTATION:
        model.set_experts_implementation(EXPERTS_IMPLEMENTATION)


def causal_language_model(model: PreTrainedModel) -> PreTrainedModel:
    """The causal LM inside a multimodal model (Voxtral, Gemma 3 with images): a transformers CausalLM of its text
    config over the model's own decoder (model.model.language_model) and LM head, shared, not copied, so that
    StaticCacheLM can wrap it."""
    from transformers import AutoModelForCausalLM

    text_config = model.config.get_text_config()
    with torch.device("meta"):
        causal = AutoModelForCausalLM.from_config(text_config)
    causal.model = model.model.language_model
    causal.lm_head = model.lm_head
    causal.config._attn_implementation = text_config._attn_implementation
    return causal.eval()


class StaticCacheLM(torch.nn.Module):
    """A causal LM with a static KV cache in buffers; `prefill` and `decode` return the last position's logits.

    prefill(tokens [1, T] int64, cache_position [T] int64) -> logits [1, vocab]: T tokens at those positions.
    decode(token [1, 1] int64, cache_position [1] int64) -> logits [1, vocab]: the same for one token; a separate
    method so that its graph is specialized to T = 1.
    Positions must be consecutive and start where the previous call ended (0 after a reset).

    Layers may be full or sliding-window attention (Mistral, Gemma 2/3). A full layer's cache has a slot per
    position. A sliding layer with window W keeps a ring of R = W + prefill_chunk - 1 slots (position p in slot
    p mod R), when that is shorter than max_context: a chunk of T <= prefill_chunk tokens written before the
    attention overwrites only positions at least W older than every query of the chunk, so writing first (as the
    full layers do, which keeps the update a plain in-place write) never destroys a key the chunk still needs.
    The mask is built from the positions, so unwritten or stale slots are never read and a reset only needs zeros.

    The model's rotary embeddings are replaced by tables of their cos and sin for the positions 0 .. max_context - 1
    (`_RotaryTable`, where the frequencies are static): the model is changed in place, and from then on takes
    positions below max_context only. A mixture-of-experts model's experts are switched to transformers'
    "batched_mm" implementation (EXPERTS_IMPLEMENTATION), in place too.

    slots=N (serving several sequences at once): each layer's cache is [N, max_context, kv_heads, head_dim], a
    slot per sequence, and the methods take the slots too:
    prefill(tokens [1, T], cache_position [T], slot [1]) -> logits [1, vocab]: a chunk of one sequence in its slot;
    decode(tokens [B, 1], cache_position [B], slots [B]) -> logits [min(B, N), vocab]: B rows, each one token at
    its own position in its own slot (B from 1 to N + prefill_chunk): one token of each decoding sequence, and a
    serving engine may add a prompt chunk's tokens as rows of their sequence (consecutive positions), which share
    the step's weight reads; every row's keys are written before any row attends, so each sees the earlier ones.
    Only the first N rows get logits: a step samples at most one row a slot (its decoding sequences' and each
    prompt's last token, which a serving engine puts first), so the LM head, a large share of a prompt step's work
    at a large vocabulary, reads the other rows for nothing.
    Attention is kiln's slot_attention op (transformers' attention implementation is set to it on the model),
    which reads only the positions each sequence has; sliding-window layers keep every position (no ring) and
    mask by the window; gpt-oss's sink logits are slot_attention's sinks. Layers that soft-cap their scores (Gemma 2)
    are not supported with slots.
    """

    def __init__(self, model: PreTrainedModel, max_context: int, prefill_chunk: int | None = None,
                 slots: int | None = None):
        super().__init__()
        config = model.config.get_text_config()
        if slots is not None and slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        if slots is not None and getattr(config, "attn_logit_softcapping", None):
            raise NotImplementedError(f"{config.model_type}: attention with soft-capped scores "
                                      "(attn_logit_softcapping) cannot be exported with slots yet; export it without")
        self.sliding_window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None) \
            or ["sliding_attention" if self.sliding_window else "full_attention"] * config.num_hidden_layers
        self.layer_types = sorted(set(layer_types))
        unknown = set(self.layer_types) - {"full_attention", "sliding_attention"}
        if unknown or ("sliding_attention" in self.layer_types and not self.sliding_window):
            raise NotImplementedError(f"StaticCacheLM supports full and sliding-window attention layers, not "
                                      f"{sorted(unknown) or 'sliding_attention without a sliding_window'}")
        self.model = model
        self.max_context = int(max_context)
        _tabulate_rotary(model, self.max_context)
        _gather_experts(model)
        self.prefill_chunk = self.max_context if prefill_chunk is None else int(prefill_chunk)
        self.num_layers = config.num_hidden_layers
        self.ring_size = self.max_context
        if self.sliding_window and slots is None:
            self.ring_size = min(self.max_context, int(self.sliding_window) + self.prefill_chunk - 1)
        self.layer_is_ring = [kind == "sliding_attention" and self.ring_size < self.max_context
                              for kind in layer_types]
        self.layer_windows = [int(self.sliding_window) if kind == "sliding_attention" else 0 for kind in layer_types]
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        if slots is not None:
            AttentionInterface.register(SLOT_ATTENTION, _attend_slots)
            model.set_attn_implementation(SLOT_ATTENTION)
        # attention with sink logits runs as kiln's sdpa with sinks during this module's steps only (_attention):
        # the model itself keeps transformers' attention
        self.sink_attention = slots is None and any(isinstance(getattr(m, "sinks", None), torch.Tensor)
                                                    for m in model.modules())
        if self.sink_attention:
            AttentionInterface.register(SINK_ATTENTION, _attend_with_sinks)
        for i, ring in enumerate(self.layer_is_ring):
            shape = (1, kv_heads, self.ring_size if ring else self.max_context, head_dim)
            if slots is not None:
                shape = (slots, self.max_context, kv_heads, head_dim)
            self.register_buffer(f"key_cache_{i}", torch.zeros(shape, dtype=model.dtype), persistent=False)
            self.register_buffer(f"value_cache_{i}", torch.zeros(shape, dtype=model.dtype), persistent=False)

    def _slot_step(self, tokens: torch.Tensor, cache_position: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        positions = cache_position.reshape(tokens.shape)  # [B, T]
        cache = _SlotCache([getattr(self, f"key_cache_{i}") for i in range(self.num_layers)],
                           [getattr(self, f"value_cache_{i}") for i in range(self.num_layers)], slots, positions)
        # slot_attention masks by the positions itself; transformers still wants a mask, used as given when 4-d
        unused = torch.ones((tokens.shape[0], 1, tokens.shape[1], 1), dtype=torch.bool, device=tokens.device)
        mask = {kind: unused for kind in self.layer_types} if len(self.layer_types) > 1 else unused
        with _leading_rows_to_head(self.model, self.slots):
            out = self.model(input_ids=tokens, attention_mask=mask, position_ids=positions, past_key_values=cache,
                             use_cache=True, logits_to_keep=1, kiln_slots=slots, kiln_positions=positions,
                             kiln_windows=self.layer_windows)
        return out.logits[:, -1, :]

    def _step(self, tokens: torch.Tensor | None, cache_position: torch.Tensor,
              embeds: torch.Tensor | None = None, blocks: torch.Tensor | None = None) -> torch.Tensor:
        ring_slots = cache_position % self.ring_size
        cache = _BufferCache([getattr(self, f"key_cache_{i}") for i in range(self.num_layers)],
                             [getattr(self, f"value_cache_{i}") for i in range(self.num_layers)],
                             [ring_slots if ring else cache_position for ring in self.layer_is_ring])
        inputs = {"input_ids": tokens} if embeds is None else {"inputs_embeds": embeds}
        with self._attention():
            out = self.model(**inputs, attention_mask=self._mask(cache_position, blocks),
                             position_ids=cache_position[None, :], past_key_values=cache, use_cache=True,
                             logits_to_keep=1)
        return out.logits[:, -1, :]

    @contextlib.contextmanager
    def _attention(self) -> Iterator[None]:
        """The model's attention implementation for a step: kiln's sdpa with sinks where its attention has sink
        logits (gpt-oss), restored afterwards; otherwise the model's own."""
        config = self.model.config
        previous = config._attn_implementation
        if self.sink_attention:
            config._attn_implementation = SINK_ATTENTION
        try:
            yield
        finally:
            config._attn_implementation = previous

    def _mask(self, cache_position: torch.Tensor,
              blocks: torch.Tensor | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
        """[1, 1, T, slots] booleans (a 4-d mask is used by transformers as given), or one per layer type.

        Key j is visible to query i when its position k satisfies k <= position[i] (and, in a sliding layer,
        k > position[i] - window). After this step's write, ring slot s holds the latest position k <= last with
        k = s mod R (last = the chunk's final position), i.e. k = last - ((last - s) mod R); k < 0: never written.
        Models with both kinds of layers take a dict keyed by layer type.

        blocks [T] (int64, -1 for a text position): the chunk's positions with one block id are also visible to
        each other whatever their order (an image's tokens, which Gemma 3 attends bidirectionally), still inside
        a sliding layer's window; a block must lie within one chunk.
        """
        query = cache_position[:, None]
        keys = torch.arange(self.max_context, device=cache_position.device)[None, :]
        masks = {"full_attention": (keys <= query) | self._same_block(blocks, cache_position, self.max_context)}
        if "sliding_attention" in self.layer_types:
            slot_of = cache_position
            if any(self.layer_is_ring):
                slots = torch.arange(self.ring_size, device=cache_position.device)[None, :]
                last = cache_position[-1:]
                keys = last - torch.remainder(last - slots, self.ring_size)
                slot_of = cache_position % self.ring_size
            seen = (keys <= query) | self._same_block(blocks, slot_of, keys.shape[1])
            masks["sliding_attention"] = (keys >= 0) & seen & (keys > query - self.sliding_window)
        masks = {kind: self._as_attention_mask(masks[kind][None, None]) for kind in self.layer_types}
        return next(iter(masks.values())) if len(masks) == 1 else masks

    @staticmethod
    def _same_block(blocks: torch.Tensor | None, slots: torch.Tensor, count: int) -> torch.Tensor | bool:
        """[T, count]: whether cache slot j holds a position of this chunk in query i's block (False: no blocks)."""
        if blocks is None:
            return False
        slot_blocks = torch.full((count,), -1, dtype=blocks.dtype, device=blocks.device).index_copy(0, slots, blocks)
        return (blocks[:, None] == slot_blocks[None, :]) & (blocks[:, None] >= 0)

    def _as_attention_mask(self, visible: torch.Tensor) -> torch.Tensor:
        """SDPA (and kiln's sdpa with sinks) takes booleans; other attention implementations (Gemma 2's eager one,
        with its soft-capping) add the mask to the scores, so they need 0 where visible and the dtype's minimum
        elsewhere."""
        if self.model.config._attn_implementation == "sdpa" or self.sink_attention:
            return visible
        dtype = self.model.dtype
        blocked = torch.full(visible.shape, torch.finfo(dtype).min, dtype=dtype, device=visible.device)
        return blocked.masked_fill(visible, 0.0)

    def prefill(self, tokens: torch.Tensor, cache_position: torch.Tensor,
                slot: torch.Tensor | None = None) -> torch.Tensor:
        if not torch.compiler.is_compiling() and tokens.shape[1] > self.prefill_chunk:
            raise ValueError(f"prefill takes at most {self.prefill_chunk} tokens at a time, got {tokens.shape[1]}")
        return self._step(tokens, cache_position) if slot is None else self._slot_step(tokens, cache_position, slot)

    def prefill_embeds(self, embeds: torch.Tensor, cache_position: torch.Tensor,
                       blocks: torch.Tensor | None = None) -> torch.Tensor:
        """prefill from the rows of the input embedding [1, T, d] instead of token ids: a multimodal prompt, whose
        audio or image positions hold an encoder's projected states (one sequence; no slots). blocks [T]: positions
        that also see each other both ways (see _mask), -1 for the others."""
        if not torch.compiler.is_compiling() and embeds.shape[1] > self.prefill_chunk:
            raise ValueError(f"prefill takes at most {self.prefill_chunk} tokens at a time, got {embeds.shape[1]}")
        return self._step(None, cache_position, embeds, blocks)

    def decode(self, token: torch.Tensor, cache_position: torch.Tensor,
               slots: torch.Tensor | None = None) -> torch.Tensor:
        return self._step(token, cache_position) if slots is None else self._slot_step(token, cache_position, slots)

    def reset(self) -> None:
        """Zero the cache (eager use; an exported program's session has `reset_state()`)."""
        for name, buf in self.named_buffers():
            if "_cache_" in name:
                buf.zero_()


def export_llama(model: PreTrainedModel | StaticCacheLM, max_context: int, prefill_chunk: int,
                 slots: int | None = None, **export_options) -> ProgramBuilder:
    """Export `prefill` (chunks of 1..prefill_chunk tokens) and `decode` (one token) sharing one KV cache.

    model: a transformers causal LM (wrapped here) or a StaticCacheLM. The cache length and chunk size are written to
    the program's metadata for `greedy_generate`. slots: a cache of that many sequences, decoded together (see
    StaticCacheLM); None: one sequence.
    """
    if not 1 <= prefill_chunk <= max_context:
        raise ValueError(f"prefill_chunk must be in 1..max_context ({max_context}), got {prefill_chunk}")
    lm = model if isinstance(model, StaticCacheLM) else StaticCacheLM(model, max_context, prefill_chunk, slots)
    if (lm.max_context, lm.prefill_chunk, lm.slots) != (max_context, prefill_chunk, slots):
        raise ValueError(f"the StaticCacheLM has max_context {lm.max_context}, prefill_chunk {lm.prefill_chunk} and "
                         f"slots {lm.slots}, not {max_context}, {prefill_chunk} and {slots}")
    lm.reset()  # the buffers' contents at export become the program's initial state: start empty
    example = min(prefill_chunk, 2)  # torch.export specializes a dimension whose example size is 1
    tokens = torch.zeros((1, example), dtype=torch.long)
    positions = torch.arange(example, dtype=torch.long)
    slot = () if lm.slots is None else (torch.zeros((1,), dtype=torch.long),)
    if prefill_chunk > 1:
        seq = torch.export.Dim("seq", min=1, max=prefill_chunk)
        prefill = Method((tokens, positions, *slot), dynamic_shapes=({1: seq}, {0: seq}, *[None] * len(slot)))
    else:
        prefill = Method((tokens, positions, *slot))
    if lm.slots is None:
        decode = Method((torch.zeros((1, 1), dtype=torch.long), torch.zeros((1,), dtype=torch.long)))
    else:
        args = (torch.zeros((2, 1), dtype=torch.long), torch.zeros((2,), dtype=torch.long),
                torch.zeros((2,), dtype=torch.long))  # 2 rows: torch.export specializes a dim of example size 1
        rows = torch.export.Dim("batch", min=1, max=lm.slots + prefill_chunk)
        decode = Method(args, dynamic_shapes=({0: rows}, {0: rows}, {0: rows}))
    metadata = {MAX_CONTEXT_KEY: str(max_context), PREFILL_CHUNK_KEY: str(prefill_chunk),
                RING_CACHE_KEY: "1" if any(lm.layer_is_ring) else "0"}
    if lm.slots is not None:
        metadata[SLOTS_KEY], metadata[DECODE_ROWS_KEY] = str(lm.slots), str(lm.slots + prefill_chunk)
    metadata.update(export_options.pop("metadata", None) or {})
    return export(lm, methods={"prefill": prefill, "decode": decode}, metadata=metadata, **export_options)


def export_llm(model_or_path: PreTrainedModel | str | os.PathLike, max_context: int | None = None,
               prefill_chunk: int = 128, dtype: str | None = None, quantize: Quantize | str | None = None,
               tokenizer: Any = None, slots: int | None = None, dequantize: bool = False,
               **export_options) -> ProgramBuilder:
    """Export a transformers decoder-only LM as a program that `kiln generate` / `kiln.llm.Generator` can run alone.

    model_or_path: a transformers causal LM, a checkpoint folder, or a .gguf file (loaded by transformers).
    max_context: KV-cache length in tokens (default: the model's max_position_embeddings, at most 2048).
    prefill_chunk: the most prompt tokens one `prefill` call takes (longer prompts go in chunks).
    dtype: "float32" (default), "bfloat16" or "float16" for the whole model (weights, activations, cache).
    quantize: weight-only quantization of linear and embedding weights (see kiln.export.Quantize); for a GGUF
    file, this re-quantizes every weight from its dequantized values instead of keeping the file's quantization.
    dequantize: for a GGUF file, store its weights as float (dtype) instead of keeping the file's quantization. By
    default a GGUF file's quantized weights are stored exactly as the file holds them (kiln.models.gguf_quant:
    Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and Q2_K..Q6_K bit for bit; other types re-quantized with a warning).
    tokenizer: a transformers tokenizer or its path; by default the one beside the model. Its tokenizer.json, chat
    template, special tokens and the stop tokens go into the program's metadata (kiln.runtime.llm.info).
    slots: a KV cache for that many sequences at once, decoded as one batch (what `kiln serve` batches over);
    None: one sequence (see StaticCacheLM).
    """
    model, tokenizer = load_causal_lm(model_or_path, tokenizer, dtype)
    config = model.config.get_text_config()
    if config.model_type not in FAMILIES:
        log.warning("model type %r is not among the families kiln tests (%s); exporting it anyway",
                    config.model_type, ", ".join(FAMILIES))
    if max_context is None:
        max_context = min(int(getattr(config, "max_position_embeddings", 2048) or 2048), 2048)
    prefill_chunk = min(prefill_chunk, max_context)
    metadata = llm_metadata(model, tokenizer)
    if not isinstance(model_or_path, PreTrainedModel):
        metadata[NAME_KEY] = Path(model_or_path).stem if Path(model_or_path).is_file() else Path(model_or_path).name
    metadata.update(export_options.pop("metadata", None) or {})
    known = None
    if quantize is None and not dequantize and _is_gguf(model_or_path):
        from kiln.models.gguf_quant import GGUFQuantization

        known = GGUFQuantization(model_or_path)
        if dtype not in (None, "float32") and known.tensors:
            log.warning("the GGUF's scales are stored in %s, rounded: the quantized weights are exact in float32 "
                        "programs only", dtype)
    builder = export_llama(model, max_context, prefill_chunk, slots=slots, quantize=quantize, metadata=metadata,
                           known_quantization=known, **export_options)
    for line in known.summary() if known is not None else ():
        log.info("%s", line)
    if known is not None and known.requantized:
        log.warning("%d GGUF tensors were re-quantized, not kept (see above)", len(known.requantized))
    return builder


def _is_gguf(source: Any) -> bool:
    return isinstance(source, (str, os.PathLike)) and Path(source).suffix == ".gguf" and Path(source).is_file()


__all__ = ["FAMILIES", "MAX_CONTEXT_KEY", "PREFILL_CHUNK_KEY", "StaticCacheLM", "causal_language_model", "export_llama",
           "export_llm"]
