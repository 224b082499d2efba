"""Training rows for ``train-drafter``: documents packed into fixed-length rows, served in a seeded order.

Row ``i`` of the stream is a pure function of (rows, seed, i): epoch ``i // len(rows)`` visits the rows in a
permutation drawn from ``seed + epoch``. The data position saved in a checkpoint is therefore one integer.
"""

import json
from importlib import resources

import torch

from liger_dspine.models.dspine.packing import chat_loss_mask
from liger_dspine.models.dspine.packing import pack_documents


def embedded_text_rows(seq_len: int) -> list:
    """The embedded demo text as bytes, in windows of ``seq_len`` tokens overlapping by half (one document each)."""
    text = resources.files("liger_dspine").joinpath("data/demo_corpus.txt").read_bytes()
    tokens = torch.tensor(list(text), dtype=torch.long)
    if len(tokens) < seq_len:
        raise ValueError(f"liger-dspine: the embedded text has {len(tokens)} bytes, fewer than --seq-len {seq_len}")
    stride = max(1, seq_len // 2)
    starts = list(range(0, len(tokens) - seq_len + 1, stride))
    return [pack_documents([(tokens[s : s + seq_len], torch.ones(seq_len))]) for s in starts]


def read_documents(path: str, tokenizer=None, vocab_size: int | None = None) -> list:
    """[(token ids [S], loss mask [S]), ...] from a JSONL file (see ``--dataset``); with ``vocab_size``, every id
    must be in ``[0, vocab_size)`` (a ValueError naming the line otherwise, before training starts)."""
    documents = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"liger-dspine: {path}:{number} is not JSON ({error.msg})") from None
            if isinstance(record, dict) and "messages" in record:
                if tokenizer is None:
                    raise ValueError(f"liger-dspine: {path}:{number} holds chat messages: pass --tokenizer")
                documents.append(chat_loss_mask(tokenizer, record["messages"]))
                continue
            ids = record.get("input_ids") if isinstance(record, dict) else record
            if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
                raise ValueError(
                    f"liger-dspine: {path}:{number} needs a non-empty list of token ids, {{'input_ids': [...]}} "
                    "or {'messages': [...]}"
                )
            bad = None if vocab_size is None else next((i for i in ids if not 0 <= i < vocab_size), None)
            if bad is not None:
                raise ValueError(
                    f"liger-dspine: {path}:{number} has token id {bad}, outside the target's vocabulary "
                    f"[0, {vocab_size})"
                )
            mask = record.get("loss_mask") if isinstance(record, dict) else None
            if mask is not None and len(mask) != len(ids):
                raise ValueError(f"liger-dspine: {path}:{number} has {len(ids)} token ids but {len(mask)} mask values")
            documents.append((torch.tensor(ids), torch.tensor(mask if mask is not None else [1.0] * len(ids))))
    if not documents:
        raise ValueError(f"liger-dspine: {path} holds no documents")
    return documents


def pack_rows(documents: list, seq_len: int, pad_token_id: int = 0) -> list:
    """Documents packed greedily into rows of ``seq_len`` tokens; a longer document is cut into pieces, and the
    tail of a row is padding (its own document, unsupervised)."""
    pieces = [
        (ids[s : s + seq_len], mask[s : s + seq_len]) for ids, mask in documents for s in range(0, len(ids), seq_len)
    ]
    rows, current, used = [], [], 0
    for ids, mask in pieces:
        if used + len(ids) > seq_len:
            rows.append(_close_row(current, used, seq_len, pad_token_id))
            current, used = [], 0
        current.append((ids, mask))
        used += len(ids)
    rows.append(_close_row(current, used, seq_len, pad_token_id))
    return rows


def _close_row(documents: list, used: int, seq_len: int, pad_token_id: int):
    if used < seq_len:
        documents = documents + [(torch.full((seq_len - used,), pad_token_id), torch.zeros(seq_len - used))]
    return pack_documents(documents)


class RowStream:
    """Serves rows [input_ids, position_ids, loss_mask] by global index, in a seeded order per epoch."""

    def __init__(self, rows: list, seed: int):
        self.rows = rows
        self.seed = seed
        self._orders: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._orders = {epoch: torch.randperm(len(self.rows), generator=generator)}
        return self._orders[epoch]

    def batch(self, start: int, count: int) -> dict:
        """Rows ``start .. start + count - 1`` of the stream, stacked: input_ids, position_ids, loss_mask [count, S]."""
        picked = [
            self.rows[int(self._order(i // len(self.rows))[i % len(self.rows)])] for i in range(start, start + count)
        ]
        return {
            "input_ids": torch.cat([row.input_ids for row in picked]),
            "position_ids": torch.cat([row.position_ids for row in picked]),
            "loss_mask": torch.cat([row.loss_mask for row in picked]),
        }
