"""The verifier (kiln/ir/verify.py) and the op rules (kiln/ir/rules.py): every op has a rule; a table edited to
disagree with its ops is refused at load naming the node and the rule; sizes past the cap are refused; the writer
never writes a program its loader would refuse. (That every rule agrees with what the exporter declares is proved
by every export-and-load test of the suite: the writer and the loader run the verifier on each of them.)"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import kiln
from kiln.errors import ProgramFormatError
from kiln.format import writer
from kiln.ir import ops
from kiln.ir.dtypes import DType
from kiln.ir.rules import CHOICES, RULES, RuleError, Spec, broadcast
from kiln.ir.symbolic import UNBOUNDED, Symbol
from kiln.ir.verify import bindings, verify_program


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.proj(x)).sum(-1)


@pytest.fixture(scope="module")
def built():
    torch.manual_seed(0)
    rows = torch.export.Dim("rows", min=1, max=4096)
    return kiln.export(Block(), (torch.randn(3, 8),), dynamic_shapes=({0: rows},)).build()


def edited(built, edit) -> tuple:
    program, data = copy.deepcopy(built[0]), built[1]
    edit(program)
    return program, data


def node(program, op: str):
    return next(n for n in program.methods["forward"].nodes if n.op == op)


def load_written(program, data, tmp_path):
    path = tmp_path / "edited.kiln"
    writer.write_program(program, data, path, verify=False)
    return kiln.load(path)


def test_every_op_has_a_rule():
    assert set(RULES) == set(ops.OPS)
    for op, attr in CHOICES:
        assert ops.OPS[op].attr_map[attr].type == ops.AttrType.STRING


def test_the_exported_program_passes(built):
    verify_program(built[0])


def test_a_weight_that_does_not_fit_is_refused_naming_the_node(built, tmp_path):
    def swap_weight_shape(p):
        n = node(p, "linear")
        weight = p.methods["forward"].values[n.inputs[1]]
        c = p.constants[weight.ref]
        p.constants[weight.ref] = type(c)(c.name, c.dtype, (8, 6), c.blob)
        weight.shape = (8, 6)

    with pytest.raises(ProgramFormatError, match=r"node \d+ \(linear.*does not multiply weight \[8, 6\]"):
        load_written(*edited(built, swap_weight_shape), tmp_path)


def test_a_declared_output_shape_that_lies_is_refused(built, tmp_path):
    def lie(p):
        n = node(p, "sum")
        p.methods["forward"].values[n.outputs[0]].shape = ("rows", 2)

    with pytest.raises(ProgramFormatError, match=r"\(sum.*output 0 is declared float32\[\d+, 2\] but the op gives"):
        load_written(*edited(built, lie), tmp_path)


def test_a_string_attribute_outside_its_choices_is_refused(built, tmp_path):
    def bogus(p):
        node(p, "gelu").attrs["approximate"] = "cubic"

    with pytest.raises(ProgramFormatError, match="attribute 'approximate' is 'cubic', not one of"):
        load_written(*edited(built, bogus), tmp_path)


def test_values_past_the_cap_at_the_symbols_bounds_are_refused(built, tmp_path, monkeypatch):
    program = load_written(*edited(built, lambda p: None), tmp_path)  # rows <= 4096: 4096 x 8 floats at most
    assert program is not None
    monkeypatch.setenv("KILN_MAX_BUFFER_BYTES", str(4096 * 8 * 4 - 1))
    with pytest.raises(ProgramFormatError, match=r"more than the cap of \d+ \(KILN_MAX_BUFFER_BYTES\)"):
        load_written(*edited(built, lambda p: None), tmp_path)

    def unbounded(p):
        m = p.methods["forward"]
        m.symbols = [Symbol(s.name, s.min, UNBOUNDED) for s in m.symbols]

    load_written(*edited(built, unbounded), tmp_path)  # sized by its caller's inputs, not held to the cap


def test_the_writer_refuses_what_the_loader_would(built, tmp_path):
    def lie(p):
        node(p, "sum").attrs["dims"] = (5,)

    with pytest.raises(ProgramFormatError, match="loader refuses.*dim 5 is out of range"):
        writer.write_program(*edited(built, lie), tmp_path / "never.kiln")
    assert not (tmp_path / "never.kiln").exists()


def test_bindings_cover_both_bounds():
    envs = bindings([Symbol("a", 2, 9), Symbol("b", 0, UNBOUNDED)])
    assert {"a": 2, "b": 0} in envs and {"a": 9, "b": 61} in envs and len(envs) == 3


@pytest.mark.parametrize(("op", "inputs", "attrs", "expected"), [
    ("add", [Spec(DType.float32, (2, 1, 3)), Spec(DType.float32, (4, 1))], {}, [Spec(DType.float32, (2, 4, 3))]),
    ("matmul", [Spec(DType.float32, (5, 2, 3)), Spec(DType.float32, (3,))], {}, [Spec(DType.float32, (5, 2))]),
    ("conv", [Spec(DType.float32, (1, 4, 9, 9)), Spec(DType.float32, (8, 2, 3, 3)), None],
     {"stride": (2, 2), "padding": (1, 1), "dilation": (1, 1), "groups": 2, "transposed": False,
      "output_padding": (), "padding_end": ()}, [Spec(DType.float32, (1, 8, 5, 5))]),
    ("max_pool", [Spec(DType.float32, (1, 1, 5, 5))],
     {"kernel": (2, 2), "stride": (2, 2), "padding": (0, 0), "dilation": (1, 1), "ceil_mode": True},
     [Spec(DType.float32, (1, 1, 3, 3))]),
    ("slice", [Spec(DType.int64, (10,))], {"dim": 0, "start": 2, "end": 100, "step": 3}, [Spec(DType.int64, (3,))]),
    ("reshape", [Spec(DType.bool, (2, 6))], {"shape": (3, -1)}, [Spec(DType.bool, (3, 4))]),
    ("sum", [Spec(DType.int32, (2, 3))], {"dims": (1,), "keepdim": True}, [Spec(DType.int64, (2, 1))]),
])
def test_rules_compute_what_pytorch_would(op, inputs, attrs, expected):
    assert RULES[op](inputs, attrs) == expected


@pytest.mark.parametrize(("op", "inputs", "attrs"), [
    ("add", [Spec(DType.float32, (2, 3)), Spec(DType.float32, (4,))], {}),
    ("add", [Spec(DType.float32, (2,)), Spec(DType.int64, (2,))], {}),
    ("exp", [Spec(DType.int64, (2,))], {}),
    ("bitwise_not", [Spec(DType.float32, (2,))], {}),
    ("permute", [Spec(DType.float32, (2, 3))], {"perm": (0, 0)}),
    ("reshape", [Spec(DType.float32, (2, 3))], {"shape": (4, 2)}),
    ("topk", [Spec(DType.float32, (4,))], {"k": 5, "dim": 0, "largest": True}),
])
def test_rules_refuse_what_pytorch_would(op, inputs, attrs):
    with pytest.raises(RuleError):
        RULES[op](inputs, attrs)


def test_broadcast():
    assert broadcast((3, 1), (1, 4), ()) == (3, 4)
