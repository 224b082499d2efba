"""Offline capture: ``liger-dspine capture`` writes the target's taps in safetensors shards with an index, and
``train-drafter --taps`` trains from them with the losses and weights of on-the-fly capture, resuming across shards.

``--tiny`` everywhere (the demo's tiny DeepSeek-V3 target, fp32 on the CPU, ``--no-liger``), on the embedded text.
"""

import argparse
import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file

from liger_dspine.cli import main
from liger_dspine.drafter_training import setup
from liger_dspine.drafter_training.loop import train_drafter
from liger_dspine.drafter_training.offline_taps import TapStore
from liger_dspine.drafter_training.offline_taps import packed_rows
from liger_dspine.drafter_training.options import add_arguments
from liger_dspine.drafter_training.options import resolve
from liger_dspine.models.dspine.capture import TargetCapture
from tiny_acceptance import one_thread

ROWS_PER_SHARD = 4


@pytest.fixture(autouse=True)
def single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def taps(tmp_path_factory):
    folder = tmp_path_factory.mktemp("capture") / "taps"
    argv = ["capture", "--tiny", "--no-liger", "--output-dir", str(folder), "--rows-per-shard", str(ROWS_PER_SHARD)]
    with one_thread():
        assert main([*argv, "--batch-size", "3"]) == 0
    return folder


def parse(*argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return resolve(parser.parse_args(["--tiny", "--no-liger", *argv]))


def test_capture_writes_shards_an_index_and_its_size_per_token(taps, capsys):
    index = json.loads((taps / "index.json").read_text())
    target = setup.build_target(parse(), torch.device("cpu"), torch.float32)
    rows = packed_rows(None, None, 32, 256, 0)
    assert index["rows"] == len(rows) and index["seq_len"] == 32 and index["target_layer_ids"] == [0, 1]
    assert index["dtype"] == "float32" and index["mask_token_id"] == 0
    assert len(index["shards"]) == -(-len(rows) // ROWS_PER_SHARD)
    files = sorted(name for name in os.listdir(taps) if name.endswith(".safetensors"))
    assert files == [shard["file"] for shard in index["shards"]]
    on_disk = sum(os.path.getsize(taps / name) for name in files)
    assert index["bytes"] == on_disk and index["bytes_per_token"] == pytest.approx(on_disk / (len(rows) * 32))
    # per token: 2 taps and the head input of hidden 64 in fp32, input and position ids (int64), the loss mask (fp32)
    payload = (2 * 64 + 64) * 4 + 8 + 8 + 4
    assert payload <= index["bytes_per_token"] < payload * 1.05  # the rest: each shard's header

    capture = TargetCapture(target, [0, 1])
    store = TapStore(str(taps))
    for row in (0, ROWS_PER_SHARD - 1, ROWS_PER_SHARD, len(rows) - 1):  # shard edges
        expected = capture(rows[row].input_ids, loss_mask=rows[row].loss_mask, position_ids=rows[row].position_ids)
        stored = store.rows([row])
        assert set(stored) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(stored[name], tensor), (row, name)
    shard = load_file(taps / files[1])
    assert shard["hidden_states"].shape == (ROWS_PER_SHARD, 32, 2 * 64)


def test_training_from_taps_gives_the_losses_and_weights_of_on_the_fly_capture(taps, tmp_path):
    common = ["--steps", "4", "--batch-size", "2", "--accumulation-steps", "2"]  # 8 rows a step: across shards
    live = train_drafter(parse(*common, "--output-dir", str(tmp_path / "live")))
    stored = train_drafter(parse(*common, "--taps", str(taps), "--output-dir", str(tmp_path / "stored")))
    assert [m["loss"] for m in stored] == [m["loss"] for m in live]
    weights = [load_file(tmp_path / run / "checkpoint-4" / "model.safetensors") for run in ("live", "stored")]
    for key, tensor in weights[0].items():
        assert torch.equal(weights[1][key], tensor), key


def test_a_run_from_taps_resumes_across_shards(taps, tmp_path):
    common = ["--steps", "6", "--save-every", "2", "--batch-size", "3", "--taps", str(taps)]
    straight = train_drafter(parse(*common, "--output-dir", str(tmp_path / "straight")))
    train_drafter(parse(*common, "--output-dir", str(tmp_path / "resumed")), stop_after=3)  # step 3 is lost
    after = train_drafter(parse(*common, "--output-dir", str(tmp_path / "resumed"), "--resume"))
    assert [m["step"] for m in after] == [3, 4, 5, 6]
    assert [m["loss"] for m in after] == [m["loss"] for m in straight[2:]]


def test_taps_that_do_not_fit_the_run_are_named(taps, tmp_path):
    with pytest.raises(ValueError, match=r"^liger-dspine: the taps in .* do not fit this run \(target_layer_ids: "):
        train_drafter(
            parse("--steps", "1", "--taps", str(taps), "--target-layer-ids", "1", "--output-dir", str(tmp_path))
        )
    with pytest.raises(ValueError, match=r"seq_len: captured 32, this run 16"):
        train_drafter(parse("--steps", "1", "--taps", str(taps), "--seq-len", "16", "--output-dir", str(tmp_path)))
    broken = tmp_path / "broken"
    broken.mkdir()
    index = json.loads((taps / "index.json").read_text())
    (broken / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"^liger-dspine: .*index.json names shards that .* lacks: taps-00000"):
        TapStore(str(broken))


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["train-drafter", "--tiny", "--taps", "{taps}", "--dataset", "{taps}/index.json", "--mask-token-id", "0"],
            "--taps holds the rows",
        ),
        (["train-drafter", "--tiny", "--taps", "{tmp}"], "has no index.json: write it with liger-dspine capture"),
        (["capture", "--tiny", "--output-dir", "{taps}"], "--output-dir .* exists and is not empty"),
        (["capture", "--tiny", "--dataset", "{taps}/index.json", "--output-dir", "{tmp}/o"], "needs --mask-token-id"),
        (["capture", "--target-config", "tiny", "--output-dir", "{tmp}/o"], "capture needs --target-layer-ids"),
        (["capture", "--tiny", "--target-layer-ids", "0,x", "--output-dir", "{tmp}/o"], "comma-separated integers"),
    ],
)
def test_bad_capture_arguments_are_one_line_errors(taps, tmp_path, capsys, argv, message):
    argv = [arg.format(taps=taps, tmp=tmp_path) for arg in argv]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("liger-dspine:") and re.search(message, error), error
