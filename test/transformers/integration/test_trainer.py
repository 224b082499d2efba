"""``transformers.Trainer(use_liger_kernel=True)`` and TRL's ``SFTTrainer`` patch a DeepSeek-V3 through
liger-kernel's table once ``register_with_liger()`` ran, and train it as the native model trains.

CPU, fp32, 3 optimizer steps of a tiny model on random ids; the native run (``use_liger_kernel=False``) from the
same weights and seed is the reference: logged losses and final weights to 1e-5 (fp32 rounding through 3 AdamW
steps). liger-kernel's table is restored and no class-level patch is left behind.
"""

import copy
import warnings

import pytest
import torch
from liger_kernel.transformers import monkey_patch as liger_monkey_patch

from liger_dspine import register_with_liger
from liger_dspine.modules.causal_lm_forward import lce_forward
from liger_dspine.modules.rms_norm import LigerRMSNorm
from liger_dspine.modules.swiglu import LigerSwiGLUMLP
from tiny_models import build_model
from tiny_models import class_patches_reverted
from tiny_models import labels_with_ignored
from tiny_models import module_types
from tiny_models import tiny_deepseek_v3_config

pytestmark = pytest.mark.slow  # Trainer and SFTTrainer, native and patched, through the interpreter: make test-slow

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")

STEPS = 3
FP32 = dict(atol=1e-5, rtol=1e-5)
LIGER_TABLE = liger_monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN
TRAINING = dict(
    max_steps=STEPS,
    per_device_train_batch_size=2,
    learning_rate=1e-3,
    logging_steps=1,
    save_strategy="no",
    report_to=[],
    use_cpu=True,
    bf16=False,  # TRL's SFTConfig defaults to bf16, which the CPU interpreter computes wrongly
    seed=0,
    disable_tqdm=True,
)


@pytest.fixture
def registered():
    """Our patch in liger-kernel's table for the test; the table (same objects) and transformers' classes are
    restored afterwards."""
    saved = dict(LIGER_TABLE)
    with class_patches_reverted():
        register_with_liger()
        yield
    LIGER_TABLE.clear()
    LIGER_TABLE.update(saved)


@pytest.fixture(scope="module")
def config():
    return tiny_deepseek_v3_config(pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def native_model(config):
    return build_model(config)


def random_ids(config, rows: int = 6, seq: int = 8) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(3, config.vocab_size, (rows, seq), generator=generator)  # no special token


def losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def assert_weights_close(model, reference) -> None:
    expected = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, expected[name], **FP32, msg=lambda m: f"{name}: {m}")


def assert_patched_by_liger_dspine(model) -> None:
    types = list(module_types(model).values())
    assert types.count(LigerRMSNorm) == 9 and types.count(LigerSwiGLUMLP) == 2
    assert not [t for t in types if t.__module__.startswith("liger_kernel")]


def test_trainer_with_use_liger_kernel_trains_like_native(registered, config, native_model, tmp_path):
    from transformers import Trainer
    from transformers import TrainingArguments

    ids = random_ids(config)
    labels = labels_with_ignored(ids)
    dataset = [{"input_ids": ids[i], "labels": labels[i]} for i in range(len(ids))]

    def train(use_liger_kernel: bool):
        model = copy.deepcopy(native_model)
        args = TrainingArguments(
            output_dir=str(tmp_path / str(use_liger_kernel)), use_liger_kernel=use_liger_kernel, **TRAINING
        )
        trainer = Trainer(model=model, args=args, train_dataset=dataset)
        trainer.train()
        return model, losses(trainer)

    model, liger_losses = train(True)
    native, native_losses = train(False)

    assert_patched_by_liger_dspine(model)
    assert model.forward.__func__ is lce_forward
    assert module_types(native) == module_types(native_model) and "forward" not in vars(native)
    assert len(liger_losses) == STEPS
    torch.testing.assert_close(torch.tensor(liger_losses), torch.tensor(native_losses), **FP32)
    assert_weights_close(model, native)


def test_trl_sft_trainer_with_use_liger_kernel_trains_like_native(registered, config, native_model, tmp_path):
    """TRL 1.x asks for ``fused_linear_cross_entropy=False`` and installs its own fused LM head: the layer kernels
    are ours, the forward is TRL's."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from tokenizers import Tokenizer
    from tokenizers import models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t3")),
        pad_token="t0",
        bos_token="t1",
        eos_token="t2",
        unk_token="t3",
    )
    dataset = datasets.Dataset.from_dict({"input_ids": random_ids(config).tolist()})

    def train(use_liger_kernel: bool):
        model = copy.deepcopy(native_model)
        args = trl.SFTConfig(
            output_dir=str(tmp_path / str(use_liger_kernel)), use_liger_kernel=use_liger_kernel, **TRAINING
        )
        with warnings.catch_warnings():
            warnings.simplefilter(
                "ignore", FutureWarning
            )  # TRL: use_liger_kernel is deprecated in favour of Hub kernels
            trainer = trl.SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
        trainer.train()
        return model, losses(trainer)

    model, liger_losses = train(True)
    native, native_losses = train(False)

    assert_patched_by_liger_dspine(model)
    assert getattr(model.forward, "__func__", None) is not lce_forward
    assert len(liger_losses) == STEPS
    torch.testing.assert_close(torch.tensor(liger_losses), torch.tensor(native_losses), **FP32)
    assert_weights_close(model, native)
