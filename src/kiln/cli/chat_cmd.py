"""`kiln chat`: talk with an exported chat model in the terminal. Torch-free, like `kiln generate`."""

from __future__ import annotations

import argparse
import sys

from kiln.cli import generate_cmd
from kiln.runtime.llm import ChatSession, ContextFullError

HELP = "chat with a language model exported by `kiln export-llm`, in the terminal"
DESCRIPTION = """\
An interactive chat with a chat (instruct) model exported by `kiln export-llm`, without PyTorch. Each line you
type is a user message; the reply is printed as it is generated. The whole conversation is formatted with the
model's chat template every turn, and the KV cache keeps what it already holds, so only your new message is
processed before the reply starts.

The conversation has to fit in the model's context (the exported --max-context, prompt and replies together).
When it no longer does, kiln says so: type /clear to start over (the --system message stays).

Commands: /clear forgets the conversation, /exit (or Ctrl-D) quits."""
EPILOG = """\
examples:
  kiln chat smollm2.kiln
  kiln chat qwen.kiln --system "You are a helpful assistant." --temperature 0.7 --top-p 0.9
  printf 'Hi!\\nWhat did I just say?\\n' | kiln chat smollm2.kiln --stats
"""
COMMANDS = {"/clear": "forget the conversation (the system message stays)", "/exit": "quit (so does Ctrl-D)"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help=HELP, description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    generate_cmd.add_model_arguments(p)
    generate_cmd.add_sampling_arguments(p, max_new_tokens=512)
    p.add_argument("--stats", action="store_true",
                   help="after each reply, print its token counts and speeds to stderr")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    sampler = generate_cmd.make_sampler(args)
    generator = generate_cmd.make_generator(args)
    chat = ChatSession(generator, system=args.system, sampler=sampler, max_new_tokens=args.max_new_tokens,
                       stop_token_ids=args.stop_tokens)
    name = generator.info.name or args.model
    print(f"chatting with {name} ({generator.max_context}-token context); /clear starts over, /exit quits",
          file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/clear":
            chat.clear()
            print("(conversation cleared)", file=sys.stderr)
            continue
        if text.startswith("/") and " " not in text:
            known = "; ".join(f"{command}: {what}" for command, what in COMMANDS.items())
            print(f"unknown command {text}; the commands are {known}", file=sys.stderr)
            continue
        try:
            stream = chat.send(text)
        except ContextFullError as e:
            print(f"(the context is full: the conversation and room for a reply need {e.needed} tokens, the model "
                  f"holds {e.max_context}; type /clear to start over)", file=sys.stderr)
            continue
        generate_cmd.print_stream(stream)
        if stream.stats.stop_reason == "context_full":
            print("(the reply filled the context and was cut off; /clear to start over)", file=sys.stderr)
        if args.stats:
            print(stream.stats.summary(), file=sys.stderr)
