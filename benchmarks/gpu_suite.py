"""Every GPU comparison of the CUDA backend in one command, for docs/benchmarks.md: the Llama-3.2-1B-shaped decoder
(gpu_llm.py: prefill 128/512, decode at 128/1024, roofline) and the CNNs (gpu_cnn.py: MobileNetV3-small and
ResNet-50 at batch 1 and 32), each against PyTorch eager and torch.compile(mode="reduce-overhead").

    PYTHONPATH=src python3 benchmarks/gpu_suite.py [--repeat 10] [--markdown] [--op-times 8]

Takes about five minutes on an H100, most of it torch.compile; the options go to both scripts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_cnn  # noqa: E402
import gpu_llm  # noqa: E402
from harness import stderr_log  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=10, help="samples per contestant and case (default 10)")
    parser.add_argument("--op-times", type=int, default=0, metavar="N", help="also print each run's top N ops")
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    args = parser.parse_args(argv)
    shared = ["--repeat", str(args.repeat), "--op-times", str(args.op_times)]
    shared += ["--no-compile"] * args.no_compile + ["--markdown"] * args.markdown
    stderr_log("== LLM prefill and decode (gpu_llm.py)")
    gpu_llm.main(shared)
    print()
    stderr_log("== CNNs (gpu_cnn.py)")
    return gpu_cnn.main(shared)


if __name__ == "__main__":
    raise SystemExit(main())
