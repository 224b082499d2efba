"""DSpine checkpoint folders: check one against the drafter its config describes, and convert the older layout.

SpecForge's layout (what ``save_pretrained`` writes): ``config.json`` with ``model_type "qwen3"``,
``architectures ["DSpineDraftModel"]``, ``auto_map``, ``dflash_config`` and ``dspine_config``; safetensors weights
keyed like ``DSpineDraftModel.state_dict()``. This package's older layout differs only in ``model_type "dspine"``
(and no ``auto_map``): converting rewrites ``config.json`` and copies every other file.
"""

import json
import shutil
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path

from liger_dspine.models.dspine.configuration import SPECFORGE_IDENTITY
from liger_dspine.models.dspine.configuration import DSpineDraftConfig
from liger_dspine.models.dspine.configuration import is_dspine_config_dict

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


@dataclass
class CheckpointReport:
    """What :func:`check_checkpoint` found; ``problems`` is empty for a checkpoint SpecForge and this package load."""

    folder: str
    layout: str = "unknown"
    summary: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        lines = [f"DSpine checkpoint {self.folder}", f"  layout: {self.layout}"]
        lines += [f"  {line}" for line in self.summary]
        if self.ok:
            lines.append("  OK: config, keys and shapes match the drafter")
        else:
            lines.append(f"  {len(self.problems)} problem(s):")
            lines += [f"    - {problem}" for problem in self.problems]
        return "\n".join(lines)


_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}


def read_json_object(path: Path) -> dict:
    """The JSON object in ``path``; a ValueError naming the file when it is not JSON or holds something else."""
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"liger-dspine: {path} is not valid JSON ({error})") from None
    if not isinstance(value, dict):
        kind = "null" if value is None else _JSON_KINDS.get(type(value), type(value).__name__)
        raise ValueError(f"liger-dspine: {path} must hold a JSON object, it holds {kind}")
    return value


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"liger-dspine: {folder} has no config.json")
    return read_json_object(path)


def _weight_files(folder: Path) -> list[str]:
    """The safetensors files of the folder: those its index names (each must exist), else the single file."""
    index = folder / WEIGHTS_INDEX
    if not index.is_file():
        if (folder / WEIGHTS).is_file():
            return [WEIGHTS]
        raise ValueError(f"liger-dspine: {folder} has neither {WEIGHTS} nor {WEIGHTS_INDEX}")
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
        raise ValueError(f"liger-dspine: {index} has no weight_map of tensor names to file names")
    files = sorted(set(weight_map.values()))
    missing = [name for name in files if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"liger-dspine: {index} names shards that {folder} lacks: {', '.join(missing)}")
    return files


def _weight_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Key -> shape of every tensor in the folder's safetensors files, read from their headers only."""
    from safetensors import SafetensorError
    from safetensors import safe_open

    shapes = {}
    for name in _weight_files(folder):
        path = folder / name
        try:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():
                    shapes[key] = tuple(handle.get_slice(key).get_shape())
        except (SafetensorError, OSError) as error:
            raise ValueError(
                f"liger-dspine: {path} is not a readable safetensors file (truncated or damaged?): {error}"
            ) from None
    return shapes


def expected_shapes(config: DSpineDraftConfig) -> dict[str, tuple[int, ...]]:
    """Key -> shape of the drafter's state dict (built on the meta device)."""
    import torch

    from liger_dspine.models.dspine.modeling import DSpineDraftModel

    with torch.device("meta"):
        model = DSpineDraftModel(config)
    return {key: tuple(value.shape) for key, value in model.state_dict().items()}


def check_checkpoint(folder) -> CheckpointReport:
    """Check a checkpoint folder: a DSpine config that validates, its layout, and weight keys and shapes."""
    folder = Path(folder)
    report = CheckpointReport(str(folder))
    config_dict = _read_config(folder)
    if not is_dspine_config_dict(config_dict):
        report.problems.append(
            f"config.json is not a DSpine drafter's: model_type={config_dict.get('model_type')!r}, "
            f"architectures={config_dict.get('architectures')!r}, no dspine_config"
        )
        return report
    identity = {key: config_dict.get(key) for key in SPECFORGE_IDENTITY}
    if identity == SPECFORGE_IDENTITY:
        report.layout = "SpecForge (model_type qwen3, architectures DSpineDraftModel)"
    elif config_dict.get("model_type") == DSpineDraftConfig.model_type:
        report.layout = 'older liger-dspine (model_type "dspine"): convert it with `liger-dspine convert`'
        report.problems.append('model_type "dspine" is not SpecForge\'s layout (SpecForge needs "qwen3")')
    else:
        report.layout = "SpecForge-like, incomplete"
        for key, value in SPECFORGE_IDENTITY.items():
            if config_dict.get(key) != value:
                report.problems.append(f"config.json {key} is {config_dict.get(key)!r}, SpecForge needs {value!r}")
    for key in ("dflash_config", "dspine_config"):
        if not isinstance(config_dict.get(key), dict):
            report.problems.append(f"config.json has no {key} entry")
    try:
        config = DSpineDraftConfig.from_dict(dict(config_dict))
    except (ValueError, TypeError) as error:
        report.problems.append(f"config does not validate: {error}")
        return report
    report.summary.append(
        f"drafter: {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}, "
        f"block {config.block_size}, taps {config.target_layer_ids}, mask token {config.mask_token_id}"
    )
    try:
        found = _weight_shapes(folder)
    except ValueError as error:
        report.problems.append(str(error).removeprefix("liger-dspine: "))
        return report
    expected = expected_shapes(config)
    report.summary.append(f"weights: {len(found)} tensors, {len(expected)} expected")
    for key in sorted(set(expected) - set(found)):
        report.problems.append(f"missing key {key} {list(expected[key])}")
    for key in sorted(set(found) - set(expected)):
        report.problems.append(f"unexpected key {key} {list(found[key])}")
    for key in sorted(set(found) & set(expected)):
        if found[key] != expected[key]:
            report.problems.append(f"key {key} has shape {list(found[key])}, the config needs {list(expected[key])}")
    return report


def convert_checkpoint(source, destination) -> CheckpointReport:
    """Write ``source`` (older ``model_type "dspine"`` layout, or already SpecForge's) to ``destination`` in
    SpecForge's layout; return the check of the result."""
    source, destination = Path(source), Path(destination)
    config_dict = _read_config(source)
    if not is_dspine_config_dict(config_dict):
        raise ValueError(
            f"liger-dspine: {source}/config.json is not a DSpine drafter's (model_type="
            f"{config_dict.get('model_type')!r}, architectures={config_dict.get('architectures')!r})"
        )
    if destination.exists() and any(destination.iterdir()):
        raise ValueError(f"liger-dspine: {destination} exists and is not empty")
    config = DSpineDraftConfig.from_dict(dict(config_dict))  # validates and completes dspine_config
    destination.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.name != "config.json":
            (shutil.copytree if path.is_dir() else shutil.copy2)(path, destination / path.name)
    config.to_json_file(destination / "config.json", use_diff=True)
    return check_checkpoint(destination)
