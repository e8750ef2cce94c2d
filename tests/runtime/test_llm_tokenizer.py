"""kiln.llm.LLMTokenizer: encoding and decoding as transformers' fast tokenizer does, chat templates rendered as
`apply_chat_template` renders them, and the streaming detokenizer's pieces adding up to the full decode."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402

from kiln.errors import InputError  # noqa: E402
from kiln.llm import LLMTokenizer  # noqa: E402

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
TEXTS = ["Hello world", "héllo wörld, naïve café", "日本語のテキスト", "emoji 🙂🚀 and ü", "  spaces\tand\nlines ",
         "a"]

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
          " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
          "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
          "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
          "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{% if loop.index0 == 0 and system_message != false %}"
          "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
          "{% else %}{% set content = message['content'] %}{% endif %}"
          "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
          "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
          "{% endfor %}")
BLOCKY = """\
{%- set ns = namespace(systems=0) %}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% set ns.systems = ns.systems + 1 %}
        {% continue %}
    {% endif %}
<|im_start|>{{ message['role'] }}
    {% if message['role'] == 'assistant' %}
{% generation %}{{ message['content'] }}{% endgeneration %}
    {% else %}
{{ message['content'] }}
    {% endif %}
<|im_end|>
{% endfor %}
{{ {"systems": ns.systems, "note": "é<b>&"} | tojson }}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""
"""Block tags on their own lines (trim_blocks, lstrip_blocks), namespace, loop controls, tojson, generation."""

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": " Hello! "}, {"role": "user", "content": "Née à Zürich?"}]


def word_level() -> Tokenizer:
    from kiln.models.zoo import tiny_tokenizer

    pytest.importorskip("transformers")
    return tiny_tokenizer().backend_tokenizer


def byte_level() -> Tokenizer:
    """GPT-2 style: byte-level BPE trained on a little text, so multi-byte characters span several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<s>", "</s>", "<unk>"], show_progress=False)
    tok.train_from_iterator(["hello world " * 5, "the cat sat on the mat", "wörld café"], trainer)
    return tok


def sentencepiece_like() -> Tokenizer:
    """Llama 2 style: '▁' for spaces, a BOS post-processor, byte fallback (<0xNN> tokens) for characters outside
    the vocabulary, and a decoder that strips the space before the first word."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyzHW,.!?", "▁h", "▁he", "ll", "llo", "▁w", "or", "▁wor", "ld"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "h"), ("▁h", "e"), ("l", "l"), ("ll", "o"), ("▁", "w"), ("o", "r"), ("▁w", "or"), ("l", "d")]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<s>", "</s>", "<unk>"])
    return tok


TOKENIZERS = {"word_level": word_level, "byte_level": byte_level, "sentencepiece_like": sentencepiece_like}


def transformers_tokenizer(backend: Tokenizer, template: str | None = None):
    tf = pytest.importorskip("transformers")
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(backend.to_str()), **SPECIAL)
    tok.chat_template = template
    return tok


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_encode_and_decode_match_transformers(name):
    backend = TOKENIZERS[name]()
    ours, theirs = LLMTokenizer(backend.to_str()), transformers_tokenizer(backend)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"]
        assert ours.encode(text, add_special_tokens=False) == theirs(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_streamed_pieces_add_up_to_the_decoded_text(name):
    tok = LLMTokenizer(TOKENIZERS[name]().to_str())
    for text in TEXTS + ["".join(TEXTS)]:
        ids = tok.encode(text, add_special_tokens=False)
        stream = tok.detokenizer()
        pieces = [stream.push(i) for i in ids]
        tail = stream.finish()
        assert "".join(pieces) + tail == tok.decode(ids) == stream.text
        assert not any("\ufffd" in piece for piece in pieces), pieces  # never half a character
        assert tail == ""  # the text was complete, so nothing was held back at the end
    if name != "word_level":  # multi-byte characters really were split across tokens
        ids = tok.encode("日本", add_special_tokens=False)
        assert any("\ufffd" in tok.decode(ids[:k]) for k in range(1, len(ids)))


def test_streaming_ends_with_what_decode_gives_for_a_cut_character():
    tok = LLMTokenizer(byte_level().to_str())
    ids = tok.encode("ok 日本", add_special_tokens=False)[:-1]  # the last character's final byte is missing
    stream = tok.detokenizer()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) == "ok 日"
    assert stream.finish() == "\ufffd" and stream.text == tok.decode(ids)


def test_streaming_decodes_special_tokens_only_when_asked():
    tok = LLMTokenizer(sentencepiece_like().to_str())
    ids = tok.encode("hello world") + [2]
    stream = tok.detokenizer()
    assert "".join(stream.push(i) for i in ids) == "hello world"
    stream = tok.detokenizer(skip_special_tokens=False)
    assert "".join(stream.push(i) for i in ids) + stream.finish() == tok.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("template", [CHATML, LLAMA2, BLOCKY], ids=["chatml", "llama2", "blocky"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_as_transformers_does(template, add_generation_prompt):
    backend = sentencepiece_like()
    ours = LLMTokenizer(backend.to_str(), template, SPECIAL)
    theirs = transformers_tokenizer(backend, template)
    messages = CONVERSATION if template != LLAMA2 else CONVERSATION[:4]
    want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.render_chat(messages, add_generation_prompt=add_generation_prompt) == want
    want_ids = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    want_ids = want_ids["input_ids"] if isinstance(want_ids, Mapping) else want_ids
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == want_ids
    if template == LLAMA2:  # the template writes BOS itself; encoding did not add another
        assert want_ids[0] == 1 and want_ids[1] != 1


def test_template_variables_pass_through():
    template = "{% if enable_thinking %}think {% endif %}{{ messages[0]['content'] }} {{ eos_token }}"
    tok = LLMTokenizer(sentencepiece_like().to_str(), template, SPECIAL)
    assert tok.render_chat([{"role": "user", "content": "hi"}], enable_thinking=True) == "think hi </s>"
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "hi </s>"


def test_template_errors_are_explained():
    tok = LLMTokenizer(sentencepiece_like().to_str(), LLAMA2, SPECIAL)
    with pytest.raises(InputError, match="refused these messages: Conversation roles must alternate"):
        tok.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(InputError, match="mapping with 'role' and 'content'"):
        tok.render_chat(["hello"])
    with pytest.raises(InputError, match="no chat template"):
        LLMTokenizer(sentencepiece_like().to_str()).render_chat([{"role": "user", "content": "a"}])
    with pytest.raises(InputError, match="not valid Jinja"):
        LLMTokenizer(sentencepiece_like().to_str(), "{% for %}").render_chat([{"role": "user", "content": "a"}])


def test_the_sandbox_holds():
    """Chat templates come from model hubs: one that reaches for Python internals is refused, not run."""
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = LLMTokenizer(sentencepiece_like().to_str(), evil, SPECIAL)
    with pytest.raises(InputError, match="refused"):
        tok.render_chat([{"role": "user", "content": "a"}])


def test_unreadable_tokenizer_json_is_explained():
    with pytest.raises(InputError, match="tokenizer.json cannot be read"):
        LLMTokenizer('{"model": 3}')
