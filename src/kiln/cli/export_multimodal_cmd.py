"""`kiln export-voxtral` and `kiln export-vlm`: multimodal checkpoint folders to one .kiln file each.

Both take a transformers checkpoint folder (the model and a fast tokenizer) and the decoder's cache options; the
recipes behind them (kiln.models.voxtral.export_voxtral, kiln.models.gemma3_vision.export_gemma3_vision) need torch,
imported in `run`. One table row per command.
"""

from __future__ import annotations

import argparse
import importlib
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from kiln.cli.common import CliError
from kiln.cli.export_cmd import write_program


@dataclass(frozen=True)
class MultimodalExport:
    name: str
    recipe: str  # "module:function", called as function(folder, max_context, prefill_chunk, quantize=...)
    model: str  # what the folder holds, for messages
    help: str
    description: str
    epilog: str
    chunk_default: int | None
    chunk_help: str
    context_help: str


EXPORTS = (
    MultimodalExport(
        name="export-voxtral", recipe="kiln.models.voxtral:export_voxtral", model="Voxtral",
        help="export a Voxtral speech-in, text-out model (checkpoint folder) for `kiln transcribe` / `generate "
             "--audio`",
        description="""\
Export a Voxtral model (a Whisper-style audio encoder, a projector and a Llama decoder) from a checkpoint folder to
one .kiln file: `encode` (a 30 s window of 128-bin log-mel features to 375 decoder embedding rows), `embed`,
`prefill_embeds` (a prompt from embedding rows, the audio placeholders' rows the encoder's), `prefill` and `decode`
over a KV cache in state buffers, with the tokenizer and Voxtral's prompt tokens in the file's metadata. The folder's
tokenizer (Mistral's tekken.json, as Voxtral checkpoints ship it, or a tokenizer.json) must have Voxtral's prompt
tokens ([INST], [/INST], [BEGIN_AUDIO], [AUDIO], [TRANSCRIBE]); it is stored as a tokenizer.json.""",
        epilog="""\
examples:
  kiln export-voxtral Voxtral-Mini-3B-2507/ -o voxtral.kiln --quantize int4
  kiln transcribe voxtral.kiln speech.wav
  kiln generate voxtral.kiln --audio speech.wav --prompt "What is the speaker asking for?"
""",
        chunk_default=128, chunk_help="most prompt rows one prefill call takes (default: 128)",
        context_help="decoder cache positions: each 30 s of audio takes 375, plus the prompt and the answer "
                     "(default: 2048)"),
    MultimodalExport(
        name="export-vlm", recipe="kiln.models.gemma3_vision:export_gemma3_vision", model="Gemma 3",
        help="export an image-and-text model (Gemma 3 with images, checkpoint folder) for `kiln generate --image`",
        description="""\
Export Gemma 3 with images (a SigLIP vision tower, a projector and the Gemma 3 decoder) from a checkpoint folder to
one .kiln file: `encode_image` (the preprocessed image to its mm_tokens_per_image decoder rows), `embed`,
`prefill_embeds` (a prompt from embedding rows, an image's tokens attending each other both ways), `prefill` and
`decode` over a KV cache in state buffers, with the tokenizer, the image tokens and the preprocessing settings in
the file's metadata. `kiln generate PROGRAM --image FILE --prompt TEXT` then preprocesses the image without torch.""",
        epilog="""\
examples:
  kiln export-vlm gemma-3-4b-it/ -o gemma3.kiln --quantize int4
  kiln generate gemma3.kiln --image photo.jpg --prompt "Describe this image."
""",
        chunk_default=None, chunk_help="most prompt rows one prefill call takes, at least an image's tokens + 2 "
                                       "(default: those + 64)",
        context_help="decoder cache positions: an image takes mm_tokens_per_image (256) + 3, plus the prompt and "
                     "the answer (default: 2048)"),
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    for spec in EXPORTS:
        p = sub.add_parser(spec.name, help=spec.help, description=spec.description, epilog=spec.epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("source", metavar="FOLDER", type=Path, help="the checkpoint folder")
        p.add_argument("-o", "--output", required=True, type=Path, help="the .kiln file to write")
        p.add_argument("--max-context", type=int, default=2048, metavar="N", help=spec.context_help)
        p.add_argument("--prefill-chunk", type=int, default=spec.chunk_default, metavar="N", help=spec.chunk_help)
        p.add_argument("--quantize", choices=("int8", "int4"), help="weight-only quantization of the linear weights")
        p.add_argument("-v", "--verbose", action="store_true",
                       help="also print what each graph pass rewrote and the node counts")
        p.set_defaults(handler=run, export=spec)


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    spec: MultimodalExport = args.export
    if not args.source.is_dir():
        raise CliError(f"{args.source} is not a folder: give a {spec.model} checkpoint folder")
    if args.prefill_chunk is not None and not 1 <= args.prefill_chunk <= args.max_context:
        raise CliError(f"--prefill-chunk must be in 1..--max-context ({args.max_context}), got {args.prefill_chunk}")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
    print(f"loading {args.source}", flush=True)
    module, function = spec.recipe.split(":")
    recipe = getattr(importlib.import_module(module), function)  # torch: only these commands pay for it
    try:
        builder = recipe(args.source, args.max_context, args.prefill_chunk, quantize=args.quantize)
    except (OSError, ValueError) as e:
        raise CliError(str(e)) from None
    write_program(builder, args.output, args.verbose, start)
    return 0
