"""``train-drafter``'s inputs: dataset lines checked where they are read, the tokenizer loaded only for text, the
drafter config file given, and rows without supervised tokens.

The runs are fp32 on the CPU with ``--no-liger`` and one or two steps of a tiny target and drafter.
"""

import json
from types import SimpleNamespace

import pytest
import torch
from test_dspine_capture import word_tokenizer  # noqa: E402
from test_dspine_train_drafter import parse  # noqa: E402

from liger_dspine.cli import main
from liger_dspine.drafter_training import data
from liger_dspine.drafter_training.setup import drafter_config
from liger_dspine.models.dspine import DSpineDraftConfig
from tiny_dspine import TINY_MASK_TOKEN
from tiny_dspine import TINY_VOCAB


def write_lines(tmp_path, *lines) -> str:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


# ------------------------------------------------------------------------------------------------ dataset lines
@pytest.mark.parametrize(
    "line, message",
    [
        ("[1, true, 3]", "input_ids[1] is true, not a token id (an integer)"),
        ('{"input_ids": [1, false]}', "input_ids[1] is false, not a token id (an integer)"),
        ('{"input_ids": [1, 2.0]}', "input_ids[1] is 2.0, not a token id (an integer)"),
        ('{"input_ids": [1, 3.5]}', "input_ids[1] is 3.5, not a token id (an integer)"),
        ('{"input_ids": [[1, 2], 3]}', "input_ids[0] is [1, 2], not a token id (an integer)"),
        ('{"input_ids": [1, -4]}', "has token id -4 in input_ids (index 1), outside the target's vocabulary [0, 96)"),
        ('{"input_ids": [1, 96]}', "has token id 96 in input_ids (index 1), outside the target's vocabulary [0, 96)"),
        (
            f'{{"input_ids": [1, {TINY_MASK_TOKEN}]}}',
            f"has token id {TINY_MASK_TOKEN} in input_ids (index 1), the drafter's mask token id (--mask-token-id), "
            "which must never be in the data",
        ),
        ('{"input_ids": []}', "input_ids must be a non-empty list of token ids, got []"),
        ("[]", "input_ids must be a non-empty list of token ids, got []"),
        ('{"input_ids": "1 2"}', 'input_ids must be a non-empty list of token ids, got "1 2"'),
        ('{"input_ids": [1, 2], "loss_mask": ["a", 1]}', 'loss_mask[0] is "a", not 0 or 1'),
        ('{"input_ids": [1, 2], "loss_mask": [1, true]}', "loss_mask[1] is true, not 0 or 1"),
        ('{"input_ids": [1, 2], "loss_mask": [0.5, 1]}', "loss_mask[0] is 0.5, not 0 or 1"),
        ('{"input_ids": [1, 2], "loss_mask": [NaN, 1]}', "loss_mask[0] is NaN, not 0 or 1"),
        ('{"input_ids": [1, 2], "loss_mask": [[1], 1]}', "loss_mask[0] is [1], not 0 or 1"),
        ('{"input_ids": [1, 2], "loss_mask": "11"}', 'loss_mask must be a list of 0 and 1, got "11"'),
        ('{"input_ids": [1, 2], "loss_mask": null}', "loss_mask must be a list of 0 and 1, got null"),
        ('{"input_ids": [1, 2], "loss_mask": [1]}', "has 2 token ids but 1 loss_mask values"),
        ('{"input_ids": [1, 2], "labels": [1, 2]}', "has the field(s) ['labels'], which train-drafter does not read"),
        ('{"text": "no ids"}', "needs a list of token ids, {'input_ids': [...], 'loss_mask': [...]} or {'messages'"),
        ("3", "needs a list of token ids, {'input_ids': [...], 'loss_mask': [...]} or {'messages': [...]}, got 3"),
        ('{"messages": []}', "messages must be a non-empty list of objects, got []"),
        ('{"messages": [{"role": "user", "content": "hi"}], "tools": []}', "has the field(s) ['tools']"),
    ],
)
def test_a_bad_dataset_line_is_named_with_its_field(tmp_path, line, message):
    path = write_lines(tmp_path, "[1, 2, 3]", line)
    with pytest.raises(ValueError) as error:
        data.read_documents(path, data.TokenizerSource(tokenizer=word_tokenizer()), TINY_VOCAB, TINY_MASK_TOKEN)
    assert str(error.value).startswith(f"liger-dspine: {path}:2 {message}"), str(error.value)


def test_accepted_lines_and_their_masks(tmp_path):
    path = write_lines(
        tmp_path,
        "[4, 5]",
        '{"input_ids": [1, 2, 3], "loss_mask": [0, 1.0, 1]}',
        '{"input_ids": [6, 7], "loss_mask": [0, 0]}',  # prompt-only: kept, it trains nothing
        '{"messages": [{"role": "user", "content": "hi"}]}',  # no assistant turn: unsupervised
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}',
    )
    documents = data.read_documents(path, data.TokenizerSource(tokenizer=word_tokenizer()), TINY_VOCAB, 95)
    assert [(ids.tolist(), mask.tolist()) for ids, mask in documents] == [
        ([4, 5], [1.0, 1.0]),
        ([1, 2, 3], [0.0, 1.0, 1.0]),
        ([6, 7], [0.0, 0.0]),
        ([1, 3, 5, 4], [0.0, 0.0, 0.0, 0.0]),  # user : hi <eot>
        ([1, 3, 5, 4, 2, 3, 6, 4], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]),
    ]


def test_tokenized_messages_are_checked_like_token_ids(tmp_path):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "bye"}]
    path = write_lines(tmp_path, json.dumps({"messages": messages}))
    with pytest.raises(ValueError) as error:  # "bye" is token 8
        data.read_documents(path, data.TokenizerSource(tokenizer=word_tokenizer()), TINY_VOCAB, mask_token_id=8)
    assert str(error.value) == (
        f"liger-dspine: {path}:1 has token id 8 in messages (tokenized) (index 6), the drafter's mask token id "
        "(--mask-token-id), which must never be in the data"
    )


def test_token_ids_need_no_tokenizer_and_messages_name_the_missing_one(tmp_path):
    source = data.TokenizerSource(folder=str(tmp_path / "no-such-folder"))
    ids_only = write_lines(tmp_path, "[1, 2, 3]")
    assert [ids.tolist() for ids, _ in data.read_documents(ids_only, source, TINY_VOCAB)] == [[1, 2, 3]]
    assert source.tokenizer is None and source.pad_token_id == 0
    chat = tmp_path / "chat.jsonl"
    chat.write_text('[1, 2]\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(ValueError, match=rf"^liger-dspine: {chat}:2 holds chat messages: pass --tokenizer$"):
        data.read_documents(str(chat), data.TokenizerSource(), TINY_VOCAB)


def test_the_embedded_text_refuses_a_mask_token_it_holds(tmp_path, capsys):
    """The demo text is bytes; 101 is "e"."""
    argv = ["train-drafter", "--tiny", "--no-liger", "--steps", "1", "--mask-token-id", "101"]
    assert main([*argv, "--output-dir", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(
        "liger-dspine: the embedded demo text has token id 101 in its bytes (index 7), the drafter's mask token id"
    ), error


# --------------------------------------------------------------------------------------------- whole runs
SMALL_DRAFTER = [
    "--steps", "1", "--seq-len", "8", "--batch-size", "1", "--num-anchors", "4", "--block-size", "4",
    "--drafter-layers", "1", "--target-layer-ids", "1", "--drafter-heads", "2", "--drafter-kv-heads", "1",
    "--drafter-head-dim", "16", "--drafter-intermediate-size", "32", "--transfer-rank", "8", "--message-size", "4",
    "--top-k", "3", "--dtype", "float32", "--no-liger",
]  # fmt: skip


def test_a_target_folder_without_a_tokenizer_trains_on_token_ids(tmp_path, capsys):
    """The demo's DeepSeek-V3 target, whose tokenizer class cannot be built without files."""
    from liger_dspine.auto_model import causal_lm_from_config
    from liger_dspine.demo import demo_config

    folder = tmp_path / "target"
    torch.manual_seed(0)
    causal_lm_from_config(demo_config(), dtype=torch.float32).save_pretrained(folder)  # no tokenizer files
    dataset = write_lines(tmp_path, json.dumps(list(range(1, 9))), json.dumps(list(range(9, 17))))
    argv = ["train-drafter", "--target", str(folder), "--dataset", dataset, "--mask-token-id", "0"]
    assert main([*argv, *SMALL_DRAFTER, "--output-dir", str(tmp_path / "out")]) == 0, capsys.readouterr().err
    assert (tmp_path / "out" / "checkpoint-1" / "model.safetensors").is_file()


def test_prompt_only_rows_train_nothing_and_the_run_goes_on(tmp_path):
    """Rows of 8 tokens, one micro-batch each: every window of two holds the prompt-only row or the other."""
    metrics = tmp_path / "metrics.csv"
    dataset = write_lines(
        tmp_path,
        json.dumps({"input_ids": list(range(1, 9)), "loss_mask": [0] * 8}),
        json.dumps({"input_ids": list(range(9, 17)), "loss_mask": [0, 0] + [1] * 6}),
    )
    argv = ["train-drafter", "--tiny", "--no-liger", "--dataset", dataset, "--mask-token-id", "0", "--seq-len", "8"]
    argv += ["--batch-size", "1", "--accumulation-steps", "2", "--steps", "2", "--metrics-csv", str(metrics)]
    assert main([*argv, "--output-dir", str(tmp_path / "out")]) == 0
    losses = [float(line.split(",")[1]) for line in metrics.read_text().splitlines()[1:]]
    assert len(losses) == 2 and all(loss > 0 and torch.isfinite(torch.tensor(loss)) for loss in losses), losses


# ------------------------------------------------------------------------------------------- drafter config
def drafter_config_file(path, layers: int):
    config = DSpineDraftConfig(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=256,
        block_size=4,
        dflash_config={"mask_token_id": 0, "target_layer_ids": [0, 1][:layers]},
        dspine_config={"transfer_rank": 8, "message_size": 4, "top_k": 3},
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    config.to_json_file(path)


def test_the_drafter_config_file_given_is_the_one_loaded(tmp_path):
    drafter_config_file(tmp_path / "config.json", layers=2)
    drafter_config_file(tmp_path / "small.json", layers=1)
    target = SimpleNamespace(config=SimpleNamespace(hidden_size=64, vocab_size=256, num_hidden_layers=2))
    small = drafter_config(parse("--drafter-config", str(tmp_path / "small.json")), target)
    assert (small.num_hidden_layers, small.target_layer_ids) == (1, [0])
    folder = drafter_config(parse("--drafter-config", str(tmp_path)), target)  # a folder: its config.json
    assert (folder.num_hidden_layers, folder.target_layer_ids) == (2, [0, 1])


@pytest.mark.parametrize(
    "given, message", [("missing", "is neither a config file nor a folder"), ("", "is a folder without a config.json")]
)
def test_a_drafter_config_that_is_not_there_is_named(tmp_path, capsys, given, message):
    path = str(tmp_path / given) if given else str(tmp_path)
    assert main(["train-drafter", "--tiny", "--no-liger", "--drafter-config", path, "--output-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"liger-dspine: --drafter-config {path!r} {message}\n"
