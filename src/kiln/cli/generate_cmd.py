"""`kiln generate`: complete a prompt with an exported language model, printing the text as it is produced.

Torch-free: it needs the program (from `kiln export-llm`) and the `tokenizers` and `jinja2` packages. The sampling
and model options here are shared with `kiln chat` (chat_cmd.py).
"""

from __future__ import annotations

import argparse
import sys
import time

from kiln.cli.common import CliError, add_backend_argument, load_program
from kiln.runtime.llm import Generator, Sampler, Stream

HELP = "generate text from a prompt with a language model exported by `kiln export-llm`"
DESCRIPTION = """\
Generate text with a language model exported by `kiln export-llm`, without PyTorch. The prompt is encoded with
the tokenizer stored in the file; with --chat it becomes a user message (after an optional --system message)
formatted by the model's chat template, as transformers' apply_chat_template does. The text is printed as it is
generated; a summary (prompt tokens, prefill speed, new tokens, decode speed, why it stopped) goes to stderr.

Decoding is greedy by default (--temperature 0); with a temperature above 0 tokens are sampled, after the top-k
and then the top-p (nucleus) filter, and --seed makes the sample reproducible. Generation stops at one of the
program's stop tokens (or the --stop-token ids given instead), after --max-new-tokens, or when the context (the
exported --max-context) is full.

With --audio (a program from `kiln export-voxtral`) the prompt is a question about the WAV file: each 30 s of
audio becomes 375 embedding rows of the prompt, before the question, in Voxtral's prompt format; the answer is
decoded greedily. With --image (a program from `kiln export-vlm`) the prompt is about the image: it is resized and
normalized as the model's processor does, without torch, and its tokens come before the prompt's; greedy too."""
EPILOG = """\
examples:
  kiln generate smollm2.kiln --prompt "The capital of France is"
  kiln generate smollm2.kiln --chat --prompt "Write a haiku about the sea." --temperature 0.7 --seed 1
  kiln generate qwen.kiln --chat --system "Answer in one word." --prompt "Largest planet?"
  echo "Once upon a time" | kiln generate smollm2.kiln --prompt - --max-new-tokens 64
  kiln generate voxtral.kiln --audio meeting.wav --prompt "Who speaks first?"
  kiln generate gemma3.kiln --image photo.jpg --prompt "What is in the picture?"
"""


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="the .kiln file, made by `kiln export-llm`")
    add_backend_argument(p)


def add_sampling_arguments(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """The generation options `kiln generate` and `kiln chat` share."""
    g = p.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int, default=max_new_tokens, metavar="N",
                   help=f"the most tokens to generate (default: {max_new_tokens})")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 picks the most likely token (greedy, the default); higher samples more freely")
    g.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample among the K most likely tokens only (default: 0, all)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="then among the most likely tokens that make up probability P (default: 1.0, all)")
    g.add_argument("--seed", type=int, metavar="N", help="seed for sampling, to reproduce a sample")
    g.add_argument("--stop-token", type=int, action="extend", nargs="+", metavar="ID", dest="stop_tokens",
                   help="token id(s) that end the generation, instead of the program's own stop tokens")
    g.add_argument("--system", metavar="TEXT", help="a system message before the conversation (chat only)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help=HELP, description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("-p", "--prompt", required=True, metavar="TEXT",
                   help="the prompt; '-' reads it from stdin (without its final newlines)")
    p.add_argument("--chat", action="store_true", help="format the prompt as a user message with the chat template")
    media = p.add_mutually_exclusive_group()
    media.add_argument("--audio", metavar="WAV", help="a WAV file the prompt asks about (a Voxtral program, from "
                                                      "`kiln export-voxtral`; greedy decoding)")
    media.add_argument("--image", metavar="FILE", help="an image the prompt asks about (a program from `kiln "
                                                       "export-vlm`; greedy decoding)")
    add_sampling_arguments(p, max_new_tokens=128)
    p.set_defaults(handler=run)


def make_sampler(args: argparse.Namespace) -> Sampler:
    if args.max_new_tokens < 1:
        raise CliError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    try:
        return Sampler(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as e:
        raise CliError(f"bad sampling option: {e}") from None


def make_generator(args: argparse.Namespace) -> Generator:
    """The Generator for args.model; a program that cannot generate text is a user error with the fix in it."""
    generator = Generator(load_program(args.model), args.backend)  # InputError when it is not a language model
    if generator.tokenizer is None:
        raise CliError(f"{args.model} carries no tokenizer, so it cannot turn text into tokens; re-export the model "
                       "with `kiln export-llm` from a checkpoint folder or GGUF file that has one")
    return generator


def print_stream(stream: Stream) -> None:
    """Write the text to stdout as it arrives (flushed, so a terminal or a pipe sees each piece at once)."""
    for event in stream:
        if event.text:
            sys.stdout.write(event.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    sampler = make_sampler(args)
    if args.system is not None and not args.chat:
        raise CliError("--system adds a system message to a chat: add --chat")
    prompt = sys.stdin.read().rstrip("\n") if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise CliError("the prompt is empty" + (" (nothing on stdin)" if args.prompt == "-" else ""))
    if args.audio is not None or args.image is not None:
        return answer_media(args, prompt)
    generator = make_generator(args)
    stream = generator.stream(prompt, args.max_new_tokens, sampler, stop_token_ids=args.stop_tokens,
                              chat=args.chat, system=args.system)
    print_stream(stream)
    print(stream.stats.summary(), file=sys.stderr)
    return 0


def answer_media(args: argparse.Namespace, question: str) -> int:
    """--audio / --image: the Voxtral or image-and-text program's greedy answer to `question` about the file."""

    sampling = [flag for flag, given in (("--chat", args.chat), ("--system", args.system is not None),
                                         ("--temperature", args.temperature != 0.0), ("--top-k", args.top_k != 0),
                                         ("--top-p", args.top_p != 1.0), ("--seed", args.seed is not None),
                                         ("--stop-token", args.stop_tokens is not None)) if given]
    flag = "--audio" if args.audio is not None else "--image"
    if sampling:
        raise CliError(f"{', '.join(sampling)}: a question about {flag} is answered greedily, with the program's "
                       "own prompt format and stop tokens")
    started = time.perf_counter()
    if args.audio is not None:
        from kiln.cli.transcribe_cmd import read_audio
        from kiln.runtime.audio import SAMPLE_RATE
        from kiln.runtime.speech import VoxtralTranscriber

        samples = read_audio(args.audio)  # first: a bad WAV is refused before a large model is loaded
        model = VoxtralTranscriber(load_program(args.model), args.backend)  # InputError: not a Voxtral program
        ids = model.generate(samples, question, args.max_new_tokens)
        what = f"{len(samples) / SAMPLE_RATE:.1f} s of audio"
    else:
        from kiln.runtime.image_text import ImageTextModel
        from kiln.runtime.vision import load_image

        try:
            image = load_image(args.image)  # (an unreadable image: ImageFormatError, a user error)
        except FileNotFoundError as e:
            raise CliError(str(e)) from None
        model = ImageTextModel(load_program(args.model), args.backend)  # InputError: not an image-and-text program
        ids = model.generate(image, question, args.max_new_tokens)
        what = f"a {image.size[0]}x{image.size[1]} image"
    answer = [t for t in ids if t not in model.llm.stop_token_ids]
    print(model.tokenizer.decode(answer, skip_special_tokens=True).strip() if model.tokenizer else answer)
    seconds = time.perf_counter() - started
    print(f"{what}, {len(ids)} new tokens in {seconds:.2f} s ({args.backend})", file=sys.stderr)
    return 0
