"""`kiln export-llm`: a transformers decoder-only LM (checkpoint folder or GGUF file) to one .kiln file.

The recipe behind it is kiln.models.llm.export_llm; like `kiln export` it needs torch and imports it in `run`.
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings
from pathlib import Path

from kiln.cli.common import CliError
from kiln.cli.export_cmd import add_quantize_arguments, quantize_option, write_program

HELP = "export a Hugging Face decoder-only language model (folder or .gguf) for `kiln generate`"
DESCRIPTION = """\
Export a transformers causal language model to one .kiln file with everything needed to generate text without
torch: `prefill` and `decode` methods sharing a static KV cache (state buffers; ring buffers for sliding-window
layers), and the tokenizer, chat template and stop tokens in the file's metadata.

SOURCE is a checkpoint folder (config.json + weights + tokenizer files) or a .gguf file, both read by
transformers' own loaders. A GGUF file's quantized weights are stored as the file holds them, bit for bit (Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q2_K..Q6_K; types kiln has no exact format for, such as the IQ family, are
re-quantized to int4/int8 with a warning); --dequantize stores floats instead, --quantize re-quantizes all.
Tested families: Llama, Qwen2, Qwen3, Gemma 1/2/3, Mistral, Phi-3, GPT-2."""
EPILOG = """\
examples:
  kiln export-llm SmolLM2-135M-Instruct.Q4_1.gguf -o smollm2.kiln    # keeps the file's Q4_1 and Q8_0
  kiln export-llm SmolLM2-135M-Instruct.Q4_1.gguf -o smollm2-f32.kiln --dequantize
  kiln export-llm ./Qwen2.5-0.5B-Instruct -o qwen.kiln --max-context 4096 --quantize int8
  kiln export-llm model.gguf -o model-int4.kiln --quantize int4 --group-size 32
  kiln generate smollm2.kiln --chat --prompt "What is the capital of France?"
  kiln export-llm model.gguf -o serve.kiln --slots 8    # for `kiln serve`: 8 streams decoded together
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export-llm", help=HELP, description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="SOURCE", type=Path, help="a checkpoint folder or a .gguf file")
    p.add_argument("-o", "--output", required=True, type=Path, help="the .kiln file to write")
    p.add_argument("--max-context", type=int, metavar="N",
                   help="KV-cache length in tokens, prompt and answer together (default: the model's maximum, at "
                        "most 2048); memory grows linearly with it")
    p.add_argument("--prefill-chunk", type=int, default=128, metavar="N",
                   help="most prompt tokens one prefill call takes; longer prompts run in chunks (default: 128)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="compute and cache dtype (default: float32, what the CPU runtime is fastest at)")
    p.add_argument("--tokenizer", type=Path, metavar="PATH",
                   help="load the tokenizer from here instead of beside the model")
    p.add_argument("--slots", type=int, metavar="N",
                   help="a KV cache for N sequences at once, decoded together in one batched step: what `kiln "
                        "serve` needs to serve N streams concurrently (cache memory grows N times); default: one "
                        "sequence")
    add_quantize_arguments(p)
    p.add_argument("--dequantize", action="store_true",
                   help="for a .gguf SOURCE: store its weights as float (--dtype) instead of keeping the file's "
                        "quantization")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also print what each graph pass rewrote and the node counts")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    quantize = quantize_option(args)
    if not args.source.exists():
        raise CliError(f"{args.source} does not exist: give a checkpoint folder or a .gguf file")
    if args.prefill_chunk < 1 or (args.max_context is not None and args.max_context < 1):
        raise CliError("--max-context and --prefill-chunk must be positive")
    if args.slots is not None and args.slots < 1:
        raise CliError(f"--slots must be at least 1, got {args.slots}")
    if args.dequantize and (quantize is not None or args.source.suffix != ".gguf"):
        raise CliError("--dequantize applies to a .gguf SOURCE without --quantize (which re-quantizes every weight "
                       "from the file's dequantized values)")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
    logging.basicConfig(format="  %(message)s")
    logging.getLogger("kiln.models.llm").setLevel(logging.INFO)
    print(f"loading {args.source} (transformers)", flush=True)
    from kiln.models.llm import export_llm  # torch and transformers: only this command pays for them

    try:
        builder = export_llm(args.source, max_context=args.max_context, prefill_chunk=args.prefill_chunk,
                             dtype=args.dtype, quantize=quantize, tokenizer=args.tokenizer, slots=args.slots,
                             dequantize=args.dequantize,
                             progress=lambda message: print(f"  {message}", flush=True))
    except (ValueError, OSError, NotImplementedError) as e:  # (GGUFFormatError is a ValueError)
        raise CliError(str(e)) from None
    write_program(builder, args.output, args.verbose, start)
    return 0
