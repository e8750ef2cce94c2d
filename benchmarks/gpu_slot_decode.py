"""The batched decode step of a slotted LLM program on one GPU: step time per batch size against the roofline
(every weight read once plus each sequence's keys and values up to its position, at the copy bandwidth measured in
the same run), and the ops that take the GPU's time at the largest batch.

    PYTHONPATH=src python3 benchmarks/gpu_slot_decode.py PROGRAM.kiln [--batches 1,8,32,64] [--position 400]

Each sample is --steps back-to-back decode calls (the session's CUDA graph for that batch, as the serving engine
runs it, padded to a power of two), the GPU synchronized at the end; medians of --repeat samples.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_harness import copy_bandwidth, gpu_op_times  # noqa: E402

PROMPT_RUN = 128
"""Rows past the slots are prompt chunks of this many tokens, each in one slot at consecutive positions."""


def step_inputs(info, rows: int, position: int) -> tuple:
    """A decode call of `rows` rows as the serving engine feeds it: a row per slot at `position`, then rows past
    the slots as prompt chunks riding in the step (PROMPT_RUN tokens of one slot each, at the positions after
    `position`)."""
    import numpy as np

    from kiln.runtime.llm.decoding import slot_inputs

    slots = info.slots or 1
    extra = [r - slots for r in range(slots, rows)]
    slot_of = [r for r in range(min(rows, slots))] + [(k // PROMPT_RUN) % slots for k in extra]
    positions = [position] * min(rows, slots) + [position + 1 + k % PROMPT_RUN for k in extra]
    return (np.full((rows, 1), 42, np.int64), np.asarray(positions, np.int64), *slot_inputs(info, slot_of))


SWITCHES = {
    "slot-runs": ("attention", {"SLOT_RUNS": False},
                  "every row on the decode kernel (prompt runs not by flash)"),
    "dense-gemm-rows": ("gemm_rows", {"DENSE_GEMM_ROWS": True},
                        "the 16-bit linears at 9-64 rows on quant.cu's gemm_rows (gemm_rows.DENSE_GEMM_ROWS), not "
                        "cuBLAS"),
    "slot-flash": ("attention", {"SLOT_FLASH_ROWS_ABOVE": 0},
                   "every row's attention by flash.cu, a block per row and kv head (attention.SLOT_FLASH_ROWS_ABOVE), "
                   "not decode.cu"),
    "gemm-rows-two-tiles": ("gemm_rows", {"GEMM_ROWS_TWO_TILES": True},
                            "a quantized program's 9-64-row products dequantizing into two tiles (one barrier a "
                            "stage)"),
    "decode-chunk": ("attention", {"DECODE_MMA": False},
                     "the decode rows' attention by decode.cu's split-key attend_chunk, not attend_mma on the tensor "
                     "cores (attention.DECODE_MMA off)"),
    "tuned-products": ("linalg", {"TUNED_PRODUCTS": True},
                       "the linears' cuBLAS products with the algorithm measured fastest for each shape "
                       "(linalg.TUNED_PRODUCTS)"),
    "slot-balanced": ("attention", {"SLOT_BALANCED_CHUNKS": True},
                      "each decode row's visible keys split into the step's chunks (attention.SLOT_BALANCED_CHUNKS), "
                      "not chunks of the cache's length"),
    "decode-mma-unpipelined": ("attention", {"DECODE_MMA": True, "DECODE_MMA_PIPELINED": False},
                               "attend_mma loading a warp's next keys only after this step's (fewer registers)"),
    "unpacked-runs": ("attention", {"DECODE_MMA_PACKED_RUNS": False},
                      "a block per prompt row (flash.cu's runs above SLOT_RUNS_ABOVE), not the runs packed into "
                      "attend_mma's tiles (attention.DECODE_MMA_PACKED_RUNS off)"),
    "decode-mma-4096": ("attention", {"DECODE_MMA": True, "DECODE_BLOCKS": 4096},
                        "attend_mma with the keys in chunks for 4096 blocks, not 1024 (attention.DECODE_BLOCKS)"),
}
"""--compare-NAME: the cuda kernels module, its settings for that session's capture, and what they do."""


def captured_session(program, info, args, module: str, settings: dict):
    """A session whose CUDA graphs for every batch were captured with the module's `settings` (set back after): a
    graph replays the kernels chosen at capture, so the sessions run their own choices interleaved."""
    import importlib

    from kiln.runtime.graphs import WARMUP_RUNS

    kernels = importlib.import_module(f"kiln.runtime.backends.cuda.kernels.{module}")
    before = {switch: getattr(kernels, switch) for switch in settings}
    for switch, value in settings.items():
        setattr(kernels, switch, value)
    try:
        session = program.session("cuda")
        for batch in (int(b) for b in args.batches.split(",")):  # run until captured, with the settings
            for _ in range(WARMUP_RUNS + 1):
                session.run("decode", *step_inputs(info, batch, args.position))
    finally:
        for switch, value in before.items():
            setattr(kernels, switch, value)
    return session


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("program", type=Path)
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--position", type=int, default=400, help="each sequence's position (default 400)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--op-times", type=int, default=12, metavar="N", help="top N ops at the largest batch")
    parser.add_argument("--slot-runs-above", type=int, metavar="ROWS",
                        help="steps of more rows than this give prompt runs to flash.cu (default: attention.py's)")
    for name, (_, _, what) in SWITCHES.items():
        parser.add_argument(f"--compare-{name}", action="store_true", help=f"also time each batch with {what}")
    args = parser.parse_args(argv)

    import cupy as cp

    import kiln
    from kiln.runtime.llm.info import LLMInfo

    if args.slot_runs_above is not None:
        from kiln.runtime.backends.cuda.kernels import attention

        attention.SLOT_RUNS_ABOVE = args.slot_runs_above
    program = kiln.load(args.program)
    info = LLMInfo.from_metadata(program.metadata)
    session = program.session("cuda")
    weights = program.constant_bytes
    bandwidth = copy_bandwidth(cp)
    caches = [c for c in session.state if c.ndim == 4]  # [slots, context, kv heads, head dim] per layer, k and v
    kv_per_token = sum(c.nbytes // (c.shape[0] * c.shape[1]) for c in caches)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; weights {weights / 1e9:.2f} GB; KV bytes per token "
          f"{kv_per_token}", flush=True)
    sessions = {"": session}
    for name, (module, settings, _) in SWITCHES.items():  # a session of its own (its own graphs) a comparison
        if getattr(args, "compare_" + name.replace("-", "_")):
            sessions[name] = captured_session(program, info, args, module, settings)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        inputs = step_inputs(info, batch, args.position)
        steps = {}
        for _ in range(args.repeat):  # the sessions interleaved
            for name, s in sessions.items():
                for _ in range(2):
                    s.run("decode", *inputs)
                cp.cuda.Device().synchronize()
                start = time.perf_counter()
                for _ in range(args.steps):
                    s.run("decode", *inputs)
                cp.cuda.Device().synchronize()
                steps.setdefault(name, []).append((time.perf_counter() - start) / args.steps)
        roof = (weights + sum(p + 1 for p in inputs[1]) * kv_per_token) / bandwidth
        for name, samples in steps.items():
            rows.append((batch, name, statistics.median(samples), roof))
            print(f"batch {batch}{' (' + name + ')' if name else ''}: step {rows[-1][2] * 1e3:.3f} ms", flush=True)
    print("\n| batch | step ms | tokens/s | roofline ms | step / roofline |")
    print("|---:|---:|---:|---:|---:|")
    for batch, name, step, roof in rows:
        label = f"{batch} ({name})" if name else f"{batch}"
        print(f"| {label} | {step * 1e3:.3f} | {batch / step:,.0f} | {roof * 1e3:.3f} | {step / roof:.2f} |")
    if args.op_times:
        batch = rows[-1][0]
        inputs = step_inputs(info, batch, args.position)
        print(f"\nGPU time per op, decode at batch {batch}:")
        print(gpu_op_times(program, cp, "decode", inputs, args.op_times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
