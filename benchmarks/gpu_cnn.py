"""Vision models on one GPU: kiln's cuda backend vs PyTorch eager vs torch.compile(mode="reduce-overhead").

    PYTHONPATH=src python3 benchmarks/gpu_cnn.py [--models mobilenet_v3_small,resnet50] [--batches 1,32]
                                                 [--dtype float32] [--markdown] [--op-times 8]

kiln's own torchvision-compatible MobileNetV3-small and ResNet-50 (kiln.models.vision) with random weights (speed
does not depend on their values), in eval mode; each batch size is exported once (static shapes) and the same
module runs in PyTorch. Contestants interleaved round by round, medians of --repeat samples of --steps
back-to-back forwards, the GPU synchronized at the end of each sample. In float32 every contestant computes in
float32 (TF32 off for cuDNN and cuBLAS in PyTorch, as kiln's products are exact float32) unless --tf32 lets PyTorch
use it. Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_harness import device_line, gpu_op_times, print_table, time_round_robin  # noqa: E402
from harness import stderr_log  # noqa: E402

MODELS = ("mobilenet_v3_small", "resnet50")
CONTESTANTS = ("kiln cuda", "torch eager", "torch.compile")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--batches", default="1,32", help="batch sizes (default 1,32)")
    parser.add_argument("--size", type=int, default=224, help="image side (default 224)")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    parser.add_argument("--tf32", action="store_true", help="let PyTorch use TF32 in float32 (kiln does not)")
    parser.add_argument("--steps", type=int, default=10, help="forwards per sample (default 10)")
    parser.add_argument("--repeat", type=int, default=15, help="samples per contestant and case (default 15)")
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--op-times", type=int, default=0, metavar="N",
                        help="also print the N ops that take the most GPU time in each model's largest batch")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    batches = [int(b) for b in args.batches.split(",")]

    import cupy as cp
    import numpy as np
    import torch

    import kiln
    from kiln.models import vision
    from kiln.runtime.backends.array_api import BFLOAT16

    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.benchmark = True  # PyTorch at its best: cuDNN picks each convolution's fastest algorithm
    dtype = getattr(torch, args.dtype)
    rows, notes, op_tables = [], [], []
    numpy_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": BFLOAT16}[args.dtype]
    for name in models:
        torch.manual_seed(0)
        model = getattr(vision, name)().eval().to(dtype)
        inputs, programs = {}, {}
        for batch in batches:  # exported on the CPU before the module moves to the GPU and is compiled
            gen = torch.Generator().manual_seed(batch)
            inputs[batch] = torch.randn(batch, 3, args.size, args.size, generator=gen).to(dtype)
            t0 = time.perf_counter()
            programs[batch] = kiln.export(model, (inputs[batch],)).load()
            stderr_log(f"{name} batch {batch}: exported in {time.perf_counter() - t0:.1f} s")
        model.cuda()
        compiled = None if args.no_compile else torch.compile(model, mode="reduce-overhead", dynamic=False)
        for batch in batches:
            program = programs[batch]
            session = program.session("cuda")
            torch_x = inputs[batch].cuda()
            kiln_x = cp.asarray(inputs[batch].float().numpy().astype(numpy_dtype))

            def kiln_run(session=session, kiln_x=kiln_x) -> None:
                for _ in range(args.steps):
                    session.run("forward", kiln_x)
                cp.cuda.Device().synchronize()

            def torch_run(fn: Callable, torch_x=torch_x) -> Callable[[], None]:
                def run() -> None:
                    with torch.inference_mode():
                        for _ in range(args.steps):
                            fn(torch_x)
                    torch.cuda.synchronize()
                return run

            cases = {"kiln cuda": kiln_run, "torch eager": torch_run(model)}
            if compiled is not None:
                stderr_log(f"{name} batch {batch}: compiling")
                cases["torch.compile"] = torch_run(compiled)
            stderr_log(f"{name} batch {batch}: timing")
            medians = {k: v / args.steps for k, v in time_round_robin(cases, args.repeat).items()}
            rows.append((f"{name} batch {batch}", batch, medians))

            with torch.inference_mode():
                want = model(torch_x).float().cpu().numpy()
            got = cp.asnumpy(session.run("forward", kiln_x)[0]).astype(np.float32)
            top1 = float(np.mean(got.argmax(-1) == want.argmax(-1)))
            notes.append(f"{name} batch {batch}: kiln vs eager max |diff| {np.abs(got - want).max():.3g} (logit "
                         f"scale {np.abs(want).max():.3g}), top-1 agreement {top1:.0%}; "
                         f"graphs {sum(session.captured_graphs.values())}, "
                         f"host ops {sorted(session.backend.host_ops) or 'none'}")
            if args.op_times and batch == max(batches):
                op_tables.append(f"{name} batch {batch}: " + gpu_op_times(program, cp, "forward", (kiln_x,),
                                                                             args.op_times))
        del compiled
        torch.cuda.empty_cache()

    header = ["case"] + [f"{c} ms" for c in CONTESTANTS] + ["kiln/eager", "kiln/compile", "kiln images/s"]
    body = []
    for case, batch, medians in rows:
        cells = [case] + [f"{medians[c] * 1e3:.3f}" if c in medians else "-" for c in CONTESTANTS]
        cells.append(f"{medians['kiln cuda'] / medians['torch eager']:.2f}")
        cells.append(f"{medians['kiln cuda'] / medians['torch.compile']:.2f}" if "torch.compile" in medians else "-")
        cells.append(f"{batch / medians['kiln cuda']:.0f}")
        body.append(cells)
    tf32 = "TF32 allowed in PyTorch" if args.tf32 else "no TF32"
    print(f"{args.dtype} ({tf32}), {args.size}x{args.size}, random weights, on {device_line(cp, torch)}; medians "
          f"of {args.repeat} samples of {args.steps} forwards")
    print_table(body, header, args.markdown)
    for line in notes + op_tables:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
