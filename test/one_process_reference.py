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


def rank_rows(rank: int, world_size: int, rows: int) -> slice:
    """A rank's share of a batch of ``rows`` rows."""
    return slice(rank * rows // world_size, (rank + 1) * rows // world_size)


def rank_step(model, rank: int, world_size: int, rows: int) -> dict:
    """Forward and backward of this rank's share of the ``rows``-row batch: {"loss": the ranks' mean loss, "logits":
    whether any came back, "grads": the gathered gradients}."""
    import torch.distributed as dist

    input_ids, labels = batch(model.config, rows)
    share = rank_rows(rank, world_size, rows)
    out = model(input_ids[share], labels=labels[share])
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    return {"loss": loss / world_size, "logits": out.logits is not None, "grads": gathered_grads(model)}


def fully_shard_layers(model, world_size: int) -> None:
    """FSDP2 by hand on a CPU mesh of ``world_size``: every MLP, every decoder layer, then the model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer.mlp, mesh=mesh)
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
