"""The teacher state of a target whose logits are not lm_head(final-normed state): scaled exactly, or refused.

fp32 tiny targets with random weights on the CPU. The teacher logits the objective computes, lm_head(captured
``target_last_hidden_states``), are held to the target's own forward logits.
"""

import json

import pytest
import torch
import torch.nn.functional as F
import transformers

from liger_dspine.cli import main
from liger_dspine.models.dspine.capture import TargetCapture
from tiny_dspine import tiny_target

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)


def minicpm3(patched: bool = False):
    from tiny_family import CASES

    case = CASES["minicpm3"]
    config = case.config()
    torch.manual_seed(0)
    target = getattr(case.modeling_or_skip(), case.causal_lm_name)(config).eval()
    if patched:
        from liger_dspine import apply_liger_kernel_to_minicpm3

        apply_liger_kernel_to_minicpm3(model=target)
    return target


def family_target(name: str, **config):
    torch.manual_seed(0)
    config_class = getattr(transformers, f"{name}Config")
    return getattr(transformers, f"{name}ForCausalLM")(config_class(**SMALL, **config)).eval()


TARGETS = {
    "qwen3": (lambda: tiny_target(), None),
    # hidden states / (hidden_size / dim_model_base) before the head: 32 / 8 = 4
    "minicpm3": (lambda: minicpm3(), ("logits_scaling", 4.0, True)),
    "minicpm3_patched": (lambda: minicpm3(patched=True), ("logits_scaling", 4.0, True)),
    # logits * logit_scale
    "cohere": (lambda: family_target("Cohere", logit_scale=0.0625), ("logit_scale", 0.0625, False)),
    # logits / logits_scaling
    "granite": (lambda: family_target("Granite", logits_scaling=8.0), ("logits_scaling", 8.0, True)),
}


@pytest.mark.parametrize("name", TARGETS)
def test_teacher_logits_are_the_targets_own_logits(name):
    """fp32: lm_head(state / 4) against the target's lm_head(state / 4) is bit-equal; a scale after the head
    (Cohere, Granite) is applied to the state instead, so the two differ by the rounding of the scaled products."""
    build, rule = TARGETS[name]
    target = build()
    input_ids = torch.randint(0, 90, (2, 9), generator=torch.Generator().manual_seed(1))
    capture = TargetCapture(target, [0, 1])
    teacher = F.linear(capture(input_ids)["target_last_hidden_states"], target.get_output_embeddings().weight)
    with torch.no_grad():
        logits = target(input_ids).logits
    torch.testing.assert_close(teacher, logits, atol=1e-6, rtol=1e-5)
    head_input = capture.head_input
    assert (head_input.field, head_input.value, head_input.divide) == (rule or (None, 1.0, False))


def test_a_soft_capped_head_is_refused_by_its_config_field():
    target = family_target("Gemma2", final_logit_softcapping=30.0)
    with pytest.raises(ValueError) as error:
        TargetCapture(target, [0, 1])
    assert str(error.value).startswith(
        "liger-dspine: DSpine cannot train against this gemma2 target: its logits are soft-capped "
        "(final_logit_softcapping=30)"
    )


def test_logits_that_no_config_field_explains_are_refused():
    target = tiny_target()
    target.lm_head.register_forward_hook(lambda module, args, output: output * 3.0)
    with pytest.raises(ValueError) as error:
        TargetCapture(target, [0, 1])
    message = str(error.value)
    assert message.startswith(
        "liger-dspine: DSpine cannot train against this qwen3 target: its logits are not lm_head(final normed state)"
    )
    assert "none of logits_scaling, logit_scale" in message and "about 3 times it" in message, message


def test_the_probe_runs_the_head_once_and_capturing_never():
    target = tiny_target()
    calls = []
    target.lm_head.register_forward_hook(lambda *args: calls.append(1))
    capture = TargetCapture(target, [1])
    assert calls == [1]
    capture(torch.randint(0, 90, (1, 5)))
    assert calls == [1]
    assert not any(module._forward_hooks for module in target.model.modules())  # the probe's hook removed


def test_train_drafter_refuses_a_soft_capped_target_config(tmp_path, capsys):
    config = transformers.Gemma2Config(**{**SMALL, "vocab_size": 256}, final_logit_softcapping=30.0)
    path = tmp_path / "gemma2.json"
    path.write_text(json.dumps(config.to_dict()))
    argv = ["train-drafter", "--tiny", "--no-liger", "--target-config", str(path), "--output-dir", str(tmp_path)]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith("liger-dspine: DSpine cannot train against this gemma2 target") and error.count("\n") == 1
    assert "final_logit_softcapping=30" in error, error


def test_a_target_without_a_head_is_refused():
    target = tiny_target()
    target.get_output_embeddings = lambda: None
    with pytest.raises(ValueError, match=r"^liger-dspine: DSpine needs a target with an lm_head; this qwen3 has none$"):
        TargetCapture(target, [0, 1])
