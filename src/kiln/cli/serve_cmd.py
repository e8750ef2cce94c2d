"""`kiln serve`: an OpenAI-compatible HTTP server for one program (kiln.runtime.serve). Torch-free."""

from __future__ import annotations

import argparse
import importlib.util
import logging
from pathlib import Path

from kiln.cli.common import CliError, add_backend_argument, load_program

HELP = "serve a program over HTTP with OpenAI's API (chat, completions, embeddings, transcriptions)"
DESCRIPTION = """\
Serve one .kiln program with OpenAI's HTTP API, so that any OpenAI client (the openai package, curl, chat front
ends) can use it. What is served follows from the program:
  a language model (`kiln export-llm`):  POST /v1/chat/completions and /v1/completions, streamed or not;
  a sentence-embedding program:         POST /v1/embeddings;
  a speech program (Whisper, Parakeet):  POST /v1/audio/transcriptions (a WAV file, multipart upload);
and for all: GET /v1/models, GET /health and GET /metrics (Prometheus text).

A language model exported with `--slots N` serves N streams at once with continuous batching: every decode step
runs all running streams as one batch, and a new request joins as soon as a slot is free. Without --slots the
program serves one stream at a time and the others wait in the queue. A full queue answers 503 with Retry-After.
SIGTERM or Ctrl-C ends the streams in flight with an error chunk and stops the server."""
EPILOG = """\
examples:
  kiln export-llm SmolLM2-135M-Instruct.Q4_1.gguf -o smollm2.kiln --slots 8 --quantize int8
  kiln serve smollm2.kiln --port 8000
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"model": "smollm2", "messages": [{"role": "user", "content": "Hi!"}]}'
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help=HELP, description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="the .kiln file to serve")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000; 0 picks a free one)")
    add_backend_argument(p)
    p.add_argument("--model-name", metavar="NAME",
                   help="the model id clients send in 'model' (default: the program's own name, else its file name)")
    p.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="language models: most requests waiting for a slot before 503 answers (default: 64)")
    p.add_argument("--prefill-tokens", type=int, metavar="N",
                   help="language models: most prompt tokens one decode step carries, where prompts ride in decode "
                        "steps (default: the program's prefill chunk; fewer: shorter steps for running streams)")
    p.add_argument("--engine-in", choices=("process", "thread"), default="process",
                   help="language models: run the engine in a process of its own, beside the HTTP server's (default: "
                        "process; the two then use two cores), or on a thread of the server's process (thread)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="language models: launch each decode step before reading the last one's picks, so the "
                        "host's work between steps runs while the device computes (default: on where it helps, a "
                        "GPU's captured steps with prompts in decode steps; --no-overlap: one step after another)")
    p.add_argument("--tokenizer", type=Path, metavar="PATH",
                   help="embedding programs without a tokenizer inside: a tokenizer.json to read text with")
    p.add_argument("--http", default="auto", choices=("auto", "httptools", "h11"),
                   help="HTTP protocol implementation (default: auto, httptools where installed: less CPU a token)")
    p.add_argument("--loop", default="auto", choices=("auto", "uvloop", "asyncio"),
                   help="event loop (default: auto, uvloop where installed)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="server log verbosity (default: info)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise CliError(f"--port must be in 0..65535, got {args.port}")
    if args.max_queue < 0:
        raise CliError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.prefill_tokens is not None and args.prefill_tokens < 1:
        raise CliError(f"--prefill-tokens must be >= 1, got {args.prefill_tokens}")
    for option, module in (("http", args.http), ("loop", args.loop)):
        if module in ("httptools", "uvloop") and importlib.util.find_spec(module) is None:
            raise CliError(f"--{option} {module}: {module} is not installed (pip install {module}; or --{option} auto)")
    try:
        from kiln.runtime.serve import Server, create_app
    except ImportError as e:
        raise CliError(f"kiln serve needs the server packages: pip install \"kiln[serve]\" ({e})") from None
    program = load_program(args.model)
    tokenizer = None
    if args.tokenizer is not None:
        from kiln.runtime.text import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(levelname)s:     %(message)s")
    print(f"loading {args.model} on {args.backend}", flush=True)
    app = create_app(program, args.backend, args.model_name, args.max_queue, tokenizer, args.prefill_tokens,
                     engine_process=args.engine_in == "process", overlap=args.overlap)
    print(f"serving '{app.state.model_id}' ({app.state.service.kind}) at http://{args.host}:{args.port}/v1",
          flush=True)
    Server(app, args.host, args.port, log_level=args.log_level, http=args.http, loop=args.loop).run()
    return 0
