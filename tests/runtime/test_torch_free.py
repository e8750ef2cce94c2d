"""The runtime never imports torch: `import kiln`, `kiln.load` and a session run work in a process without it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.format import small_models

REPO = Path(__file__).resolve().parents[2]

RUN_SCRIPT = """
import sys
if sys.argv[3] == "blocked":
    sys.modules["torch"] = None  # any `import torch` now raises ImportError, even a lazy one inside a function
import kiln
assert "torch" not in sys.modules or sys.modules["torch"] is None, "import kiln imported torch"
import kiln.runtime
import numpy as np
program = kiln.load(sys.argv[1])
x = np.load(sys.argv[2] + ".in.npy", allow_pickle=False)
out = program.session().run("forward", x)[0]
np.save(sys.argv[2] + ".out.npy", out, allow_pickle=False)
print(program.info("forward").describe())
assert "torch" not in sys.modules or sys.modules["torch"] is None, "the runtime imported torch"
print("torch-free")
"""

LLM_SCRIPT = """
import sys
sys.modules["torch"] = None  # as above: any import of torch fails
import kiln.llm
import kiln.runtime.llm
from kiln.cli import main
generator = kiln.llm.Generator(sys.argv[1])
result = generator.generate(sys.argv[2], max_new_tokens=8, chat=True, temperature=0.8, top_k=50, seed=1)
chat = kiln.llm.ChatSession(generator, system="w1")
chat.ask("w2 w3")
assert main(["generate", sys.argv[1], "--prompt", sys.argv[2], "--max-new-tokens", "4"]) == 0
assert sys.modules["torch"] is None and not any(m.startswith("torch.") for m in sys.modules), "torch got in"
assert "transformers" not in sys.modules, "kiln.llm imported transformers"
print(result.token_ids)
print("torch-free")
"""


def run_python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.fixture(scope="module")
def program_path(tmp_path_factory) -> Path:
    return small_models.export_dynamic().save(tmp_path_factory.mktemp("torch_free") / "block.kiln")


@pytest.mark.parametrize("torch_state", ["installed", "blocked"])
def test_load_and_run_without_torch(program_path, tmp_path, torch_state):
    x = torch.randn(3, 6, 8)
    np.save(tmp_path / "io.in.npy", x.numpy(), allow_pickle=False)
    result = run_python("-c", RUN_SCRIPT, str(program_path), str(tmp_path / "io"), torch_state)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("torch-free")
    assert "forward(x: float32[batch, seq, 8])" in result.stdout
    with torch.no_grad():
        want = small_models.DynamicBlock()(x).numpy()
    np.testing.assert_allclose(np.load(tmp_path / "io.out.npy"), want, rtol=1e-5, atol=1e-5)


def test_import_kiln_alone_does_not_import_torch():
    result = run_python("-c", "import sys, kiln; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"


def test_the_check_can_see_torch():
    """The same check does see torch once the export half is used, so the tests above can fail."""
    result = run_python("-c", "import sys, kiln; kiln.export; print('torch' in sys.modules)")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "True"


def test_llm_generation_and_cli_without_torch(tmp_path):
    """kiln.llm (tokenizer, chat template, sampling, Generator, ChatSession) and `kiln generate` run with torch
    blocked, and transformers never loads."""
    pytest.importorskip("transformers")
    pytest.importorskip("jinja2")
    from kiln.llm import Generator
    from tests.runtime.tiny_llm import export_tiny_llm, words

    path = export_tiny_llm()[1].save(tmp_path / "llm.kiln")
    result = run_python("-c", LLM_SCRIPT, str(path), words(5, 6, 7))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("torch-free")
    want = Generator(path).generate(words(5, 6, 7), max_new_tokens=8, chat=True, temperature=0.8, top_k=50, seed=1)
    assert str(want.token_ids) in result.stdout


MEDIA_SCRIPT = """
import sys
sys.modules["torch"] = None  # as above: any import of torch fails
from kiln.cli import main
assert main(["generate", sys.argv[1], "--image", sys.argv[2], "--prompt", "w1 w2", "--max-new-tokens", "3"]) == 0
assert main(["generate", sys.argv[3], "--audio", sys.argv[4], "--prompt", "w1 w2", "--max-new-tokens", "3"]) == 0
assert main(["transcribe", sys.argv[3], sys.argv[4], "--max-new-tokens", "3"]) == 0
assert sys.modules["torch"] is None and not any(m.startswith("torch.") for m in sys.modules), "torch got in"
print("torch-free")
"""


def test_image_and_audio_programs_run_without_torch(tmp_path):
    """kiln generate --image / --audio and kiln transcribe of a Voxtral program, with torch blocked."""
    pytest.importorskip("transformers")
    matplotlib = pytest.importorskip("matplotlib")
    from kiln.models.gemma3_vision import export_gemma3_vision
    from kiln.models.voxtral import export_voxtral
    from kiln.models.zoo import gemma3_image_tokenizer, tiny_gemma3_vision, tiny_voxtral, voxtral_tokenizer
    from tests.runtime.test_audio import beckett_path

    picture = Path(matplotlib.__file__).parent / "mpl-data" / "sample_data" / "grace_hopper.jpg"
    image_program = export_gemma3_vision(tiny_gemma3_vision(), 64, 8, tokenizer=gemma3_image_tokenizer())
    audio_program = export_voxtral(tiny_voxtral(), 448, 64, tokenizer=voxtral_tokenizer())
    result = run_python("-c", MEDIA_SCRIPT, str(image_program.save(tmp_path / "g.kiln")), str(picture),
                        str(audio_program.save(tmp_path / "v.kiln")), str(beckett_path()))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("torch-free")
