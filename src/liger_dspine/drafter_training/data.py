"""Training rows for ``train-drafter``: documents packed into fixed-length rows, served in a seeded order.

Row ``i`` of the stream is a pure function of (rows, seed, i): epoch ``i // len(rows)`` visits the rows in a
permutation drawn from ``seed + epoch``. The data position saved in a checkpoint is therefore one integer.
"""

import json
from importlib import resources

import torch

from liger_dspine.models.dspine.packing import chat_loss_mask
from liger_dspine.models.dspine.packing import pack_documents


def embedded_text_rows(seq_len: int, vocab_size: int | None = None, mask_token_id: int | None = None) -> list:
    """The embedded demo text as bytes, in windows of ``seq_len`` tokens overlapping by half (one document each);
    its bytes are checked against the vocabulary and the mask token id as a dataset's ids are."""
    text = resources.files("liger_dspine").joinpath("data/demo_corpus.txt").read_bytes()
    _check_token_ids(list(text), "the embedded demo text", "its bytes", vocab_size, mask_token_id)
    tokens = torch.tensor(list(text), dtype=torch.long)
    if len(tokens) < seq_len:
        raise ValueError(f"liger-dspine: the embedded text has {len(tokens)} bytes, fewer than --seq-len {seq_len}")
    stride = max(1, seq_len // 2)
    starts = list(range(0, len(tokens) - seq_len + 1, stride))
    return [pack_documents([(tokens[s : s + seq_len], torch.ones(seq_len))]) for s in starts]


class TokenizerSource:
    """The tokenizer of a dataset's chat messages, loaded from ``folder`` when the first chat line needs it (token
    ids need none), or one already loaded."""

    def __init__(self, folder: str | None = None, tokenizer=None):
        self.folder = folder
        self.tokenizer = tokenizer

    def get(self, where: str):
        if self.tokenizer is None:
            if self.folder is None:
                raise ValueError(f"liger-dspine: {where} holds chat messages: pass --tokenizer")
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.folder)
        return self.tokenizer

    @property
    def pad_token_id(self) -> int:
        """The loaded tokenizer's padding id, else 0."""
        return getattr(self.tokenizer, "pad_token_id", None) or 0


RECORD_FORMS = "a list of token ids, {'input_ids': [...], 'loss_mask': [...]} or {'messages': [...]}"


def read_documents(
    path: str,
    tokenizer: TokenizerSource | None = None,
    vocab_size: int | None = None,
    mask_token_id: int | None = None,
) -> list:
    """[(token ids [S], loss mask [S]), ...] from a JSONL file (see ``--dataset``), each line checked: token ids are
    integers (not booleans) in ``[0, vocab_size)`` other than ``mask_token_id``, a loss mask is 0s and 1s, one per
    token id, and nothing else is in a line. A ValueError names the file, the line and the field, before training
    starts. A line whose tokens are all unsupervised (a prompt-only conversation) is kept: it trains nothing."""
    tokenizer = tokenizer or TokenizerSource()
    documents = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"liger-dspine: {where} is not JSON ({error.msg})") from None
            documents.append(_document(record, where, tokenizer, vocab_size, mask_token_id))
    if not documents:
        raise ValueError(f"liger-dspine: {path} holds no documents")
    return documents


def _document(record, where: str, tokenizer: TokenizerSource, vocab_size, mask_token_id):
    if isinstance(record, list):
        record = {"input_ids": record}
    if not isinstance(record, dict):
        raise ValueError(f"liger-dspine: {where} needs {RECORD_FORMS}, got {_json(record)}")
    if "messages" in record:
        _refuse_other_fields(record, where, {"messages"})
        ids, mask = _chat_document(record["messages"], where, tokenizer)
        _check_token_ids(ids.tolist(), where, "messages (tokenized)", vocab_size, mask_token_id)
        return ids, mask
    if "input_ids" not in record:
        raise ValueError(f"liger-dspine: {where} needs {RECORD_FORMS}, got the fields {sorted(record)}")
    _refuse_other_fields(record, where, {"input_ids", "loss_mask"})
    ids = record["input_ids"]
    if not isinstance(ids, list) or not ids:
        raise ValueError(f"liger-dspine: {where} input_ids must be a non-empty list of token ids, got {_json(ids)}")
    for index, value in enumerate(ids):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"liger-dspine: {where} input_ids[{index}] is {_json(value)}, not a token id (an integer)")
    _check_token_ids(ids, where, "input_ids", vocab_size, mask_token_id)
    mask = record.get("loss_mask", [1] * len(ids))
    if not isinstance(mask, list):
        raise ValueError(f"liger-dspine: {where} loss_mask must be a list of 0 and 1, got {_json(mask)}")
    if len(mask) != len(ids):
        raise ValueError(f"liger-dspine: {where} has {len(ids)} token ids but {len(mask)} loss_mask values")
    for index, value in enumerate(mask):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value not in (0, 1):
            raise ValueError(f"liger-dspine: {where} loss_mask[{index}] is {_json(value)}, not 0 or 1")
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.float32)


def _chat_document(messages, where: str, tokenizer: TokenizerSource):
    """Token ids and loss mask of a conversation; one without an assistant turn is all unsupervised."""
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ValueError(f"liger-dspine: {where} messages must be a non-empty list of objects, got {_json(messages)}")
    chat_tokenizer = tokenizer.get(where)
    if not any(message.get("role") == "assistant" for message in messages):
        encoded = chat_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)
        ids = torch.tensor(encoded["input_ids"], dtype=torch.long)
        return ids, torch.zeros(ids.shape, dtype=torch.float32)
    try:
        return chat_loss_mask(chat_tokenizer, messages)
    except ValueError as error:
        raise ValueError(f"liger-dspine: {where} messages: {str(error).removeprefix('liger-dspine: ')}") from None


def _refuse_other_fields(record: dict, where: str, known: set) -> None:
    unknown = sorted(set(record) - known)
    if unknown:
        raise ValueError(
            f"liger-dspine: {where} has the field(s) {unknown}, which train-drafter does not read: a line holds "
            f"{RECORD_FORMS}"
        )


def _check_token_ids(ids: list, where: str, field: str, vocab_size: int | None, mask_token_id: int | None) -> None:
    for index, value in enumerate(ids):
        if value < 0 and vocab_size is None:
            raise ValueError(f"liger-dspine: {where} has token id {value} in {field} (index {index}), a negative id")
        if vocab_size is not None and not 0 <= value < vocab_size:
            raise ValueError(
                f"liger-dspine: {where} has token id {value} in {field} (index {index}), outside the target's "
                f"vocabulary [0, {vocab_size})"
            )
        if value == mask_token_id:
            raise ValueError(
                f"liger-dspine: {where} has token id {value} in {field} (index {index}), the drafter's mask token id "
                "(--mask-token-id), which must never be in the data"
            )


def _json(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


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

    def indices(self, start: int, count: int) -> list[int]:
        """The indices into ``rows`` of the stream's rows ``start .. start + count - 1``."""
        return [int(self._order(i // len(self.rows))[i % len(self.rows)]) for i in range(start, start + count)]

    def batch(self, start: int, count: int) -> dict:
        """Rows ``start .. start + count - 1`` of the stream, stacked: input_ids, position_ids, loss_mask [count, S]."""
        picked = [self.rows[index] for index in self.indices(start, count)]
        return {
            "input_ids": torch.cat([row.input_ids for row in picked]),
            "position_ids": torch.cat([row.position_ids for row in picked]),
            "loss_mask": torch.cat([row.loss_mask for row in picked]),
        }
