"""Text <-> token ids for an exported language model, from the tokenizer.json and chat template in its program.

The `tokenizers` package reads a Hugging Face tokenizer.json (the whole pipeline: normalizer, pre-tokenizer, model,
post-processor, decoder), so encoding and decoding match transformers' fast tokenizer without torch or
transformers. Chat templates are Jinja, rendered the way transformers' `apply_chat_template` renders them
(a sandboxed environment with trim_blocks and lstrip_blocks, its `raise_exception`, `tojson` and `strftime_now`
helpers, the special tokens as variables) and then encoded without adding special tokens again, as transformers
does: the template writes the BOS token itself when the model wants one.

Both packages are optional dependencies of the runtime (`pip install kiln[llm]`), imported when first needed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from kiln.errors import InputError

Message = Mapping[str, Any]
"""A chat message: {"role": "system" | "user" | "assistant" | ..., "content": str, ...}."""


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ImportError("kiln.llm needs the 'tokenizers' package to turn text into token ids; install it with "
                          "`pip install tokenizers` (or `pip install kiln[llm]`; neither needs torch)") from None
    return tokenizers


def _jinja2() -> Any:
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise ImportError("kiln.llm needs the 'jinja2' package to render the model's chat template; install it with "
                          "`pip install jinja2` (or `pip install kiln[llm]`)") from None
    version = tuple(int(p) if p.isdigit() else 0 for p in jinja2.__version__.split(".")[:3])
    if version < (3, 1, 6):  # chat templates are untrusted code; older versions have known sandbox escapes
        raise ImportError(f"kiln.llm needs jinja2 >= 3.1.6 to render chat templates safely, found "
                          f"{jinja2.__version__}; upgrade it with `pip install -U jinja2`")
    return jinja2


def _plain(value: Any) -> Any:
    """A copy of `value` made of plain JSON types only, so a template sees no object with methods of its own."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    for kind in (bool, str, int, float):  # subclasses (enums, NumPy scalars) back to the base type
        if isinstance(value, kind):
            return kind(value)
    if hasattr(value, "item"):
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def compile_chat_template(template: str) -> Any:
    """A jinja2 Template configured as transformers configures chat templates (see the module docstring)."""
    jinja2 = _jinja2()

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for transformers' training masks; when
        rendering for inference it is just its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters; transformers overrides it with plain json.dumps
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise InputError(f"the program's chat template is not valid Jinja (line {e.lineno}: {e.message}); "
                         "re-export the model with a working template") from None


class IncrementalDetokenizer:
    """Token ids in one at a time, text out as soon as it is complete: for printing a generation as it streams.

    Decoding each token alone is wrong for most tokenizers: a SentencePiece-style decoder strips the space before
    a text's first word, and a byte-level token may hold half of a multi-byte UTF-8 character. So each step decodes
    a short window (the tokens since the last emitted text plus the ones before them, for context) and emits what
    that window's text gained; while the text ends in an incomplete character ("\\ufffd") it holds it back.
    The pieces joined equal `decode(all ids)` (the algorithm vLLM and text-generation-inference use).
    """

    def __init__(self, tokenizer: LLMTokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        """Everything emitted so far."""
        self._prefix = 0  # window start: the tokens of the last emitted piece (context for the decoder)
        self._read = 0  # tokens before this have been emitted

    def push(self, token_id: int) -> str:
        """Add one token; returns the text it completes ("" while a character or word is still incomplete)."""
        self.ids.append(int(token_id))
        return self._emit(final=False)

    def finish(self) -> str:
        """The text still held back at the end (an incomplete character decodes as "\\ufffd", as decode does)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read == len(self.ids):
            return ""
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix:self._read], self.skip_special_tokens)
        after = decode(self.ids[self._prefix:], self.skip_special_tokens)
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        piece = after[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += piece
        return piece


class LLMTokenizer:
    """A language model's tokenizer: encode, decode, stream-decode and chat-template rendering.

    tokenizer_json: the tokenizer.json text (a program's `kiln.llm.tokenizer_json` metadata).
    chat_template: the Jinja chat template, or None when the model has none (then only plain prompts work).
    special_tokens: the variables the template may use besides the messages: bos_token, eos_token, ...
    """

    def __init__(self, tokenizer_json: str, chat_template: str | None = None,
                 special_tokens: Mapping[str, str] | None = None):
        tk = _tokenizers()
        try:
            self._tok = tk.Tokenizer.from_str(tokenizer_json)
        except Exception as e:  # tokenizers raises a bare Exception for malformed JSON
            raise InputError(f"the program's tokenizer.json cannot be read by `tokenizers` {tk.__version__}: {e}; "
                             "upgrade tokenizers or re-export the model with `kiln export-llm`") from None
        self.chat_template = chat_template
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self._template: Any = None

    @classmethod
    def from_info(cls, info: Any) -> LLMTokenizer:
        """From an LLMInfo whose tokenizer_json is set."""
        if info.tokenizer_json is None:
            raise InputError("this program carries no tokenizer, so it takes token ids only; re-export the model "
                             "with `kiln export-llm` from a checkpoint that has a tokenizer.json")
        return cls(info.tokenizer_json, info.chat_template, info.special_tokens)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included (a model's logits may be padded beyond this)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        """The id of one token (e.g. "<|im_end|>"), or None when the vocabulary lacks it."""
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. add_special_tokens: apply the tokenizer's post-processor (e.g. prepend BOS), as
        transformers' `tokenizer(text)` does for a plain prompt; a rendered chat template already has them."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`; special tokens (BOS, EOS, chat markers) are left out unless asked for."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A fresh streaming decoder (see IncrementalDetokenizer)."""
        return IncrementalDetokenizer(self, skip_special_tokens)

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True, **variables: Any) -> str:
        """The chat template applied to `messages`: the prompt text, as transformers'
        `apply_chat_template(messages, tokenize=False)` gives it.

        add_generation_prompt: end with the header of an assistant turn, so the model writes the reply.
        variables: more template variables (e.g. tools=[...], enable_thinking=False), as transformers passes them.
        """
        if not self.chat_template:
            raise InputError("this program has no chat template, so it cannot format chat messages; give a plain "
                             "prompt instead, or re-export a chat (instruct) model with `kiln export-llm`")
        for message in messages:
            if not isinstance(message, Mapping) or "role" not in message:
                raise InputError(f"a chat message is a mapping with 'role' and 'content', got {message!r}")
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        context = {"tools": None, "documents": None, **self.special_tokens, **variables}
        jinja2 = _jinja2()
        try:
            return self._template.render(messages=_plain(list(messages)), add_generation_prompt=add_generation_prompt,
                                         **_plain(context))
        except jinja2.exceptions.TemplateError as e:  # raise_exception() in the template, or a sandbox refusal
            raise InputError(f"the chat template refused these messages: {e}") from None

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                            **variables: Any) -> list[int]:
        """Token ids of the rendered chat (render_chat), encoded without adding special tokens again."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **variables), add_special_tokens=False)


__all__ = ["IncrementalDetokenizer", "LLMTokenizer", "Message", "compile_chat_template"]
