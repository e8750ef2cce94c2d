"""Capturing a model: example arguments are traced as the distinct inputs they stand for."""

from __future__ import annotations

import numpy as np
import torch

import kiln


class TwoInputs(torch.nn.Module):
    def forward(self, a, b):
        return a * 2 + b


def test_one_tensor_given_for_two_inputs_stays_two_inputs() -> None:
    """torch.export traces one tensor object passed twice as one input (an LSTM's h and c made from one zeros
    tensor); the program must still read each input where the model reads it."""
    x = torch.zeros(3)
    program = kiln.export(TwoInputs(), (x, x)).load()
    out = program.session().run("forward", np.ones(3, np.float32), np.full(3, 5, np.float32))[0]
    np.testing.assert_array_equal(out, [7, 7, 7])
