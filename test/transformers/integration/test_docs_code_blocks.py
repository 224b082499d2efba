"""Every code block of the README and of docs/ runs on a CPU at a tiny size: each page's ``python`` blocks in order
in one namespace, and each ``liger-dspine`` command of its ``bash`` blocks through the command line.

A block that needs a GPU or a real checkpoint has an HTML comment on the line above its fence: a JSON object of
substitutions (``"/path/to/checkpoint"`` -> ``tiny_checkpoint``, a name this test defines; in commands, ``$NAME``
stands for the same paths), or ``docs-test: skip: <the test that covers it>``. Relative paths land in a temporary
folder."""

import json
import os
import re
import shlex
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"(?:<!-- docs-test: (?P<directive>.*?) -->\n)?```(?P<lang>[a-z]*)\n(?P<code>.*?)```", re.S)


def blocks(page: Path) -> list[dict]:
    found = []
    for match in FENCE.finditer(page.read_text()):
        directive = match["directive"]
        skip = directive[len("skip:") :].strip() if directive and directive.startswith("skip:") else None
        substitutions = json.loads(directive) if directive and skip is None else {}
        found.append({"lang": match["lang"], "code": match["code"], "skip": skip, "substitutions": substitutions})
    return found


def substituted(block: dict) -> str:
    code = block["code"]
    for old, new in block["substitutions"].items():
        assert old in code, f"the substitution {old!r} matches nothing in {code[:200]!r}"
        code = code.replace(old, new)
    return code


def commands(code: str) -> list[str]:
    """The ``liger-dspine`` command lines of a shell block, continuation lines joined."""
    lines = code.replace("\\\n", " ").splitlines()
    return [line.split(" #")[0] for line in lines if line.startswith("liger-dspine ")]


def test_every_block_is_python_or_bash_and_every_skip_says_why():
    for page in PAGES:
        for block in blocks(page):
            assert block["lang"] in ("python", "bash"), (page.name, block["code"][:80])
            assert block["skip"] != "", (page.name, block["code"][:80])
            for named in re.findall(r"test_\w+\.py", block["skip"] or ""):  # the covering tests exist
                assert list((ROOT / "test").rglob(named)), (page.name, named)


def test_readme_links_point_at_files_that_exist():
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(((?!https?://)[^)#]+)", text)
    assert "docs/install.md" in targets and "benchmark/data/quick_tokens_per_s.png" in targets
    missing = [target for target in targets if not (ROOT / target).exists()]
    assert missing == []


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    """A saved tiny DeepSeek-V3 (the demo's config, random weights), a DSpine drafter for it and a token-id dataset."""
    from transformers import DeepseekV3ForCausalLM

    from liger_dspine.demo import demo_config
    from liger_dspine.demo_dspine import dspine_demo_config
    from liger_dspine.models.dspine import DSpineDraftModel

    folder = tmp_path_factory.mktemp("docs")
    torch.manual_seed(0)
    config = demo_config()
    target = DeepseekV3ForCausalLM(config)
    target.save_pretrained(folder / "deepseek_v3")
    draft = DSpineDraftModel(dspine_demo_config(config))
    draft.initialize_transfer_space(target.lm_head.weight.detach())  # as training does before its first step
    draft.save_pretrained(folder / "drafter")
    rows = torch.randint(1, config.vocab_size, (8, 40), generator=torch.Generator().manual_seed(0))
    (folder / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows.tolist()))
    return {
        "tiny_checkpoint": str(folder / "deepseek_v3"),
        "tiny_drafter": str(folder / "drafter"),
        "tiny_dataset": str(folder / "data.jsonl"),
    }


@pytest.fixture
def restored_state(tmp_path, monkeypatch):
    """A page runs in a temporary folder, and leaves no class-level patch nor liger-kernel registration behind."""
    from liger_kernel.transformers import monkey_patch

    from liger_dspine.registry import MODEL_TYPE_TO_APPLY_LIGER_FN

    monkeypatch.chdir(tmp_path)
    table = dict(monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN)
    yield
    monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN.clear()
    monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN.update(table)
    import liger_dspine

    for model_type in MODEL_TYPE_TO_APPLY_LIGER_FN:
        revert = getattr(liger_dspine, f"revert_liger_kernel_to_{model_type}", None)
        if revert is not None:
            revert()


RUNNABLE = [page for page in PAGES if any(not b["skip"] for b in blocks(page))]


@pytest.mark.slow  # minutes on the CPU interpreter: make test-slow
@pytest.mark.parametrize("page", RUNNABLE, ids=[page.name for page in RUNNABLE])
def test_page_code_runs(page, tiny_files, restored_state, capsys):
    from liger_dspine.cli import main

    namespace = {"__name__": "__docs__", **tiny_files}
    ran = 0
    for block in blocks(page):
        if block["skip"] is not None:
            continue
        code = substituted(block)
        if block["lang"] == "python":
            exec(compile(code, f"{page.name} block", "exec"), namespace)
            ran += 1
            continue
        for command in commands(code):
            for name, path in tiny_files.items():
                command = command.replace(f"${name.upper()}", path)
            assert main(shlex.split(command)[1:]) == 0, command
            ran += 1
    assert ran == sum(1 if b["lang"] == "python" else len(commands(b["code"])) for b in blocks(page) if not b["skip"])
    EXPECTED.get(page.name, lambda namespace, out: None)(namespace, capsys.readouterr().out)


def _readme(namespace, out):
    # the CPU quick start: a random byte-level model's loss is near ln(256) = 5.55
    assert 4.5 < namespace["loss"].item() < 6.5
    assert f"loss {namespace['loss'].item():.4f}" in out.splitlines()
    assert "LigerRMSNorm" in str(namespace["report"]) and "lce_forward" in str(namespace["report"])
    assert os.path.isdir("drafter/checkpoint-1")  # the train-drafter command's last step, at a tiny size
    out_ = namespace["out"]  # spec_generate: 32 new tokens after the prompt of 16, each verification accepting >= 1
    assert out_.sequences.shape == (1, 48) and out_.mean_acceptance_length >= 1.0
    assert out_.tokens_per_target_forward > 0
    prompt = namespace["prompt"]
    reference = namespace["target"].generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32, do_sample=False, pad_token_id=0
    )
    assert torch.equal(out_.sequences, reference)


def _dspine(namespace, out):
    assert os.path.isfile("drafter-out/config.json") and os.path.isfile("out/checkpoint-1/model.safetensors")
    assert namespace["draft"].config.mask_token_id == 0


EXPECTED = {"README.md": _readme, "dspine.md": _dspine}
