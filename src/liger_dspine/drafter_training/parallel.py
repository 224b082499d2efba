"""How a ``train-drafter`` run spreads over torchrun's processes.

The drafter (``--drafter-parallel``): ``ddp`` replicates it and all-reduces its gradients once per window; ``fsdp``
shards it with FSDP2 (``fully_shard`` per decoder layer, then the objective, whose forward reads the drafter's
remaining weights), the gradients reduce-scattered after each replayed backward.

The frozen target (``--target-parallel``): ``replicate`` keeps it whole on every rank; ``fsdp`` shards each decoder
layer, the rest of the decoder and the head with FSDP2 (gathered one layer at a time in the capture forward); ``tp``
loads a ``--target`` folder with transformers' tensor-parallel plan (``tp_plan="auto"``): the ranks then capture their
micro-batches together, each rank keeping its own rows.

A sharded target's head and embedding weights are DTensors; the objective reads them whole through
:class:`WholeWeight`, gathered for one objective call (its forward and the replay's backward) and dropped after it.
"""

import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from liger_dspine.modules.parallel_state import is_dtensor
from liger_dspine.modules.parallel_state import local_tensor


def under_torchrun() -> bool:
    """Launched by torchrun (any number of processes), or on several ranks: a process group can start."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 or "TORCHELASTIC_RUN_ID" in os.environ


def check_arguments(args) -> None:
    """A ValueError for a combination that cannot run, before anything is loaded."""
    drafter, target = getattr(args, "drafter_parallel", "ddp"), getattr(args, "target_parallel", "replicate")
    sharded = [f"--drafter-parallel {drafter}"] if drafter == "fsdp" else []
    sharded += [f"--target-parallel {target}"] if target != "replicate" else []
    if not sharded:
        return
    if not under_torchrun():
        raise ValueError(f"liger-dspine: {sharded[0]} shards over torchrun's processes: run it under torchrun")
    if target == "tp" and not args.target:
        raise ValueError(
            "liger-dspine: --target-parallel tp loads a --target folder with transformers' tp_plan: save the "
            "--target-config model with save_pretrained and give its folder"
        )
    if getattr(args, "eval_dataset", None) is not None:
        raise ValueError(f"liger-dspine: --eval-dataset evaluates on rank 0 alone: leave it out with {sharded[0]}")


def load_tensor_parallel_target(path: str, dtype):
    """A ``--target`` folder under transformers' tensor-parallel plan over every rank."""
    from transformers import AutoConfig

    from liger_dspine.auto_model import causal_lm_class

    config = AutoConfig.from_pretrained(path)
    cls = causal_lm_class(config)
    if not getattr(config.get_text_config(), "base_model_tp_plan", None):
        raise ValueError(
            f"liger-dspine: --target-parallel tp: the {config.model_type} target has no tensor-parallel plan"
        )
    try:
        from transformers import DistributedConfig
    except ImportError:  # transformers before DistributedConfig
        return cls.from_pretrained(path, dtype=dtype, tp_plan="auto")
    return cls.from_pretrained(path, dtype=dtype, distributed_config=DistributedConfig(tp_plan="auto"))


def shard_target(target, mesh) -> None:
    """FSDP2 over the frozen target: each decoder layer, the decoder's other weights, and the head, apart."""
    from torch.distributed.fsdp import fully_shard

    from liger_dspine.models.dspine.capture import find_decoder

    decoder = find_decoder(target)
    head, embed = target.get_output_embeddings(), target.get_input_embeddings()
    if head.weight is embed.weight:
        raise ValueError(
            "liger-dspine: --target-parallel fsdp shards the head apart from the decoder: this target ties them"
        )
    for layer in decoder.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(decoder, mesh=mesh, reshard_after_forward=True)
    fully_shard(head, mesh=mesh, reshard_after_forward=True)


class WholeWeight(nn.Module):
    """A frozen target module (the head, the embedding) whose weight the objective reads whole: a sharded weight is
    gathered inside :meth:`gathered` (once, however often it is read there), or for one call of the embedding.

    The module is kept out of this one's tree, so its parameters remain the target's alone."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.source = (module,)
        self.bias = getattr(module, "bias", None)
        self._whole = None
        self._depth = 0

    @property
    def weight(self) -> torch.Tensor:
        return self._whole if self._whole is not None else self.source[0].weight

    @contextlib.contextmanager
    def gathered(self):
        if self._depth == 0:
            self._whole = self.source[0].weight.full_tensor()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._whole = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        source = self.source[0]
        with self.gathered():
            weight = self.weight
            if isinstance(source, nn.Embedding) and type(source).forward is nn.Embedding.forward:
                return F.embedding(ids, weight, source.padding_idx, source.max_norm, source.norm_type)
            return torch.func.functional_call(source, {"weight": weight}, (ids,))


def frozen_views(target) -> tuple[nn.Module, nn.Module]:
    """The target's head and embedding as the objective reads them: a sharded one through :class:`WholeWeight`."""
    modules = target.get_output_embeddings(), target.get_input_embeddings()
    return tuple(WholeWeight(m) if is_dtensor(m.weight) else m for m in modules)


def gathering(objective):
    """A context manager gathering the objective's sharded head and embedding for its span."""
    views = [m for m in (objective.lm_head, objective.embed_tokens) if isinstance(m, WholeWeight)]

    @contextlib.contextmanager
    def context():
        with contextlib.ExitStack() as stack:
            for view in views:
                stack.enter_context(view.gathered())
            yield

    return context


class Gathered:
    """The objective as the accumulation window calls it: each call inside ``context``."""

    def __init__(self, objective, context):
        self.objective, self.context = objective, context

    def __call__(self, **kwargs):
        with self.context():
            return self.objective(**kwargs)


def wrap_drafter(objective, mode: str, device):
    """(what the window calls, its replay's ``sync_context``) for the drafter's data parallelism, with the sharded
    target weights gathered around each call and each replayed backward."""
    gather = gathering(objective)
    if not dist.is_initialized():
        return Gathered(objective, gather), lambda last: gather()
    if mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        frozen = {p for p in objective.parameters() if not p.requires_grad}  # a whole target's head and embedding
        for layer in objective.draft_model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(objective, mesh=mesh, ignored_params=frozen or None)
        return Gathered(objective, gather), lambda last: gather()
    ids = [device.index] if device.type == "cuda" else None
    ddp = torch.nn.parallel.DistributedDataParallel(objective, device_ids=ids, broadcast_buffers=False)

    @contextlib.contextmanager
    def sync_context(last):
        with gather(), contextlib.nullcontext() if last else ddp.no_sync():
            yield

    return Gathered(ddp, gather), sync_context


def tensor_parallel_capture(capture):
    """The capture of a tensor-parallel target: every rank runs the target on all ranks' micro-batches (a plan's
    collectives need the same input on every rank) and keeps its own rows."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def run(**micro):
        every = {}
        for key, value in micro.items():
            parts = [torch.empty_like(value) for _ in range(world)]
            dist.all_gather(parts, value.contiguous())
            every[key] = torch.cat(parts)
        batch = capture(**every)
        return {key: local_tensor(value).chunk(world)[rank] for key, value in batch.items()}

    return run


def target_mesh(device):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),))
