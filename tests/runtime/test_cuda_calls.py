"""The CUDA tests and GPU benchmarks call the CUDA kernels' Python functions with arguments that bind to those
functions' signatures, checked from the sources (no GPU or CuPy needed). CI runs none of those tests: when op set 15
gave `sdpa` an optional `sinks` input in the fifth place, 412 device tests that passed `causal` and `scale` by
position failed with TypeError, and only the next session's run on a GPU showed it."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import kiln

ROOT = Path(__file__).resolve().parents[2]
KERNELS = Path(kiln.__file__).parent / "runtime" / "backends" / "cuda" / "kernels"
PACKAGE = "kiln.runtime.backends.cuda.kernels"
CALLERS = sorted(ROOT.glob("tests/runtime/test_cuda*.py")) + sorted(ROOT.glob("benchmarks/gpu_*.py"))


def _signature(fn: ast.FunctionDef) -> inspect.Signature:
    """The signature a def states (defaults stand in as 0: only which parameters may be left out matters)."""
    a, P = fn.args, inspect.Parameter
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    params = [P(arg.arg, P.POSITIONAL_ONLY if i < len(a.posonlyargs) else P.POSITIONAL_OR_KEYWORD,
                default=P.empty if d is None else 0) for i, (arg, d) in enumerate(zip(positional, defaults))]
    if a.vararg:
        params.append(P(a.vararg.arg, P.VAR_POSITIONAL))
    params += [P(arg.arg, P.KEYWORD_ONLY, default=P.empty if d is None else 0)
               for arg, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        params.append(P(a.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


def _kernel_functions() -> dict[tuple[str, str], inspect.Signature]:
    """(module, function) -> signature for every top-level def of the CUDA kernel modules, and ("op", name) for
    each one registered as an op's kernel (`@kernel("sdpa")`: what CUDA_KERNELS.kernels["sdpa"] is)."""
    found = {}
    for path in KERNELS.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef):
                found[(path.stem, node.name)] = _signature(node)
                for decorator in node.decorator_list:
                    if (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Name)
                            and decorator.func.id == "kernel"):
                        found.update((("op", a.value), found[(path.stem, node.name)]) for a in decorator.args
                                     if isinstance(a, ast.Constant))
    return found


def _registry_lookups(tree: ast.AST) -> dict[str, set]:
    """Local names bound to CUDA_KERNELS.kernels["op"] (also in a tuple assignment) -> {("op", "op")}."""
    named: dict[str, set] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target, value = node.targets[0], node.value
        pairs = (zip(target.elts, value.elts) if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple)
                 else [(target, value)])
        for name, lookup in pairs:
            if (isinstance(name, ast.Name) and isinstance(lookup, ast.Subscript)
                    and isinstance(lookup.slice, ast.Constant) and ast.unparse(lookup.value).endswith(
                        "CUDA_KERNELS.kernels")):
                named.setdefault(name.id, set()).add(("op", lookup.slice.value))
    return named


def _positional_count(args: list[ast.expr]) -> int | None:
    """How many positional arguments a call passes, or None where a starred one's length cannot be read off the
    source (a starred literal, or a generator over one, can)."""
    count = 0
    for arg in args:
        if not isinstance(arg, ast.Starred):
            count += 1
            continue
        value = arg.value
        if isinstance(value, (ast.GeneratorExp, ast.ListComp)) and len(value.generators) == 1:
            value = value.generators[0].iter
        if not isinstance(value, (ast.Tuple, ast.List)) or any(isinstance(e, ast.Starred) for e in value.elts):
            return None
        count += len(value.elts)
    return count


def calls_that_do_not_bind(source: str, functions: dict[tuple[str, str], inspect.Signature]) -> tuple[list, int]:
    """([(line, call, error)] for the source's calls of kernel functions that would raise TypeError, number of calls
    checked). Names are resolved through the file's imports from the kernels package, wherever they are made."""
    tree = ast.parse(source)
    named = _registry_lookups(tree)  # local name -> (module, function) it was imported or looked up as
    modules: dict[str, set] = {}  # local name -> kernel module
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith(PACKAGE):
            continue
        for alias in node.names:
            local = alias.asname or alias.name
            if node.module == PACKAGE and (KERNELS / f"{alias.name}.py").exists():
                modules.setdefault(local, set()).add(alias.name)
            elif node.module != PACKAGE:
                named.setdefault(local, set()).add((node.module.rsplit(".", 1)[1], alias.name))
    bad, checked = [], 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        target = None
        if isinstance(node.func, ast.Name) and len(named.get(node.func.id, ())) == 1:
            (target,) = named[node.func.id]
        elif (isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
              and len(modules.get(node.func.value.id, ())) == 1):
            (module,) = modules[node.func.value.id]
            target = (module, node.func.attr)
        signature = functions.get(target)
        count = _positional_count(node.args)
        if signature is None or count is None or any(k.arg is None for k in node.keywords):
            continue
        checked += 1
        try:
            signature.bind(*[0] * count, **{k.arg: 0 for k in node.keywords})
        except TypeError as e:
            bad.append((node.lineno, ast.unparse(node.func), str(e)))
    return bad, checked


@pytest.fixture(scope="module")
def functions() -> dict[tuple[str, str], inspect.Signature]:
    return _kernel_functions()


@pytest.fixture(scope="module")
def names() -> dict[str, set[str]]:
    return _module_names()


@pytest.mark.parametrize("path", CALLERS, ids=lambda p: p.name)
def test_the_cuda_tests_use_the_kernels_as_they_are(path: Path, functions, names) -> None:
    """Every call of a kernel function binds, and every name read, called or set on a kernel module exists there."""
    source = path.read_text()
    bad, _ = calls_that_do_not_bind(source, functions)
    assert not bad, f"{path.name}: " + "; ".join(f"line {line}: {call}: {error}" for line, call, error in bad)
    missing, _ = switches_that_do_not_exist(source, names)
    assert not missing, f"{path.name}: " + "; ".join(f"line {line}: {module}.{name}" for line, module, name in missing)
    copies, _ = switches_set_where_they_are_not_read(source, _module_names(imported=False))
    assert not copies, f"{path.name}: set on a module that only imports it: " + "; ".join(
        f"line {line}: {module}.{name}" for line, module, name in copies)


def test_the_check_reads_the_calls_it_is_for(functions) -> None:
    """It sees the suite's kernel calls (not a check of nothing), and it fails the calls that failed on the GPU."""
    checked = sum(calls_that_do_not_bind(path.read_text(), functions)[1] for path in CALLERS)
    assert checked >= 50
    old = ("def test():\n    from kiln.runtime.backends.cuda.kernels.attention import sdpa, slot_attention\n"
           "    from kiln.runtime.backends.cuda.kernels import attention\n"
           "    sdpa(q, k, v, mask, False, None)\n"
           "    attention.sdpa(*(cp.asarray(a) for a in (q, k, v, mask)), False, None)\n"
           "    slot_attention(q, kc, vc, slots, positions, 0.125, 0)\n"
           "    sdpa(q, k, v, mask, causal=False, scale=None)\n"
           "    linear, sdpa2 = CUDA_KERNELS.kernels['linear'], CUDA_KERNELS.kernels['sdpa']\n"
           "    sdpa2(q, k, v, mask, False, None)\n")
    bad, checked = calls_that_do_not_bind(old, functions)
    assert checked == 5 and [line for line, _, _ in bad] == [4, 5, 6, 9]


def _module_names(imported: bool = True) -> dict[str, set[str]]:
    """Kernel module -> the names its source binds at top level (assignments, defs, classes, and with `imported`
    its imports)."""
    found: dict[str, set[str]] = {}
    for path in KERNELS.glob("*.py"):
        names = found.setdefault(path.stem, set())
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    names.update(t.id for t in (target.elts if isinstance(target, ast.Tuple) else [target])
                                 if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif imported and isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return found


def _module_uses(source: str, modules_known: dict[str, set[str]]) -> list[tuple[int, str, str, bool]]:
    """(line, kernel module, name, set) for each monkeypatch.setattr(module, "NAME", ...) (set) and `module.NAME`
    (read or called; set when assigned) in the source, on a kernel module it imports from the kernels package."""
    tree = ast.parse(source)
    modules = {alias.asname or alias.name: alias.name for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and node.module == PACKAGE for alias in node.names
               if alias.name in modules_known}
    uses = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("monkeypatch.setattr")
                and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id in modules
                and isinstance(node.args[1], ast.Constant)):
            uses.append((node.lineno, modules[node.args[0].id], str(node.args[1].value), True))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            uses.append((node.lineno, modules[node.value.id], node.attr, isinstance(node.ctx, ast.Store)))
    return uses


def switches_set_where_they_are_not_read(source: str, defined: dict[str, set[str]]) -> tuple[list, int]:
    """([(line, module, NAME)] for the source's monkeypatch.setattr(module, "NAME", ...) or `module.NAME = value` of
    an upper-case name (a switch or constant) that the kernel module only imports, number checked): the code that
    reads a switch reads it in the module that defines it, so setting the imported copy changes nothing and the test
    measures the default."""
    checked = [(line, module, name) for line, module, name, is_set in _module_uses(source, defined)
               if is_set and name.isupper()]
    return sorted(use for use in checked if use[2] not in defined[use[1]]), len(checked)


def switches_that_do_not_exist(source: str, names: dict[str, set[str]]) -> tuple[list, int]:
    """([(line, module, name)] for the source's monkeypatch.setattr(module, "NAME", ...) and `module.NAME` (read,
    called or assigned) on a kernel module (imported from the kernels package) whose source binds no NAME, number
    checked): a switch or function moved to another module, or renamed, fails there only on a GPU otherwise."""
    checked = [(line, module, name) for line, module, name, _ in _module_uses(source, names)]
    return sorted(use for use in checked if use[2] not in names[use[1]]), len(checked)


def test_the_switch_check_reads_what_it_is_for(names) -> None:
    """It sees the suite's switches and calls, and it fails a switch set on the module it left (DENSE_GEMM_ROWS moved
    from linalg to gemm_rows, QUANT_DOT to quant_linear) and a function called there."""
    checked = sum(switches_that_do_not_exist(path.read_text(), names)[1] for path in CALLERS)
    assert checked >= 100
    old = ("def test(monkeypatch):\n"
           "    from kiln.runtime.backends.cuda.kernels import gemm_rows, linalg, quant_linear\n"
           "    monkeypatch.setattr(linalg, 'DENSE_GEMM_ROWS', True)\n"
           "    monkeypatch.setattr(gemm_rows, 'DENSE_GEMM_ROWS', True)\n"
           "    quant_linear.QUANT_DOT = True\n    quant_linear.QUANT_DOTS = True\n"
           "    linalg._gemm_rows_splits(64, 2048)\n    gemm_rows.splits_of(64, 2048)\n    linalg.QUANT_DOT = True\n")
    bad, checked = switches_that_do_not_exist(old, names)
    assert checked == 7 and bad == [(3, "linalg", "DENSE_GEMM_ROWS"), (6, "quant_linear", "QUANT_DOTS"),
                                    (7, "linalg", "_gemm_rows_splits"), (9, "linalg", "QUANT_DOT")]


def test_the_benchmarks_settings_exist_on_their_modules(monkeypatch) -> None:
    """The GPU benchmarks' tables of settings (gpu_slot_decode's comparisons, gpu_decode_attention's configurations,
    gpu_harness's quantized-kernel choices) name switches their kernel modules define: set by name with setattr, a
    moved or renamed switch (or one the module only imports) would otherwise change nothing and measure the default
    twice."""
    names = _module_names(imported=False)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_decode_attention
    import gpu_harness
    import gpu_slot_decode

    wanted = [(module, switch) for module, settings, _ in gpu_slot_decode.SWITCHES.values() for switch in settings]
    wanted += [("attention", knob) for config in gpu_decode_attention.CONFIGS.values() for knob in config]
    wanted += [("attention", knob) for knob in gpu_decode_attention.KNOBS]
    wanted += [(gpu_harness.SETTING_MODULES.get(s, "quant_linear"), s) for s in gpu_harness.quant_kernel_choice("")]
    assert len(wanted) > 20
    assert [w for w in wanted if w[1] not in names[w[0]]] == []


def test_the_switch_check_fails_a_switch_set_on_a_module_that_imports_it() -> None:
    """experts.py imports GEMV_WARPS and GEMV_ROWS from linalg: setting them on experts (by monkeypatch or by
    assignment) would change nothing linalg reads."""
    source = ("def test(monkeypatch):\n    from kiln.runtime.backends.cuda.kernels import experts, linalg\n"
              "    monkeypatch.setattr(linalg, 'GEMV_WARPS', 4)\n    monkeypatch.setattr(experts, 'GEMV_WARPS', 4)\n"
              "    monkeypatch.setattr(experts, 'nvrtc', None)\n    experts.GEMV_ROWS = 2\n    linalg.GEMV_ROWS = 2\n")
    bad, checked = switches_set_where_they_are_not_read(source, _module_names(imported=False))
    assert checked == 4 and bad == [(4, "experts", "GEMV_WARPS"), (6, "experts", "GEMV_ROWS")]
