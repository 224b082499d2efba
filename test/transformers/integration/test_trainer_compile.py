"""``transformers.Trainer(torch_compile=True, use_liger_kernel=True)`` trains a DeepSeek-V3 as it does uncompiled.

CPU, fp32, 3 optimizer steps of a tiny model; backend ``aot_eager`` (the captured graph run as it is: inductor's CPU
code generation is covered in test_compile.py). Logged losses and final weights to 1e-5 against the uncompiled
run from the same weights and seed.
"""

import copy

import pytest
import torch
from liger_kernel.transformers import monkey_patch as liger_monkey_patch
from torch._dynamo.utils import counters

from liger_dspine import register_with_liger
from liger_dspine.modules.rms_norm import LigerRMSNorm
from tiny_models import build_model
from tiny_models import class_patches_reverted
from tiny_models import labels_with_ignored
from tiny_models import module_types
from tiny_models import tiny_deepseek_v3_config

pytestmark = pytest.mark.slow  # a compiled Trainer run against an uncompiled one: make test-slow

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")

STEPS = 3
FP32 = dict(atol=1e-5, rtol=1e-5)
LIGER_TABLE = liger_monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN


@pytest.fixture
def registered():
    saved = dict(LIGER_TABLE)
    with class_patches_reverted():
        register_with_liger()
        yield
    LIGER_TABLE.clear()
    LIGER_TABLE.update(saved)


def test_trainer_with_torch_compile_trains_like_uncompiled(registered, tmp_path):
    from transformers import Trainer
    from transformers import TrainingArguments

    config = tiny_deepseek_v3_config(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    native_model = build_model(config)
    ids = torch.randint(3, config.vocab_size, (6, 8), generator=torch.Generator().manual_seed(0))
    labels = labels_with_ignored(ids)
    dataset = [{"input_ids": ids[i], "labels": labels[i]} for i in range(len(ids))]

    def train(torch_compile: bool):
        torch._dynamo.reset()
        model = copy.deepcopy(native_model)
        args = TrainingArguments(
            output_dir=str(tmp_path / str(torch_compile)),
            use_liger_kernel=True,
            torch_compile=torch_compile,
            torch_compile_backend="aot_eager" if torch_compile else None,
            max_steps=STEPS,
            per_device_train_batch_size=2,
            learning_rate=1e-3,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            seed=0,
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=args, train_dataset=dataset)
        trainer.train()
        return model, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    counters.clear()
    compiled, compiled_losses = train(True)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]  # it did compile, whole
    eager, eager_losses = train(False)

    assert LigerRMSNorm in module_types(compiled).values()
    assert len(compiled_losses) == STEPS
    torch.testing.assert_close(torch.tensor(compiled_losses), torch.tensor(eager_losses), **FP32)
    expected = dict(eager.named_parameters())
    for name, p in compiled.named_parameters():
        torch.testing.assert_close(p, expected[name], **FP32, msg=lambda m: f"{name}: {m}")
