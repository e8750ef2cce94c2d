"""`kiln export-parakeet`: a NeMo Parakeet TDT .nemo archive to one .kiln file.

The recipe behind it is kiln.models.parakeet.export_parakeet; it needs torch and imports it in `run`.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

from kiln.cli.common import CliError
from kiln.cli.export_cmd import write_program

HELP = "export a NeMo Parakeet TDT speech recognizer (.nemo archive) for `kiln transcribe`"
DESCRIPTION = """\
Export a Parakeet TDT model (NeMo's FastConformer encoder with a token-and-duration transducer, such as
parakeet-tdt-0.6b-v2) to one .kiln file with everything `kiln transcribe` needs without torch or NeMo: `encode`
(the encoder over NeMo's log-mel features, its frames projected for the joint), `predict` (the LSTM prediction
network, one token) and `joint` (token, blank and duration scores), and the vocabulary and decoding settings in
the file's metadata. The .nemo archive (model_config.yaml + model_weights.ckpt) is read by kiln itself."""
EPILOG = """\
examples:
  kiln export-parakeet parakeet-tdt-0.6b-v2.nemo -o parakeet.kiln
  kiln export-parakeet model.nemo -o parakeet.kiln --max-seconds 60
  kiln transcribe parakeet.kiln speech.wav
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export-parakeet", help=HELP, description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="NEMO", type=Path, help="the .nemo archive")
    p.add_argument("-o", "--output", required=True, type=Path, help="the .kiln file to write")
    p.add_argument("--max-seconds", type=float, default=120.0, metavar="S",
                   help="most audio one encoder call takes; longer audio is transcribed in windows of this length "
                        "(default: 120; the attention's memory grows with its square)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also print what each graph pass rewrote and the node counts")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    if not args.source.is_file():
        raise CliError(f"{args.source} is not a file: give a .nemo archive")
    if args.max_seconds < 1:
        raise CliError(f"--max-seconds must be at least 1, got {args.max_seconds}")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
    print(f"loading {args.source}", flush=True)
    from kiln.models.parakeet import NemoArchiveError, export_parakeet  # torch: only this command pays for it

    try:
        builder = export_parakeet(args.source, max_frames=int(args.max_seconds * 100),
                                  progress=lambda message: print(f"  {message}", flush=True))
    except (NemoArchiveError, FileNotFoundError) as e:
        raise CliError(str(e)) from None
    write_program(builder, args.output, args.verbose, start)
    return 0
