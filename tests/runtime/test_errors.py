"""Wrong inputs raise InputError naming the input, what was expected and what was given, and change nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import kiln
from kiln.errors import InputError


class Pair(nn.Module):
    """Two inputs that share the dynamic `batch` dimension and a static width."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.proj = nn.Linear(8, 8)
        self.register_buffer("seen", torch.zeros(8))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.seen.add_(x.sum(0))
        return self.proj(x) * y


@pytest.fixture(scope="module")
def program() -> kiln.Program:
    batch = torch.export.Dim("batch", min=2, max=16)
    return kiln.export(Pair(), (torch.randn(3, 8), torch.randn(3, 8)),
                       dynamic_shapes=({0: batch}, {0: batch})).load()


def ones(*shape, dtype=np.float32) -> np.ndarray:
    return np.ones(shape, dtype=dtype)


def raises_input_error(session, *inputs, method: str = "forward", phrases: tuple[str, ...] = ()) -> str:
    state_before = [s.copy() for s in session.state]
    with pytest.raises(InputError) as info:
        session.run(method, *inputs)
    message = str(info.value)
    for phrase in phrases:
        assert phrase in message, f"{phrase!r} not in: {message}"
    assert isinstance(info.value, ValueError)  # callers that catch ValueError keep working
    for before, after in zip(state_before, session.state, strict=True):
        np.testing.assert_array_equal(before, after)  # a rejected call does not touch the state
    return message


def test_the_valid_call_works(program):
    session = program.session()
    out = session.run("forward", ones(4, 8), ones(4, 8))[0]
    assert out.shape == (4, 8)
    np.testing.assert_array_equal(session.state[0], np.full(8, 4, np.float32))


def test_wrong_number_of_inputs(program):
    session = program.session()
    for inputs in [(ones(4, 8),), (ones(4, 8), ones(4, 8), ones(4, 8)), ()]:
        raises_input_error(session, *inputs, phrases=(
            f"'forward' takes 2 input(s) (x: float32[batch, 8], y: float32[batch, 8]), got {len(inputs)}",))


def test_wrong_dtype(program):
    raises_input_error(program.session(), ones(4, 8), ones(4, 8, dtype=np.float64), phrases=(
        "input 1 'y'", "expected dtype float32", "got float64", ".astype"))
    raises_input_error(program.session(), ones(4, 8, dtype=np.int64), ones(4, 8), phrases=("input 0 'x'", "int64"))


def test_wrong_rank(program):
    raises_input_error(program.session(), ones(4, 8, 1), ones(4, 8), phrases=(
        "input 0 'x'", "expected 2 dimensions", "x: float32[batch, 8]", "got shape [4, 8, 1]"))
    raises_input_error(program.session(), ones(4, 8), ones(32), phrases=("input 1 'y'", "got shape [32]"))


def test_wrong_static_dimension(program):
    raises_input_error(program.session(), ones(4, 9), ones(4, 9), phrases=(
        "input 0 'x'", "dimension 1 is 9, expected 8", "got shape [4, 9]"))


@pytest.mark.parametrize("batch", [1, 17, 0])
def test_symbol_out_of_bounds(program, batch):
    message = raises_input_error(program.session(), ones(batch, 8), ones(batch, 8), phrases=(
        "input 'x'", "dimension 0", f"is {batch}", "symbol batch in [2, 16]"))
    assert "exported with" in message


def test_inputs_disagree_on_a_shared_symbol(program):
    raises_input_error(program.session(), ones(4, 8), ones(5, 8), phrases=(
        "input 1 'y'", "dimension 0 is 5", "expected batch = 4", "got shape [5, 8]"))


def test_unknown_method(program):
    with pytest.raises(InputError, match=r"no method 'decode'; its methods are \['forward'\]"):
        program.session().run("decode", ones(4, 8), ones(4, 8))
    with pytest.raises(InputError, match="no method 'decode'"):
        program.info("decode")


def test_session_still_works_after_errors(program):
    session = program.session()
    raises_input_error(session, ones(4, 9), ones(4, 9))
    raises_input_error(session, ones(17, 8), ones(17, 8))
    x, y = np.random.default_rng(0).standard_normal((2, 5, 8), dtype=np.float32)
    with torch.no_grad():
        want = Pair()(torch.from_numpy(x), torch.from_numpy(y)).numpy()
    np.testing.assert_allclose(session.run("forward", x, y)[0], want, rtol=1e-5, atol=1e-5)
