"""`kiln inspect` with long metadata values (an LLM's tokenizer JSON): shown cut short in the summary, one printed
in full with --metadata KEY, all in full with --json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import kiln
from kiln.cli.inspect_cmd import PREVIEW_CHARS
from tests.test_cli import cli

BIG = json.dumps({"model": {"vocab": {f"token{k}": k for k in range(20000)}}}, indent=1)
"""A tokenizer-like value: a few hundred KB, many lines."""
TEMPLATE = "{% for m in messages %}\n" + "<|{{ m.role }}|>{{ m.content }}\n" * 20 + "{% endfor %}"


@pytest.fixture(scope="module")
def program_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("inspect") / "meta.kiln"
    metadata = {"kiln.llm.tokenizer_json": BIG, "kiln.llm.chat_template": TEMPLATE, "origin": "test"}
    kiln.export(torch.nn.Linear(4, 2), (torch.randn(1, 4),), metadata=metadata).save(path)
    return path


def test_long_values_are_cut_short_with_their_size_and_how_to_see_them(program_path):
    code, out, _ = cli("inspect", program_path)
    assert code == 0
    assert len(out) < 5000, len(out)
    assert "origin: test" in out
    (line,) = [x for x in out.splitlines() if "kiln.llm.tokenizer_json:" in x]
    assert line.endswith(f"... ({len(BIG.encode())} bytes; --metadata kiln.llm.tokenizer_json prints it)")
    assert "token1999" not in out
    # a multi-line value stays on its line, its first characters shown with newlines escaped
    (line,) = [x for x in out.splitlines() if "kiln.llm.chat_template:" in x]
    assert line.split(": ", 1)[1].startswith(TEMPLATE[:PREVIEW_CHARS].replace("\n", "\\n"))
    assert "method forward:" in out  # the rest of the summary is still there


def test_metadata_flag_prints_one_value_in_full(program_path):
    code, out, _ = cli("inspect", program_path, "--metadata", "kiln.llm.tokenizer_json")
    assert code == 0
    assert out == BIG + "\n"
    assert json.loads(out)["model"]["vocab"]["token19999"] == 19999
    assert cli("inspect", program_path, "--metadata", "origin")[1] == "test\n"


def test_metadata_flag_with_a_missing_key_lists_the_keys(program_path):
    code, out, err = cli("inspect", program_path, "--metadata", "kiln.llm.tokenizer")
    assert code == 2 and out == ""
    assert "no metadata key 'kiln.llm.tokenizer'" in err
    assert "kiln.llm.tokenizer_json" in err and "origin" in err
    assert "Traceback" not in err


def test_json_keeps_every_value_whole(program_path):
    info = json.loads(cli("inspect", program_path, "--json")[1])
    assert info["metadata"]["kiln.llm.tokenizer_json"] == BIG
    assert info["metadata"]["kiln.llm.chat_template"] == TEMPLATE


def test_help_describes_the_flag():
    code, out, _ = cli("inspect", "--help")
    assert code == 0
    assert "--metadata KEY" in out and "in full" in out
