"""`kiln export-voxtral`: a Voxtral checkpoint folder (transformers' VoxtralForConditionalGeneration) to one .kiln
file for `kiln transcribe` and `kiln generate --audio`.

The recipe behind it is kiln.models.voxtral.export_voxtral; it needs torch and imports it in `run`.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

from kiln.cli.common import CliError
from kiln.cli.export_cmd import write_program

HELP = "export a Voxtral speech-in, text-out model (checkpoint folder) for `kiln transcribe` / `generate --audio`"
DESCRIPTION = """\
Export a Voxtral model (a Whisper-style audio encoder, a projector and a Llama decoder) from a checkpoint folder to
one .kiln file: `encode` (a 30 s window of 128-bin log-mel features to 375 decoder embedding rows), `embed`,
`prefill_embeds` (a prompt from embedding rows, the audio placeholders' rows the encoder's), `prefill` and `decode`
over a KV cache in state buffers, with the tokenizer and Voxtral's prompt tokens in the file's metadata. The folder
needs a fast tokenizer (tokenizer.json) with Voxtral's prompt tokens ([INST], [/INST], [BEGIN_AUDIO], [AUDIO],
[TRANSCRIBE]); Mistral's own tekken.json alone is not read yet."""
EPILOG = """\
examples:
  kiln export-voxtral Voxtral-Mini-3B-2507/ -o voxtral.kiln --quantize int4
  kiln transcribe voxtral.kiln speech.wav
  kiln generate voxtral.kiln --audio speech.wav --prompt "What is the speaker asking for?"
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export-voxtral", help=HELP, description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="FOLDER", type=Path, help="the checkpoint folder")
    p.add_argument("-o", "--output", required=True, type=Path, help="the .kiln file to write")
    p.add_argument("--max-context", type=int, default=2048, metavar="N",
                   help="decoder cache positions: each 30 s of audio takes 375, plus the prompt and the answer "
                        "(default: 2048)")
    p.add_argument("--prefill-chunk", type=int, default=128, metavar="N",
                   help="most prompt rows one prefill call takes (default: 128)")
    p.add_argument("--quantize", choices=("int8", "int4"), help="weight-only quantization of the linear weights")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also print what each graph pass rewrote and the node counts")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    if not args.source.is_dir():
        raise CliError(f"{args.source} is not a folder: give a Voxtral checkpoint folder")
    if not 1 <= args.prefill_chunk <= args.max_context:
        raise CliError(f"--prefill-chunk must be in 1..--max-context ({args.max_context}), got {args.prefill_chunk}")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
    print(f"loading {args.source}", flush=True)
    from kiln.models.voxtral import export_voxtral  # torch: only this command pays for it

    try:
        builder = export_voxtral(args.source, args.max_context, args.prefill_chunk, quantize=args.quantize)
    except (OSError, ValueError) as e:
        raise CliError(str(e)) from None
    write_program(builder, args.output, args.verbose, start)
    return 0
