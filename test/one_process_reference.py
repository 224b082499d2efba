"""What the multi-rank tests compare with: one unpatched process on the whole batch of a saved tiny DeepSeek-V3."""

import torch

from tiny_models import build_model
from tiny_models import labels_with_ignored
from tiny_models import random_batch
from tiny_models import tiny_deepseek_v3_config

FP32 = dict(atol=1e-5, rtol=1e-5)  # fp32: covers the reductions the ranks reorder


def batch(config, rows: int):
    """(input_ids, labels) of ``rows`` rows, every row with the same number of targets."""
    input_ids, _ = random_batch(config, batch=rows, seq=6, seed=5)
    return input_ids, labels_with_ignored(input_ids)


def saved_reference(folder, rows: int):
    """Saves a tiny DeepSeek-V3 in ``folder``; returns (its path, its loss and gradients on the whole batch)."""
    config = tiny_deepseek_v3_config()
    model = build_model(config)
    model.save_pretrained(folder)
    input_ids, labels = batch(config, rows)
    out = model.train()(input_ids, labels=labels)
    out.loss.backward()
    return str(folder), out.loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def gathered_grads(model) -> dict:
    """Parameter name -> gradient, sharded (DTensor) gradients gathered whole."""
    return {
        name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for name, p in model.named_parameters()
    }


def assert_matches(result: dict, loss: torch.Tensor, grads: dict) -> None:
    """A rank's ``{"loss", "grads"}`` equal the single process's."""
    torch.testing.assert_close(result["loss"], loss, **FP32)
    assert result["grads"].keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(result["grads"][name], grad, **FP32, msg=name)
