"""The eager greedy reference that kiln's generated tokens are compared with."""

from __future__ import annotations

import torch


def greedy_reference(model, prompt: list[int], new_tokens: int, logits_atol: float) -> list[int]:
    """transformers' greedy `generate` tokens after the prompt, checked to be a fair reference: every greedy choice
    wins by far more than the numerical error, so equal tokens are the right expectation: a margin of 20x the
    logits tolerance (2e-3 for the zoo's 1e-4), itself 25x the largest float32 logit error measured (4.1e-6)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
        logits = model(ref).logits[0, len(prompt) - 1:-1]
    top2 = logits.topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 20 * logits_atol
    return ref[0, len(prompt):].tolist()
