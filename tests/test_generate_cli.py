"""`kiln generate` and `kiln chat` on a tiny exported Llama whose program carries its tokenizer and chat template."""

from __future__ import annotations

import importlib.util
import io

import pytest

pytest.importorskip("transformers")
pytest.importorskip("jinja2")

from kiln.cli import main  # noqa: E402
from kiln.llm import Generator  # noqa: E402
from tests.format import small_models  # noqa: E402
from tests.runtime.tiny_llm import export_tiny_llm, words  # noqa: E402

PROMPT = words(3, 5, 32, 33, 34, 35, 36, 37, 38, 39)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return export_tiny_llm()[1].save(tmp_path_factory.mktemp("llm") / "tiny.kiln")


def expected(path, prompt, max_new_tokens, **options) -> str:
    return Generator(path).generate(prompt, max_new_tokens, **options).text


def test_generate_prints_the_text_and_a_summary(model_path, capsys):
    assert main(["generate", str(model_path), "--prompt", PROMPT, "--max-new-tokens", "12"]) == 0
    out, err = capsys.readouterr()
    want = expected(model_path, PROMPT, 12)
    assert want and out == want + "\n"
    assert "prompt 10 tokens" in err and "prefill" in err and "decode" in err and "tokens/s" in err
    assert "stop: " in err


def test_generate_options(model_path, capsys, monkeypatch):
    args = ["generate", str(model_path), "--max-new-tokens", "8", "--temperature", "1.2", "--top-k", "20",
            "--top-p", "0.9", "--seed", "5", "--stop-token", "2", "4", "9"]
    assert main([*args, "--prompt", PROMPT]) == 0
    out = capsys.readouterr().out
    assert out == expected(model_path, PROMPT, 8, temperature=1.2, top_k=20, top_p=0.9, seed=5,
                           stop_token_ids=[2, 4, 9]) + "\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(PROMPT + "\n"))
    assert main([*args, "--prompt", "-"]) == 0
    assert capsys.readouterr().out == out  # the prompt from stdin, without its newline
    assert main(["generate", str(model_path), "--prompt", PROMPT, "--max-new-tokens", "3", "--stop-token", "0"]) == 0
    assert "stop: max_new_tokens" in capsys.readouterr().err


def test_generate_chat(model_path, capsys):
    assert main(["generate", str(model_path), "--chat", "--system", words(1), "--prompt", words(2, 3),
                 "--max-new-tokens", "6"]) == 0
    out, err = capsys.readouterr()
    want = expected(model_path, words(2, 3), 6, chat=True, system=words(1))
    assert out == want + "\n"
    assert "prompt 11 tokens" in err  # <|im_start|> system w1 <|im_end|> <|im_start|> user w2 w3 <|im_end|> ...


@pytest.mark.parametrize("args,message", [
    (["--temperature", "-1"], "bad sampling option: temperature must be"),
    (["--top-p", "0"], "top_p must be"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--system", "hi"], "--system adds a system message to a chat: add --chat"),
])
def test_generate_refuses_bad_options(model_path, capsys, args, message):
    assert main(["generate", str(model_path), "--prompt", PROMPT, *args]) == 2
    assert message in capsys.readouterr().err


def test_generate_explains_programs_that_cannot_generate_text(tmp_path, capsys):
    plain = small_models.export_dynamic().save(tmp_path / "block.kiln")
    assert main(["generate", str(plain), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "not a language model" in err and "kiln export-llm" in err
    no_tokenizer = export_tiny_llm(with_tokenizer=False)[1].save(tmp_path / "ids.kiln")
    assert main(["generate", str(no_tokenizer), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "carries no tokenizer" in err and "re-export the model with `kiln export-llm`" in err
    assert main(["chat", str(no_tokenizer)]) == 2
    assert main(["generate", str(tmp_path / "missing.kiln"), "--prompt", "hi"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_generate_refuses_a_prompt_longer_than_the_context(model_path, capsys):
    assert main(["generate", str(model_path), "--prompt", words(*range(70))]) == 2
    assert "the prompt has 70 tokens but the program's context holds 64" in capsys.readouterr().err


def chat(model_path, monkeypatch, capsys, lines: list[str], *args: str) -> tuple[list[str], str]:
    """(the replies printed, stderr) of `kiln chat` reading `lines` from stdin."""
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(line + "\n" for line in lines)))
    assert main(["chat", str(model_path), "--max-new-tokens", "6", *args]) == 0
    out, err = capsys.readouterr()
    replies = [line.replace("> ", "").strip() for line in out.splitlines()]  # input() prints its "> " prompt
    return [reply for reply in replies if reply], err


def test_chat_answers_each_line_and_clear_forgets(model_path, monkeypatch, capsys):
    replies, err = chat(model_path, monkeypatch, capsys, [words(4, 5), words(6), "/clear", words(4, 5), "/exit",
                                                          words(7)], "--stats")
    assert len(replies) == 3  # the line after /exit is never read
    assert replies[0] == replies[2]  # after /clear the same message gets the same (greedy) reply
    assert replies[0] == expected(model_path, words(4, 5), 6, chat=True)
    assert "(conversation cleared)" in err and err.count("new tokens") == 3
    assert "from cache" in err.splitlines()[2]  # the second turn reused the first one's cache


def test_chat_says_when_the_context_is_full_and_goes_on(model_path, monkeypatch, capsys):
    long = words(*range(10, 35))  # 25 words: with the system message the first turn takes 34 tokens, a second
    replies, err = chat(model_path, monkeypatch, capsys, [long, long, "/clear", long], "--system", words(1))
    assert "the context is full" in err and "/clear" in err
    assert len(replies) == 2
    replies, err = chat(model_path, monkeypatch, capsys, ["/nonsense"])  # and EOF ends the chat
    assert "unknown command /nonsense" in err


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_help_has_examples(command, capsys):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "--temperature" in out and "export-llm" in out


@pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="needs MLX")
def test_generate_and_chat_on_mlx_give_the_cpu_text(model_path, monkeypatch, capsys):
    assert main(["generate", str(model_path), "--prompt", PROMPT, "--max-new-tokens", "12", "--backend", "mlx"]) == 0
    out, err = capsys.readouterr()
    assert out == expected(model_path, PROMPT, 12) + "\n" and "tokens/s" in err
    replies, _ = chat(model_path, monkeypatch, capsys, [words(4, 5)], "--backend", "mlx")
    assert replies == [expected(model_path, words(4, 5), 6, chat=True)]


def test_an_unknown_backend_is_refused_with_the_choices(model_path, capsys):
    assert main(["generate", str(model_path), "--prompt", PROMPT, "--backend", "metal"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'metal'" in err and "'mlx'" in err
