"""Checkpoints of a ``train-drafter`` run: ``OUTPUT/checkpoint-STEP/`` holds the drafter in SpecForge's layout
(``config.json`` and ``model.safetensors``, what ``save_pretrained`` writes) and ``training_state.pt``: optimizer,
scheduler, step, data position and every rank's RNG states, so that a resumed run continues exactly."""

import json
import os
import random
import re

import torch
import torch.distributed as dist

STATE_FILE = "training_state.pt"
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def _rng_state() -> dict:
    state = {"python": random.getstate(), "cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _gather(value):
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def save_checkpoint(output_dir: str, draft, optimizer, scheduler, step: int, position: int) -> str:
    """Write ``checkpoint-STEP`` (rank 0 writes; every rank's RNG state goes in)."""
    rng_states = _gather(_rng_state())
    weights, optimizer_state = _whole_states(draft, optimizer)
    folder = os.path.join(output_dir, f"checkpoint-{step}")
    if not dist.is_initialized() or dist.get_rank() == 0:
        draft.save_pretrained(folder, state_dict=weights)
        state = {
            "step": step,
            "position": position,
            "optimizer": optimizer_state,
            "scheduler": scheduler.state_dict(),
            "rng": rng_states,
        }
        torch.save(state, os.path.join(folder, STATE_FILE + ".tmp"))
        os.replace(os.path.join(folder, STATE_FILE + ".tmp"), os.path.join(folder, STATE_FILE))
    if dist.is_initialized():
        dist.barrier()
    return folder


def latest_checkpoint(output_dir: str) -> str | None:
    """The complete checkpoint (its training state written last) of the highest step, or None."""
    if not os.path.isdir(output_dir):
        return None
    steps = [int(m.group(1)) for m in map(CHECKPOINT.match, os.listdir(output_dir)) if m]
    for step in sorted(steps, reverse=True):
        folder = os.path.join(output_dir, f"checkpoint-{step}")
        if os.path.isfile(os.path.join(folder, STATE_FILE)):
            return folder
    return None


def load_checkpoint(folder: str, draft, optimizer, scheduler) -> tuple[int, int]:
    """Restore the drafter's weights, the optimizer, the scheduler and this rank's RNG; returns (step, position)."""
    load_weights(folder, draft)
    return load_training_state(folder, draft, optimizer, scheduler)


def load_weights(folder: str, draft) -> None:
    """The drafter's weights (whole: before any sharding)."""
    from safetensors.torch import load_file

    _check_same_config(folder, draft.config)
    weights = load_file(os.path.join(folder, "model.safetensors"), device=str(draft.device))
    draft.load_state_dict(weights, strict=True)


def load_training_state(folder: str, draft, optimizer, scheduler) -> tuple[int, int]:
    """The optimizer (sharded as the drafter is), the scheduler and this rank's RNG; returns (step, position)."""
    state = torch.load(os.path.join(folder, STATE_FILE), map_location="cpu", weights_only=False)
    if _is_sharded(draft):
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        named = _renumbered(state["optimizer"], dict(enumerate(_parameter_names(draft))))
        set_optimizer_state_dict(draft, optimizer, named, options=StateDictOptions(full_state_dict=True))
    else:
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    rank = dist.get_rank() if dist.is_initialized() else 0
    if len(state["rng"]) != (dist.get_world_size() if dist.is_initialized() else 1):
        raise ValueError(f"liger-dspine: {folder} was written by {len(state['rng'])} ranks; resume it with as many")
    _set_rng_state(state["rng"][rank])
    return state["step"], state["position"]


def _parameter_names(draft) -> list[str]:
    return [name for name, _ in draft.named_parameters()]


def _is_sharded(draft) -> bool:
    from liger_dspine.modules.parallel_state import is_dtensor

    return any(is_dtensor(p) for p in draft.parameters())


def _renumbered(optimizer_state: dict, keys: dict) -> dict:
    """An optimizer state dict with its parameter keys mapped through ``keys`` (index <-> name)."""
    groups = [{**group, "params": [keys[p] for p in group["params"]]} for group in optimizer_state["param_groups"]]
    return {"state": {keys[p]: value for p, value in optimizer_state["state"].items()}, "param_groups": groups}


def _whole_states(draft, optimizer) -> tuple[dict | None, dict]:
    """(weights, optimizer state) as one process has them: gathered from an FSDP2-sharded drafter onto rank 0's CPU,
    its optimizer state keyed by parameter index as ``optimizer.state_dict()`` keys it. None: the drafter's own."""
    if not _is_sharded(draft):
        return None, optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(draft, options=options)
    named = get_optimizer_state_dict(draft, optimizer, options=options)
    indices = {name: index for index, name in enumerate(_parameter_names(draft))}
    return weights, (_renumbered(named, indices) if named else {})


# config.json entries that do not describe the drafter's computation
_RUN_ONLY_KEYS = {
    "transformers_version", "architectures", "auto_map", "model_type", "dtype", "torch_dtype", "_name_or_path",
    "use_cache",
}  # fmt: skip


def _check_same_config(folder: str, config) -> None:
    """Refuse to resume a checkpoint whose drafter this run's arguments would build differently (block size, target
    layers, mask token, widths): its weights were trained for the saved one."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return
    with open(path) as file:
        saved = json.load(file)
    current = json.loads(config.to_json_string(use_diff=False))
    differing = sorted(key for key in saved.keys() - _RUN_ONLY_KEYS if saved[key] != current.get(key))
    if differing:
        details = "; ".join(f"{key}: saved {saved[key]!r}, now {current.get(key)!r}" for key in differing)
        raise ValueError(
            f"liger-dspine: {folder} holds a drafter built with another configuration ({details}); resume with the "
            "arguments it was trained with, or use another --output-dir"
        )
