"""Where a decode step's time goes on the GPU: kiln's kernels as the step's CUDA graph replays them.

    PYTHONPATH=src python3 benchmarks/gpu_timeline.py [--context 1024] [--program PATH] [--layer 1] [--by-layer]

kiln's cuda backend compiled with its kernel timeline (kiln.runtime.backends.cuda.timeline; this script sets
KILN_CUDA_TIMELINE=1): each kernel's span is the time from its release (the kernel before it finished) to the next
kernel's release, measured inside graph replays with early launch, weights warm, neighbours overlapping, as
gpu_llm.py's decode runs. Medians over --replays replays of one decode step (same Llama as gpu_llm.py). Prints the
spans summed by kernel, then one layer's kernels in order. Recording costs each kernel an atomic round trip in one
thread: the step it reports is that much slower than gpu_llm.py's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ["KILN_CUDA_TIMELINE"] = "1"  # before kiln's kernels are compiled

from cpu_compare import LLAMA_SIZES  # noqa: E402
from gpu_harness import check_quant_kernels, device_line, print_table, select_quant_kernel  # noqa: E402
from gpu_llm import MOE_SIZES, llama_program  # noqa: E402
from harness import quantize_spec, stderr_log  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(LLAMA_SIZES) + sorted(MOE_SIZES), default="llama-3.2-1b",
                        help="model shape (gpu_llm.py's)")
    parser.add_argument("--layers", type=int, help="keep the shape's first N layers (default: all)")
    parser.add_argument("--distinct-layers", type=int, metavar="N",
                        help="only N layers' weights, cycled to the full depth (gpu_llm.py's --distinct-layers)")
    parser.add_argument("--max-context", type=int, default=1280, help="KV-cache slots (default 1280)")
    parser.add_argument("--prefill", type=int, default=128, help="the export's prefill chunk (default 128)")
    parser.add_argument("--context", type=int, default=1024, help="the decode step's position (default 1024)")
    parser.add_argument("--replays", type=int, default=20, help="replays whose spans are medianed (default 20)")
    parser.add_argument("--layer", type=int, default=1,
                        help="the layer whose kernels are listed in order, from its attention (default 1)")
    parser.add_argument("--program", type=Path, metavar="PATH",
                        help="the exported .kiln file, as gpu_llm.py --program (loaded when there, else saved)")
    parser.add_argument("--by-layer", action="store_true",
                        help="also print every layer's cycle (summed spans and its longest kernels), layer by layer")
    parser.add_argument("--quantize", metavar="MODE", help="weights quantized as gpu_quant_decode.py's --quantize "
                        "names them (int4-g32-sym, int8, ...); default bfloat16")
    parser.add_argument("--kernel", default="",
                        help="the quantized linear's kernel, as gpu_quant_decode.py's --kernels names one (dot, "
                             "dot-interleaved, ...; default kiln's)")
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    args = parser.parse_args(argv)
    check_quant_kernels(parser, [args.kernel])

    import cupy as cp
    import torch

    from kiln.runtime.backends.cuda import timeline

    select_quant_kernel(args.kernel)

    model, _, program = llama_program(args.shape, torch.bfloat16, args.max_context, args.prefill, args.program,
                                     layers=args.layers, distinct_layers=args.distinct_layers,
                                     quantize=quantize_spec(args.quantize) if args.quantize else None)
    del model
    session = program.session("cuda")
    inputs = (cp.asarray([[42]]), cp.asarray([args.context]))
    session.run("decode", *inputs)  # op by op: kernels compiled, plans built
    window = timeline.Window()
    session.run("decode", *inputs)  # captured, then replayed once
    window.close()
    if not session.captured_graphs.get("decode"):
        raise SystemExit("the decode step was not captured as a graph; nothing to time")

    stderr_log(f"replaying {args.replays} steps")
    runs, steps = [], []
    for _ in range(args.replays):
        timeline.reset()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        session.run("decode", *inputs)
        end.record()
        end.synchronize()
        steps.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
        runs.append(window.spans())
    kernels = runs[0]
    span = [statistics.median(r[i].span_ns or 0 for r in runs) / 1e3 for i in range(len(kernels))]
    lead = [statistics.median(r[i].released_ns - r[i].started_ns for r in runs) / 1e3 for i in range(len(kernels))]
    total = statistics.median((r[-1].released_ns - r[0].released_ns) / 1e3 for r in runs)

    by_name: dict[str, list[float]] = {}
    for k, s in zip(kernels, span, strict=True):
        by_name.setdefault(k.name, []).append(s)
    body = [[name, str(len(s)), f"{sum(s):.1f}", f"{statistics.median(s):.2f}", f"{100 * sum(s) / total:.0f}%"]
            for name, s in sorted(by_name.items(), key=lambda item: -sum(item[1]))]
    print(f"{args.shape} decode at {args.context}, on {device_line(cp, torch)}: {len(kernels)} kiln kernels, first "
          f"to last release {total:.1f} us (median of {args.replays}); the step with recording "
          f"{statistics.median(steps):.1f} us between events")
    print_table(body, ["kernel", "count", "span us", "each us", "share"], args.markdown)

    anchors = [i for i, k in enumerate(kernels) if k.name.startswith("attend_chunk")]
    if len(anchors) > args.layer + 1:  # a layer's cycle from its attention to the next layer's
        first, stop = anchors[args.layer], anchors[args.layer + 1]
        what = f"layer {args.layer}'s from its attention on"
    else:  # (too few layers to hold that cycle: the step's first kernels)
        first, stop = 0, min(len(kernels), 16)
        what = f"the step's first {stop} (no attention of layer {args.layer + 1} to end layer {args.layer}'s cycle)"
    rows = [[str(i), kernels[i].name, "x".join(map(str, kernels[i].grid)), f"{lead[i]:.2f}", f"{span[i]:.2f}"]
            for i in range(first, stop)]
    print(f"\nkernels {first} to {stop - 1}: {what} ('early': how long block 0 waited for the kernel before, "
          "launched early)")
    print_table(rows, ["#", "kernel", "grid", "early us", "span us"], args.markdown)
    if args.by_layer and len(anchors) > 1:
        print("\nevery layer's cycle, from its attention to the next layer's (the same kernels in each: a layer that "
              "costs more than the others says where)")
        print_table(_layer_rows(kernels, span, anchors), ["layer", "kernels", "span us", "its three longest (us)"],
                    args.markdown)
    return 0


def _layer_rows(kernels: list, span: list[float], anchors: list[int]) -> list[list[str]]:
    """One row per full layer cycle (anchors: each layer's first attention kernel): its kernels' summed spans and
    the three longest, so layers of one step can be compared with each other."""
    rows = []
    for layer, (first, stop) in enumerate(zip(anchors, anchors[1:])):
        spans = sorted(((span[i], kernels[i].name) for i in range(first, stop)), reverse=True)
        longest = ", ".join(f"{name.split('<')[0]} {us:.1f}" for us, name in spans[:3])
        rows.append([str(layer), str(stop - first), f"{sum(us for us, _ in spans):.1f}", longest])
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
