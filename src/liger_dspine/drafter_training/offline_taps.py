"""Offline capture: the target's taps and head inputs of every training row, on disk, read back for training.

``liger-dspine capture`` packs a dataset into rows as ``train-drafter`` does, runs the frozen target over them once
(:class:`~liger_dspine.models.dspine.capture.TargetCapture`) and writes shards ``taps-NNNNN.safetensors``, each holding
for its rows ``input_ids``, ``position_ids`` [R, S] long, ``loss_mask`` [R, S] float, ``hidden_states`` [R, S, T*H]
and ``target_last_hidden_states`` [R, S, H] in the capture's dtype, with ``index.json`` naming the shards and what
was captured (target, taps, sequence length, dtype). ``train-drafter --taps DIR`` serves the same rows in the same
seeded order as on-the-fly capture (:class:`TapStream`), read row by row from the shards: the objective then gets the
tensors the on-the-fly capture would compute, and a resumed run continues at its row, whichever shard holds it.
"""

import hashlib
import json
import os
from dataclasses import dataclass

import torch

from liger_dspine.drafter_training import data
from liger_dspine.models.dspine.capture import TargetCapture
from liger_dspine.models.dspine.packing import document_ids_from_position_ids

INDEX = "index.json"
FORMAT = "liger-dspine taps"
TENSORS = ("input_ids", "position_ids", "loss_mask", "hidden_states", "target_last_hidden_states")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def head_fingerprint(target) -> str:
    """A hash of the target's lm_head weight (its bytes, in its dtype): taps fit only the target that made them."""
    weight = target.get_output_embeddings().weight.detach()
    return hashlib.sha256(weight.cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def packed_rows(dataset: str | None, tokenizer_folder: str | None, seq_len: int, vocab_size: int, mask_token_id: int):
    """The rows of ``train-drafter``: ``dataset`` (JSONL) packed into rows of ``seq_len``, or the embedded text."""
    if dataset is None:
        return data.embedded_text_rows(seq_len, vocab_size, mask_token_id)
    tokenizer = data.TokenizerSource(tokenizer_folder)
    documents = data.read_documents(dataset, tokenizer, vocab_size, mask_token_id)
    return data.pack_rows(documents, seq_len, tokenizer.pad_token_id)


@dataclass
class CaptureSummary:
    rows: int
    tokens: int
    shards: int
    bytes: int

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / max(self.tokens, 1)


@torch.no_grad()
def write_taps(
    target,
    rows: list,
    target_layer_ids: list[int],
    output_dir: str,
    rows_per_shard: int,
    batch_size: int = 1,
    mask_token_id: int | None = None,
) -> CaptureSummary:
    """Capture ``rows`` (packed rows, as :func:`packed_rows` gives them) in batches of ``batch_size`` and write shards
    of ``rows_per_shard`` rows and the index to ``output_dir`` (new or empty). ``mask_token_id``: the id the rows were
    checked not to hold, recorded for training."""
    from safetensors.torch import save_file

    if rows_per_shard < 1 or batch_size < 1:
        raise ValueError(
            f"liger-dspine: rows per shard and batch size must be >= 1, got {rows_per_shard}, {batch_size}"
        )
    if os.path.isdir(output_dir) and os.listdir(output_dir):
        raise ValueError(f"liger-dspine: the capture's output folder {output_dir} exists and is not empty")
    os.makedirs(output_dir, exist_ok=True)
    capture = TargetCapture(target, target_layer_ids)
    device = target.get_output_embeddings().weight.device
    shards, total_bytes = [], 0
    for first in range(0, len(rows), rows_per_shard):
        chunk = rows[first : first + rows_per_shard]
        parts = {name: [] for name in TENSORS}
        for start in range(0, len(chunk), batch_size):
            batch = chunk[start : start + batch_size]
            position_ids = torch.cat([row.position_ids for row in batch])
            captured = capture(
                torch.cat([row.input_ids for row in batch]).to(device),
                loss_mask=torch.cat([row.loss_mask for row in batch]).to(device),
                position_ids=position_ids.to(device),
            )
            captured["position_ids"] = position_ids
            for name in TENSORS:
                parts[name].append(captured[name].cpu())
        tensors = {name: torch.cat(values).contiguous() for name, values in parts.items()}
        name = f"taps-{len(shards):05d}.safetensors"
        save_file(tensors, os.path.join(output_dir, name))
        total_bytes += os.path.getsize(os.path.join(output_dir, name))
        shards.append({"file": name, "first_row": first, "rows": len(chunk)})
    seq_len = rows[0].input_ids.shape[1]
    hidden_dtype = str(tensors["hidden_states"].dtype).removeprefix("torch.")
    index = {
        "format": FORMAT,
        "version": 1,
        "rows": len(rows),
        "seq_len": seq_len,
        "target_layer_ids": list(target_layer_ids),
        "hidden_size": target.get_output_embeddings().weight.shape[1],
        "vocab_size": target.get_output_embeddings().weight.shape[0],
        "dtype": hidden_dtype,
        "mask_token_id": mask_token_id,
        "head_input": str(capture.head_input),
        "target_head_fingerprint": head_fingerprint(target),
        "target_model_type": getattr(target.config, "model_type", None),
        "bytes": total_bytes,
        "bytes_per_token": total_bytes / (len(rows) * seq_len),
        "shards": shards,
    }
    with open(os.path.join(output_dir, INDEX), "w") as handle:
        json.dump(index, handle, indent=2)
    return CaptureSummary(len(rows), len(rows) * seq_len, len(shards), total_bytes)


class TapStore:
    """The shards of a capture folder, read a row at a time.

    Args:
        folder: a folder ``write_taps`` wrote (its ``index.json`` and the shards it names).
    """

    def __init__(self, folder: str):
        path = os.path.join(folder, INDEX)
        if not os.path.isfile(path):
            raise ValueError(f"liger-dspine: --taps {folder!r} has no {INDEX}: write it with liger-dspine capture")
        with open(path) as handle:
            try:
                index = json.load(handle)
            except json.JSONDecodeError as error:
                raise ValueError(f"liger-dspine: {path} is not valid JSON ({error.msg})") from None
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            raise ValueError(f"liger-dspine: {path} is not the index of a liger-dspine capture")
        missing = [s["file"] for s in index["shards"] if not os.path.isfile(os.path.join(folder, s["file"]))]
        if missing:
            raise ValueError(f"liger-dspine: {path} names shards that {folder} lacks: {', '.join(missing)}")
        self.folder, self.index = folder, index
        self._starts = [shard["first_row"] for shard in index["shards"]]
        self._handles: dict = {}

    def __len__(self) -> int:
        return self.index["rows"]

    def check(self, target, target_layer_ids: list[int], seq_len: int, dtype: torch.dtype, mask_token_id: int) -> None:
        """A ValueError naming what differs between the capture and this run."""
        index = self.index
        wanted = {
            "target_layer_ids": list(target_layer_ids),
            "seq_len": seq_len,
            "dtype": str(dtype).removeprefix("torch."),
            "mask_token_id": mask_token_id,
            "target_head_fingerprint": head_fingerprint(target),
        }
        differing = [f"{key}: captured {index.get(key)!r}, this run {value!r}" for key, value in wanted.items()
                     if index.get(key) != value]  # fmt: skip
        if differing:
            raise ValueError(
                f"liger-dspine: the taps in {self.folder} do not fit this run ({'; '.join(differing)}): capture them "
                "again with this target, its taps, --seq-len and --dtype"
            )

    def _handle(self, shard: int):
        if shard not in self._handles:
            from safetensors import safe_open

            path = os.path.join(self.folder, self.index["shards"][shard]["file"])
            self._handles[shard] = safe_open(path, framework="pt")
        return self._handles[shard]

    def rows(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """The objective's inputs of these rows, stacked: as ``TargetCapture`` returns them (``document_ids``
        from the stored ``position_ids``)."""
        parts = {name: [] for name in TENSORS}
        for row in indices:
            shard = max(i for i, start in enumerate(self._starts) if start <= row)
            offset = row - self._starts[shard]
            handle = self._handle(shard)
            for name in TENSORS:
                parts[name].append(handle.get_slice(name)[offset : offset + 1])
        batch = {name: torch.cat(values) for name, values in parts.items()}
        batch["document_ids"] = document_ids_from_position_ids(batch.pop("position_ids"))
        return batch


class TapStream:
    """``train-drafter``'s row stream over stored taps: row ``i`` is the row that :class:`~data.RowStream` would
    serve at ``i`` for the same rows and seed, already captured."""

    def __init__(self, store: TapStore, seed: int):
        self.store = store
        self.order = data.RowStream(range(len(store)), seed)

    def batch(self, start: int, count: int) -> dict[str, torch.Tensor]:
        return self.store.rows(self.order.indices(start, count))


def open_tap_stream(
    folder: str, seed: int, target, target_layer_ids: list[int], seq_len: int, dtype, mask_token_id: int
) -> TapStream:
    """The stream of ``train-drafter --taps``, its capture checked against this run."""
    store = TapStore(folder)
    store.check(target, target_layer_ids, seq_len, dtype, mask_token_id)
    return TapStream(store, seed)


def add_arguments(parser) -> None:
    """``train-drafter --taps DIR``."""
    parser.add_argument(
        "--taps",
        help="train from the taps liger-dspine capture wrote to this folder (its rows replace --dataset; --seq-len "
        "defaults to theirs) instead of running the target at each step",
    )


def check_arguments(args) -> None:
    """--taps is a capture folder, given without --dataset; --seq-len is the capture's (the default)."""
    folder = getattr(args, "taps", None)
    if folder is None:
        return
    if args.dataset is not None:
        raise ValueError("liger-dspine: --taps holds the rows: leave out --dataset")
    path = os.path.join(folder, INDEX)
    if not os.path.isfile(path):
        raise ValueError(f"liger-dspine: --taps {folder!r} has no {INDEX}: write it with liger-dspine capture")
    with open(path) as handle:
        try:
            seq_len = json.load(handle)["seq_len"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"liger-dspine: {path} is not the index of a liger-dspine capture") from None
    if "seq_len" not in args.given:
        args.seq_len = seq_len


def already_captured(**batch) -> dict:
    """The capture step of a stream of stored taps: the batch as it is."""
    return batch
