"""Acceptance lengths: the offline (teacher-forced) count, its agreement with spec_generate's steps, the
``eval-drafter`` command and report, and ``train-drafter --eval-dataset``.

All fp32 on the CPU with native modules (``--no-liger``): drafting with the Liger modules has its own test.
"""

import argparse
import json
import re
import sys

import pytest
import torch

from liger_dspine.cli import main
from liger_dspine.drafter_training import eval_report
from liger_dspine.drafter_training import setup
from liger_dspine.drafter_training.evaluation import AcceptanceStats
from liger_dspine.drafter_training.evaluation import build_eval_set
from liger_dspine.drafter_training.evaluation import end_to_end_acceptance
from liger_dspine.drafter_training.evaluation import offline_acceptance
from liger_dspine.drafter_training.evaluation import prompt_of
from liger_dspine.drafter_training.loop import train_drafter
from liger_dspine.drafter_training.options import add_arguments
from liger_dspine.drafter_training.options import resolve
from liger_dspine.models.dspine import DSpineDraftModel
from liger_dspine.models.dspine.drafting import draft_blocks
from tiny_acceptance import one_thread
from tiny_acceptance import random_prompts
from tiny_acceptance import trained_drafter


@pytest.fixture(autouse=True)
def single_thread():
    with one_thread():
        yield


def test_acceptance_statistics():
    stats = AcceptanceStats(torch.tensor([0, 3, 1, 2, 3]), block_size=4)
    assert stats.blocks == 5
    assert stats.mean_acceptance_length == pytest.approx(1 + 9 / 5)
    assert stats.position_rates() == pytest.approx([4 / 5, 3 / 5, 2 / 5])
    assert stats.conditional_rates() == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    assert stats.mean_acceptance_length == pytest.approx(1 + sum(stats.position_rates()))
    empty = AcceptanceStats(torch.zeros(0, dtype=torch.long), block_size=3)
    assert empty.mean_acceptance_length == 0.0 and empty.position_rates() == [0.0, 0.0]


def test_prompt_of_a_document():
    ids = torch.arange(10, 16)
    assert prompt_of(ids, torch.tensor([0, 0, 0, 1, 1, 1.0]), 100).tolist() == [10, 11, 12]
    assert prompt_of(ids, torch.ones(6), 100).tolist() == ids.tolist()  # starts supervised: all of it
    assert prompt_of(ids, torch.zeros(6), 100).tolist() == ids.tolist()  # a prompt-only line
    assert prompt_of(ids, torch.tensor([0, 0, 0, 0, 1, 1.0]), 2).tolist() == [10, 11]


def test_offline_acceptance_counts_each_anchors_matching_prefix_of_the_continuation():
    target, draft, _, _, sequences = trained_drafter()
    results = offline_acceptance(draft, target, sequences, blocks_per_forward=7)  # several forwards per sequence
    embed, head = target.model.embed_tokens, target.lm_head.weight
    expected = {"refined": [], "plain": []}
    for sequence in sequences:
        ids = sequence.input_ids
        for anchor in range(sequence.prompt_length, sequence.prompt_length + sequence.anchors):
            alone = draft_blocks(
                draft, embed, head, sequence.taps[:, :anchor], torch.tensor([[anchor]]), ids[anchor].view(1, 1)
            )
            for name, proposals in (("refined", alone.refined), ("plain", alone.plain)):
                count = 0
                while count < draft.block_size - 1 and proposals[0, 0, count] == ids[anchor + 1 + count]:
                    count += 1
                expected[name].append(count)
    for name in ("refined", "plain"):
        assert results[name].accepted.tolist() == expected[name]
        assert results[name].blocks == len(sequences) * sequences[0].anchors
    assert results["refined"].mean_acceptance_length > 1.3  # the drafter is trained: some blocks are accepted


def test_spec_generate_steps_accept_what_the_offline_blocks_at_their_anchors_accept():
    target, draft, _, _, sequences = trained_drafter()
    for name in ("refined", "plain"):
        for sequence in sequences:
            offline = offline_acceptance(draft, target, [sequence])[name].accepted.tolist()
            prompt = sequence.input_ids[: sequence.prompt_length]
            steps = end_to_end_acceptance(draft, target, [prompt], sequence.anchors)[name].accepted.tolist()
            visited, anchor = [], 0
            while anchor < sequence.anchors - 1:
                visited.append(offline[anchor])
                anchor += offline[anchor] + 1
            assert steps == visited, (name, steps, visited)


@pytest.fixture(scope="module")
def drafter_folder(tmp_path_factory):
    """The trained drafter and its target saved, and a held-out JSONL."""
    target, draft = trained_drafter()[:2]
    folder = tmp_path_factory.mktemp("eval")
    draft.save_pretrained(folder / "drafter")
    target.save_pretrained(folder / "target")
    prompts = random_prompts(4, 5, seed=21).tolist()
    lines = [json.dumps(ids) for ids in prompts[:3]] + [
        json.dumps({"input_ids": prompts[3], "loss_mask": [0] * 3 + [1] * 2})
    ]
    (folder / "held_out.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def eval_argv(folder, *extra, target=("--target",)):
    return [
        "eval-drafter",
        str(folder / "drafter"),
        *(target if len(target) == 2 else (*target, str(folder / "target"))),
        "--dataset",
        str(folder / "held_out.jsonl"),
        "--no-liger",
        "--new-tokens",
        "12",
        *extra,
    ]


def test_eval_drafter_reports_what_the_library_computes(drafter_folder, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as without matplotlib
    assert main(eval_argv(drafter_folder, "--output-dir", str(drafter_folder / "report"), "--stop-token-ids", "7")) == 0
    printed = capsys.readouterr().out
    assert "mean acceptance length" in printed and eval_report.NO_MATPLOTLIB in printed
    written = json.loads((drafter_folder / "report" / "acceptance.json").read_text())

    target, draft = trained_drafter()[:2]
    documents = [(torch.tensor(ids), torch.ones(5)) for ids in random_prompts(3, 5, seed=21).tolist()]
    documents.append((random_prompts(4, 5, seed=21)[3], torch.tensor([0, 0, 0, 1, 1.0])))
    sequences = build_eval_set(target, documents, draft.target_layer_ids, draft.block_size, 512, 12)
    prompts = [prompt_of(ids, mask, 512) for ids, mask in documents]
    expected = eval_report.columns(
        offline_acceptance(draft, target, sequences), end_to_end_acceptance(draft, target, prompts, 12, [7])
    )
    assert set(written) == {"offline refined", "offline plain", "end-to-end refined", "end-to-end plain"}
    for name, stats in expected.items():
        assert written[name]["mean_acceptance_length"] == pytest.approx(stats.mean_acceptance_length)
        assert written[name]["position_rates"] == pytest.approx(stats.position_rates())
        assert written[name]["blocks"] == stats.blocks
    assert written["offline refined"]["blocks"] == 4 * 12
    csv_lines = (drafter_folder / "report" / "acceptance.csv").read_text().splitlines()
    assert csv_lines[0].startswith("position,offline refined") and len(csv_lines) == draft.block_size


def test_the_plot_is_written_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    stats = AcceptanceStats(torch.tensor([0, 3, 1]), block_size=4)
    assert eval_report.plot({"offline refined": stats}, str(tmp_path / "a.png"), "t") == str(tmp_path / "a.png")
    assert (tmp_path / "a.png").stat().st_size > 0


@pytest.fixture
def no_model_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(setup, "build_target", refuse)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda argv, folder: argv.__setitem__(1, str(folder / "missing")), "is not a folder"),
        (lambda argv, folder: argv.extend(["--target-config", "tiny"]), "give --target or --target-config, not both"),
        (lambda argv, folder: argv.extend(["--stop-token-ids", "5,96"]), r"--stop-token-ids \[96\] lie outside the"),
        (lambda argv, folder: argv.extend(["--stop-token-ids", "5,x"]), "--stop-token-ids must be comma-separated"),
        (lambda argv, folder: argv.extend(["--new-tokens", "0"]), "--new-tokens must be >= 1, got 0"),
    ],
)
def test_eval_drafter_refuses_bad_arguments_before_loading(drafter_folder, capsys, no_model_loads, change, message):
    argv = eval_argv(drafter_folder)
    change(argv, drafter_folder)
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith("liger-dspine:") and len(error.strip().splitlines()) == 1
    assert re.search(message, error), error


def test_eval_drafter_names_a_drafter_that_does_not_fit(drafter_folder, tmp_path, capsys):
    # the demo's tiny DeepSeek-V3 target: vocabulary 256, hidden 64
    assert main(eval_argv(drafter_folder, target=("--target-config", "tiny"))) == 2
    error = capsys.readouterr().err
    assert error.startswith("liger-dspine: the target's lm_head is [256, 64], but the drafter was built for a target")
    fresh = DSpineDraftModel(trained_drafter()[1].config)  # never given its transfer space
    fresh.save_pretrained(tmp_path / "fresh")
    capsys.readouterr()
    argv = eval_argv(drafter_folder)
    argv[1] = str(tmp_path / "fresh")
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"liger-dspine: the drafter of {tmp_path / 'fresh'} has no transfer space"), error


def parse_train(*argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return resolve(parser.parse_args(["--tiny", "--no-liger", *argv]))


def test_train_drafter_logs_the_offline_acceptance_length(tmp_path):
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("[72, 101, 108, 108, 111]\n[84, 104, 101, 32]\n")
    args = parse_train(
        "--steps", "4", "--eval-dataset", str(held_out), "--eval-every", "2", "--eval-new-tokens", "6",
        "--output-dir", str(tmp_path / "out"),
    )  # fmt: skip
    history = train_drafter(args)
    logged = {m["step"]: m["eval_acceptance_length"] for m in history if "eval_acceptance_length" in m}
    assert sorted(logged) == [2, 4]
    target = setup.build_target(args, torch.device("cpu"), torch.float32)
    draft = DSpineDraftModel.from_pretrained(tmp_path / "out" / "checkpoint-4")
    documents = [
        (torch.tensor([72, 101, 108, 108, 111]), torch.ones(5)),
        (torch.tensor([84, 104, 101, 32]), torch.ones(4)),
    ]
    sequences = build_eval_set(target, documents, draft.target_layer_ids, draft.block_size, 256, 6)
    assert logged[4] == pytest.approx(offline_acceptance(draft, target, sequences)["refined"].mean_acceptance_length)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--eval-every", "3"], "--eval-every needs --eval-dataset"),
        (["--eval-dataset", "/no/such/file.jsonl"], "--eval-dataset '/no/such/file.jsonl' is not a file"),
        (["--eval-dataset", __file__, "--eval-every", "-1"], "--eval-every must be >= 0, got -1"),
    ],
)
def test_train_drafter_refuses_bad_evaluation_arguments(argv, message):
    with pytest.raises(ValueError, match=f"^liger-dspine: {message}"):
        parse_train(*argv)


def test_generate_prints_the_greedy_continuation_and_its_statistics(drafter_folder, capsys):
    target = trained_drafter()[0]
    prompt = random_prompts(1, 6, seed=31)
    argv = ["generate", str(drafter_folder / "drafter"), "--target", str(drafter_folder / "target"), "--no-liger"]
    ids = ",".join(map(str, prompt[0].tolist()))
    assert main([*argv, "--prompt-ids", ids, "--max-new-tokens", "15"]) == 0
    captured = capsys.readouterr()
    expected = target.generate(prompt, max_new_tokens=15, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert captured.out.strip() == ",".join(map(str, expected[0, 6:].tolist()))
    assert re.search(r"15 tokens, \d+ verification steps, mean acceptance length [\d.]+", captured.err)
    stop = int(expected[0, 10])
    assert main([*argv, "--prompt-ids", ids, "--max-new-tokens", "15", "--stop-token-ids", str(stop)]) == 0
    printed = capsys.readouterr().out.strip().split(",")
    assert printed == [str(t) for t in expected[0, 6:].tolist()][: printed.index(str(stop)) + 1]
    assert printed[-1] == str(stop)


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], r"give the prompt as --prompt TEXT or --prompt-ids IDS \(one\)"),
        (["--prompt-ids", "1,2", "--prompt", "hi"], r"give the prompt as --prompt TEXT or --prompt-ids IDS \(one\)"),
        (["--prompt-ids", "1,x"], "--prompt-ids must be comma-separated integers"),
        (["--prompt-ids", "1,2", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
        (["--prompt-ids", "1,2", "--temperature", "-1"], "--temperature must be a finite number >= 0, got -1.0"),
    ],
)
def test_generate_refuses_bad_arguments_before_loading(drafter_folder, capsys, no_model_loads, extra, message):
    argv = ["generate", str(drafter_folder / "drafter"), "--target", str(drafter_folder / "target"), *extra]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert re.match(f"liger-dspine: {message}", error) and len(error.strip().splitlines()) == 1, error
