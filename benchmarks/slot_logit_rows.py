"""A slotted program's decode step with the LM head on every row against only the first `slots` rows (what
kiln.models.llm exports: a step samples at most one row a slot), on the CPU or any backend.

    PYTHONPATH=src python benchmarks/slot_logit_rows.py [--shape smollm2-135m] [--slots 4] [--prompt-rows 0,64]
        [--backend cpu] [--dtype float32] [--repeat 9]

Both programs are exported in this process from one random-weight model of the shape (cpu_compare.LLAMA_SIZES),
the "every row" one with the leading-rows hook turned off; each step is `slots` decode rows at position 100 plus
--prompt-rows rows of one prompt in slot 0 (as the serving engine feeds them), timed interleaved, medians.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_compare import LLAMA_SIZES  # noqa: E402


def export_both(shape: str, slots: int, chunk: int, max_context: int, dtype: str = "float32") -> dict:
    """{"every row": program, "leading rows": program}, one model's weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kiln.models import llm

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA_SIZES[shape])).to(getattr(torch, dtype)).eval()
    programs = {}
    leading = llm._leading_rows_to_head
    for name in ("every row", "leading rows"):
        if name == "every row":
            llm._leading_rows_to_head = lambda *_: contextlib.nullcontext()
        try:
            programs[name] = llm.export_llama(copy.deepcopy(model), max_context, chunk, slots=slots).load()
        finally:
            llm._leading_rows_to_head = leading
    return programs


def step_inputs(slots: int, prompt_rows: int, position: int) -> tuple[list[int], list[int], list[int]]:
    tokens = [7] * (slots + prompt_rows)
    positions = [position] * slots + list(range(position + 1, position + 1 + prompt_rows))
    return tokens, positions, list(range(slots)) + [0] * prompt_rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(LLAMA_SIZES), default="smollm2-135m")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--prompt-rows", default="0,64", help="prompt rows beside the decode rows (default 0,64)")
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args(argv)

    from kiln.runtime.llm.decoding import decode_batch

    extra = [int(r) for r in args.prompt_rows.split(",")]
    chunk = max(max(extra), 8)
    programs = export_both(args.shape, args.slots, chunk, 512, args.dtype)
    sessions = {name: program.session(args.backend) for name, program in programs.items()}
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeat + 1):  # the first round warms up, not counted
        for rows in extra:
            inputs = step_inputs(args.slots, rows, 100)
            for name, session in sessions.items():
                t0 = time.perf_counter()
                decode_batch(session, *inputs)
                times.setdefault((name, rows), []).append(time.perf_counter() - t0)
    print(f"{args.shape}, {args.dtype}, {args.slots} slots, {args.backend}; medians of {args.repeat} interleaved "
          "steps (ms, the logits copied to the host)")
    print("| step rows | LM head on every row | on the first slots rows | ratio |")
    print("|---:|---:|---:|---:|")
    for rows in extra:
        every, lead = (statistics.median(times[name, rows][1:]) * 1e3 for name in ("every row", "leading rows"))
        print(f"| {args.slots} + {rows} | {every:.2f} | {lead:.2f} | {lead / every:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
