"""Tiny random-weight transformers models, one per architecture family, for export tests and benchmarks.

Each builder seeds torch and returns an eval-mode model small enough to export in a few seconds (hidden 32, two
layers, vocabulary 128). initializer_range is 0.2-0.3 rather than transformers' 0.02 so that logits are peaked:
greedy choices are then not near-ties and a numerical error would show as a changed token (the decoders use 0.3,
which gives every family a top-2 logit gap of at least 0.004 over the test prompt's 32 greedy steps). The
sliding-window families get a window (4) shorter than the prompts the tests use, so the window changes the result.

The wrappers at the end give encoder models a plain tensor-in, tensors-out `forward` for `kiln.export`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import transformers as tf

VOCAB = 128
MAX_POSITIONS = 64
SLIDING_WINDOW = 4

_TOKENS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
_LLAMA_LIKE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "max_position_embeddings": MAX_POSITIONS, "vocab_size": VOCAB,
               "initializer_range": 0.3, **_TOKENS}

_EXPERTS = {"num_experts": 8, "num_experts_per_tok": 2}

DECODERS: dict[str, Callable[[], tuple[type, type, dict]]] = {
    "llama": lambda: (tf.LlamaConfig, tf.LlamaForCausalLM, _LLAMA_LIKE),
    "qwen2": lambda: (tf.Qwen2Config, tf.Qwen2ForCausalLM, _LLAMA_LIKE),
    "qwen3": lambda: (tf.Qwen3Config, tf.Qwen3ForCausalLM, {**_LLAMA_LIKE, "head_dim": 16}),
    "gemma": lambda: (tf.GemmaConfig, tf.GemmaForCausalLM, {**_LLAMA_LIKE, "head_dim": 8}),
    # soft-capped attention (eager attention in transformers) and final logits; alternating sliding/full layers
    "gemma2": lambda: (tf.Gemma2Config, tf.Gemma2ForCausalLM,
                       {**_LLAMA_LIKE, "head_dim": 8, "sliding_window": SLIDING_WINDOW}),
    # q/k norms, two rotary bases (local for sliding layers); one sliding and one full layer
    "gemma3": lambda: (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM,
                       {**_LLAMA_LIKE, "head_dim": 8, "sliding_window": SLIDING_WINDOW,
                        "layer_types": ["sliding_attention", "full_attention"]}),
    # every layer sliding-window
    "mistral": lambda: (tf.MistralConfig, tf.MistralForCausalLM, {**_LLAMA_LIKE, "sliding_window": SLIDING_WINDOW}),
    # fused qkv and gate_up projections
    "phi3": lambda: (tf.Phi3Config, tf.Phi3ForCausalLM, _LLAMA_LIKE),
    # learned positions, Conv1D (addmm) projections, tanh GELU, LayerNorm with bias, tied embeddings
    "gpt2": lambda: (tf.GPT2Config, tf.GPT2LMHeadModel,
                     {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": MAX_POSITIONS, "vocab_size": VOCAB,
                      "initializer_range": 0.3, **_TOKENS}),
    # mixture of experts: 8 experts, 2 a token; q/k norms; the second layer a dense MLP (mlp_only_layers)
    "qwen3_moe": lambda: (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM,
                          {**_LLAMA_LIKE, "head_dim": 16, **_EXPERTS, "moe_intermediate_size": 16,
                           "norm_topk_prob": True, "mlp_only_layers": [1]}),
    # experts plus a shared expert behind a sigmoid gate; top-k weights not renormalized; q/k/v biases
    "qwen2_moe": lambda: (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM,
                          {**_LLAMA_LIKE, **_EXPERTS, "moe_intermediate_size": 16,
                           "shared_expert_intermediate_size": 32}),
    "mixtral": lambda: (tf.MixtralConfig, tf.MixtralForCausalLM,
                        {**_LLAMA_LIKE, "intermediate_size": 16, "num_local_experts": 8, "num_experts_per_tok": 2}),
    # q/k norms over the whole projection; top-k weights not renormalized
    "olmoe": lambda: (tf.OlmoeConfig, tf.OlmoeForCausalLM, {**_LLAMA_LIKE, **_EXPERTS, "intermediate_size": 16}),
    # experts with biases, interleaved gate/up, a clamped SwiGLU; router with a bias, softmax over the top k;
    # attention sinks; a sliding and a full layer
    "gpt_oss": lambda: (tf.GptOssConfig, tf.GptOssForCausalLM,
                        {**_LLAMA_LIKE, "head_dim": 8, "intermediate_size": 16, "num_local_experts": 8,
                         "num_experts_per_tok": 2, "sliding_window": SLIDING_WINDOW,
                         "layer_types": ["sliding_attention", "full_attention"]}),
}
"""family -> (config class, model class, config kwargs); lazy so that a missing class fails only its family."""


def tiny_decoder(family: str, seed: int = 0) -> tf.PreTrainedModel:
    """A random-weight causal LM of `family` (a key of DECODERS), float32, eval mode."""
    config_cls, model_cls, kwargs = DECODERS[family]()
    torch.manual_seed(seed)
    return model_cls(config_cls(**kwargs)).eval()


CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + ' ' + m['content'] + ' <|im_end|> ' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}")
"""A ChatML-like template in the tiny tokenizer's words (whitespace separated, no newlines)."""


def word_tokenizer(words: list[str], special: list[str]) -> tf.PreTrainedTokenizerFast:
    """A word-level fast tokenizer over VOCAB ids: `words` (starting <unk> <s> </s>), then "w0", "w1", ...;
    whitespace splits words, `special` are its additional special tokens; eos is </s>, bos is not added."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = words + [f"w{i}" for i in range(VOCAB - len(words))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                           eos_token="</s>")
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    return tokenizer


def tiny_tokenizer() -> tf.PreTrainedTokenizerFast:
    """The tiny decoders' word tokenizer: <unk> <s> </s> <|im_start|> <|im_end|>, the chat roles, then "w0",
    "w1", ...; CHAT_TEMPLATE as its chat template."""
    tokenizer = word_tokenizer(["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant"],
                               ["<|im_start|>", "<|im_end|>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_vit(seed: int = 0) -> tf.ViTForImageClassification:
    """ViT classifier on 32x32 RGB images in 8x8 patches (16 patches + CLS), 10 classes."""
    torch.manual_seed(seed)
    config = tf.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                          image_size=32, patch_size=8, num_channels=3, num_labels=10, initializer_range=0.2)
    return tf.ViTForImageClassification(config).eval()


def tiny_whisper(seed: int = 0) -> tf.WhisperForConditionalGeneration:
    """Whisper with 16 mel bins and 16 encoder positions (input features [1, 16, 32]), 2+2 layers."""
    torch.manual_seed(seed)
    config = tf.WhisperConfig(vocab_size=VOCAB, num_mel_bins=16, encoder_layers=2, decoder_layers=2,
                              encoder_attention_heads=4, decoder_attention_heads=4, d_model=32, encoder_ffn_dim=64,
                              decoder_ffn_dim=64, max_source_positions=16, max_target_positions=32, init_std=0.2,
                              pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    return tf.WhisperForConditionalGeneration(config).eval()


VOXTRAL_WORDS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[BEGIN_AUDIO]", "[AUDIO]", "[TRANSCRIBE]", "lang:en"]
"""The tiny Voxtral's special words (its prompt tokens, kiln.models.voxtral.PROMPT_TOKENS); "w0", "w1", ... follow."""


def tiny_voxtral(seed: int = 0) -> tf.VoxtralForConditionalGeneration:
    """Voxtral with a 2-layer audio encoder of width 32 over real 30 s windows (128 mel bins, 1500 positions: 375
    audio embeddings a window, as the real model) and a 2-layer Llama decoder over VOCAB tokens."""
    torch.manual_seed(seed)
    audio = {"hidden_size": 32, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_mel_bins": 128, "max_source_positions": 1500, "initializer_range": 0.2}
    text = {**_LLAMA_LIKE, "model_type": "llama", "max_position_embeddings": 512, "bos_token_id": 1,
            "eos_token_id": 2}
    config = tf.VoxtralConfig(audio_config=audio, text_config=text, audio_token_id=VOXTRAL_WORDS.index("[AUDIO]"))
    return tf.VoxtralForConditionalGeneration(config).eval()


def voxtral_tokenizer() -> tf.PreTrainedTokenizerFast:
    """A word-level fast tokenizer for tiny_voxtral: VOXTRAL_WORDS, then "w0", "w1", ... up to VOCAB ids."""
    return word_tokenizer(VOXTRAL_WORDS, VOXTRAL_WORDS[3:8])


GEMMA3_IMAGE_WORDS = ["<unk>", "<s>", "</s>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
"""The tiny Gemma 3's special words: its image markers and placeholder; "w0", "w1", ... follow."""


def tiny_gemma3_vision(seed: int = 0, all_sliding: bool = False) -> tf.Gemma3ForConditionalGeneration:
    """Gemma 3 with images: a 2-layer SigLIP tower of width 32 over 32 x 32 images in 8 x 8 patches, pooled to 4
    image tokens, and a 3-layer Gemma 3 decoder (a sliding layer, then two full ones: what an image token sees
    of the later ones in a middle layer reaches the text after it) over VOCAB tokens. all_sliding: three sliding
    layers of window 6 (an export with a short prefill chunk keeps them in ring caches)."""
    torch.manual_seed(seed)
    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 32, "patch_size": 8}
    layers = ["sliding_attention"] * 3 if all_sliding else ["sliding_attention", "full_attention", "full_attention"]
    text = {**_LLAMA_LIKE, "head_dim": 8, "sliding_window": 6 if all_sliding else SLIDING_WINDOW,
            "bos_token_id": 1, "eos_token_id": 2, "num_hidden_layers": 3, "layer_types": layers}
    words = GEMMA3_IMAGE_WORDS
    config = tf.Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=4,
                             boi_token_index=words.index("<start_of_image>"),
                             eoi_token_index=words.index("<end_of_image>"),
                             image_token_index=words.index("<image_soft_token>"), initializer_range=0.3)
    return tf.Gemma3ForConditionalGeneration(config).eval()


def gemma3_image_tokenizer() -> tf.PreTrainedTokenizerFast:
    """A word-level fast tokenizer for tiny_gemma3_vision: GEMMA3_IMAGE_WORDS, then "w0", "w1", ..."""
    return word_tokenizer(GEMMA3_IMAGE_WORDS, GEMMA3_IMAGE_WORDS[3:])


class ViTOutputs(torch.nn.Module):
    """pixel_values [B, 3, H, W] -> (logits [B, labels], last_hidden_state [B, patches + 1, hidden])."""

    def __init__(self, model: tf.ViTForImageClassification):
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model.vit(pixel_values=pixel_values).last_hidden_state  # after the final layernorm
        return self.model.classifier(hidden[:, 0, :]), hidden  # what ViTForImageClassification does: CLS token


class WhisperEncoder(torch.nn.Module):
    """input_features [B, n_mels, 2 * max_source_positions] -> encoder hidden states [B, positions, d_model]."""

    def __init__(self, model: tf.WhisperForConditionalGeneration):
        super().__init__()
        self.encoder = model.get_encoder()

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_features=input_features).last_hidden_state


class WhisperDecoder(torch.nn.Module):
    """(decoder input ids [B, T], encoder hidden states [B, S, d_model]) -> logits [B, T, vocab], without a cache:
    every call attends over the whole token prefix it is given."""

    def __init__(self, model: tf.WhisperForConditionalGeneration):
        super().__init__()
        self.decoder = model.model.decoder
        self.proj_out = model.proj_out

    def forward(self, input_ids: torch.Tensor, encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.decoder(input_ids=input_ids, encoder_hidden_states=encoder_hidden_states, use_cache=False)
        return self.proj_out(out.last_hidden_state)


__all__ = ["DECODERS", "GEMMA3_IMAGE_WORDS", "VOXTRAL_WORDS", "ViTOutputs", "WhisperDecoder", "WhisperEncoder",
           "gemma3_image_tokenizer", "tiny_decoder", "tiny_gemma3_vision", "tiny_vit", "tiny_voxtral", "tiny_whisper",
           "voxtral_tokenizer", "word_tokenizer"]
