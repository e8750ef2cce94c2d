"""`kiln transcribe`: the text of a WAV file from a speech program, with the real-time factor. Torch-free."""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from kiln.cli.common import CliError, add_backend_argument, load_program
from kiln.runtime.audio import SAMPLE_RATE, AudioFormatError, load_audio

HELP = "transcribe a WAV file with a speech .kiln program (Whisper, Parakeet TDT or Voxtral)"
DESCRIPTION = """\
Transcribe speech with a program made by `kiln export-whisper`, `kiln export-parakeet` or `kiln export-voxtral`.
The WAV file (8-32-bit integer PCM or float, any channel count and sample rate) is mixed down to mono and resampled
to 16 kHz. Whisper reads it in 30 s windows (log-mel features, the encoder once per window) and writes the text
greedily, token by token; Parakeet TDT takes NeMo's features of up to its encoder's window (2 minutes by default) at
once and decodes tokens with their durations greedily; Voxtral sends each 30 s window to its decoder as a
transcription request (the window's 375 audio embeddings in the prompt) and writes the answer greedily.

The text goes to stdout; the audio length, the time taken and the real-time factor (time taken / audio length,
below 1 is faster than real time) go to stderr, with each window's text as it is done for audio over 30 s."""
EPILOG = """\
examples:
  kiln transcribe tiny_en.kiln speech.wav
  kiln transcribe base.kiln interview.wav --language de --task translate --backend cuda
  kiln transcribe parakeet.kiln speech.wav
  kiln transcribe voxtral.kiln speech.wav --language fr
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("transcribe", help=HELP, description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="the .kiln file (from `kiln export-whisper`, `export-parakeet` or `export-voxtral`)")
    p.add_argument("audio", help="a WAV file")
    add_backend_argument(p)
    p.add_argument("--language", help="Whisper (multilingual models) and Voxtral: the spoken language's code "
                                      "(default: en)")
    p.add_argument("--task", choices=("transcribe", "translate"),
                   help="Whisper: transcribe, or translate into English (multilingual models; default: transcribe)")
    p.add_argument("--max-new-tokens", type=int, metavar="N",
                   help="Whisper and Voxtral: most tokens per 30 s window (default: the cache)")
    p.set_defaults(handler=run)


def read_audio(path: str) -> np.ndarray:
    """The WAV file's samples at the speech models' 16 kHz, or a one-line CliError saying what is wrong with it."""
    try:
        return load_audio(path, SAMPLE_RATE)
    except FileNotFoundError:
        raise CliError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise CliError(f"{path}: a folder, not a WAV file") from None
    except OSError as e:
        raise CliError(f"{path}: cannot read it ({e.strerror or e})") from None
    except AudioFormatError as e:
        raise CliError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    from kiln.runtime.speech import VoxtralTranscriber, WhisperTranscriber, transcriber

    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise CliError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    started = time.perf_counter()
    samples = read_audio(args.audio)  # first: a bad WAV is refused before a large model is loaded
    reading = time.perf_counter() - started
    model = transcriber(load_program(args.model), args.backend)  # InputError when it is not a speech program
    options = {"language": args.language or "en", "task": args.task or "transcribe",
               "max_new_tokens": args.max_new_tokens}
    if isinstance(model, VoxtralTranscriber):
        if args.task is not None:
            raise CliError("--task applies to Whisper programs only")
        options.pop("task")
    elif not isinstance(model, WhisperTranscriber):
        given = [flag for flag, value in (("--language", args.language), ("--task", args.task),
                                          ("--max-new-tokens", args.max_new_tokens)) if value is not None]
        if given:
            raise CliError(f"{', '.join(given)} apply to Whisper and Voxtral programs only")
        options = {}

    def progress(index: int, count: int, text: str) -> None:
        if count > 1:
            print(f"  window {index + 1}/{count}: {text}", file=sys.stderr, flush=True)

    result = model.transcribe(samples, on_window=progress, **options)
    result.seconds += reading  # (reading and resampling the WAV is part of the features' time, as before)
    result.timings["features"] = result.timings.get("features", 0.0) + reading
    print(result.text)
    print(f"{result.audio_seconds:.1f} s of audio in {result.seconds:.2f} s: real-time factor "
          f"{result.real_time_factor:.3f} ({args.backend}; features {result.timings['features']:.2f} s, encoder "
          f"{result.timings['encode']:.2f} s, decoder {result.timings['decode']:.2f} s)", file=sys.stderr)
    return 0
