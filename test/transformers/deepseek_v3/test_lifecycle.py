"""A patched DeepSeek-V3 through the rest of a model's life: checkpointing, generation, autocast, LoRA, compile,
other model classes, and a native model in the same process.

Tiny model, fp32 on the CPU interpreter unless a test says otherwise; references are the native model (or the
patched model without the feature under test). Tolerance 1e-5 in fp32: rounding of differently ordered kernels.
The round trip save_pretrained (patched) -> from_pretrained (native) is in test_deepseek_v3_patch.py.
"""

import copy

import pytest
import torch
from transformers import DeepseekV3ForCausalLM
from transformers import DeepseekV3ForSequenceClassification
from transformers import DeepseekV3ForTokenClassification
from transformers import DeepseekV3Model

from liger_dspine import apply_liger_kernel_to_deepseek_v3
from liger_dspine.models.deepseek_v3.attention import LigerDeepseekV3Attention
from liger_dspine.models.deepseek_v3.router import LigerDeepseekV3TopkRouter
from liger_dspine.modules.causal_lm_forward import lce_forward
from liger_dspine.modules.rms_norm import LigerRMSNorm
from liger_dspine.modules.swiglu import LigerSwiGLUMLP
from liger_dspine.patching import replacement_of
from tiny_models import assert_grads_close
from tiny_models import build_model
from tiny_models import class_patches_reverted
from tiny_models import labels_with_ignored
from tiny_models import loss_and_grads
from tiny_models import module_types
from tiny_models import random_batch
from tiny_models import tiny_deepseek_v3_config

pytestmark = pytest.mark.matrix  # runs against every transformers version of the matrix

FP32 = dict(atol=1e-5, rtol=1e-5)
LIGER_TYPES = {LigerRMSNorm, LigerSwiGLUMLP, LigerDeepseekV3Attention, LigerDeepseekV3TopkRouter}


@pytest.fixture(scope="module")
def config():
    return tiny_deepseek_v3_config()


@pytest.fixture(scope="module")
def native_model(config):
    return build_model(config)


@pytest.fixture
def native(native_model):
    return copy.deepcopy(native_model)


@pytest.fixture
def patched(native_model):
    model = copy.deepcopy(native_model)
    apply_liger_kernel_to_deepseek_v3(model=model)
    return model


@pytest.fixture(scope="module")
def batch(config):
    input_ids, _ = random_batch(config, batch=2, seq=6, seed=7)
    return input_ids, labels_with_ignored(input_ids)


@pytest.fixture(scope="module")
def native_loss_and_grads(native_model, batch):
    model = copy.deepcopy(native_model).train()
    input_ids, labels = batch
    out, grads = loss_and_grads(model, input_ids, labels=labels)
    return out.loss.detach(), grads


@pytest.mark.slow  # whole-model checkpointed steps: make test-slow
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_gradient_checkpointing_gives_the_same_loss_and_grads(patched, batch, native_loss_and_grads, use_reentrant):
    input_ids, labels = batch
    patched.train()
    patched.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    assert all(layer.gradient_checkpointing for layer in patched.model.layers)

    out, grads = loss_and_grads(patched, input_ids, labels=labels)

    native_loss, native_grads = native_loss_and_grads
    torch.testing.assert_close(out.loss.detach(), native_loss, **FP32)
    assert_grads_close(grads, native_grads, **FP32)
    # the recomputation runs the same kernels: the same loss as the patched model without checkpointing, and its
    # gradients up to the order in which autograd adds the branches' contributions (a few fp32 ulps, e.g. in the
    # embedding gradient, depending on the transformers version and the CPU)
    patched.gradient_checkpointing_disable()
    plain_out, plain_grads = loss_and_grads(patched, input_ids, labels=labels)
    torch.testing.assert_close(out.loss, plain_out.loss, atol=0, rtol=0)
    assert_grads_close(grads, plain_grads, atol=1e-7, rtol=1e-6)


def test_greedy_generation_gives_native_tokens_and_scores(native, patched, batch):
    """Every kernel patched (attention with its KV cache included), eval mode, greedy decoding."""
    input_ids = batch[0][:1]
    options = dict(max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        expected = native.eval().generate(input_ids, **options)
        actual = patched.eval().generate(input_ids, **options)

    assert actual.sequences.shape == (1, input_ids.shape[1] + 3)
    assert torch.equal(actual.sequences, expected.sequences)
    for step, (got, want) in enumerate(zip(actual.logits, expected.logits, strict=True)):
        torch.testing.assert_close(got, want, **FP32, msg=lambda m: f"step {step}: {m}")


def test_cpu_fp16_autocast_matches_native_autocast(native, patched, batch):
    """On a CPU the interpreter computes fp16 right (bf16 wrong: see the cuda test below). fp16 has ~3 decimal
    digits: loss to 1e-3, gradients to 2e-3 absolute (they are of order 0.1)."""
    input_ids, labels = batch
    with torch.autocast("cpu", dtype=torch.float16):
        native_out, native_grads = loss_and_grads(native.train(), input_ids, labels=labels)
        out, grads = loss_and_grads(patched.train(), input_ids, labels=labels)
        with torch.no_grad():
            native_logits = native.eval()(input_ids).logits
            logits = patched.eval()(input_ids).logits

    assert logits.dtype == native_logits.dtype == torch.float16  # autocast was in effect
    torch.testing.assert_close(logits, native_logits, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out.loss, native_out.loss, atol=1e-3, rtol=1e-3)
    assert_grads_close(grads, native_grads, atol=2e-3, rtol=2e-2)


@pytest.mark.cuda
def test_cuda_bf16_autocast_matches_native_autocast(native_model, batch):
    """bf16 (8 bits of mantissa): loss to 2e-2, gradients to 2e-2 absolute."""
    native = copy.deepcopy(native_model).cuda()
    patched = copy.deepcopy(native)
    apply_liger_kernel_to_deepseek_v3(model=patched)
    input_ids, labels = (t.cuda() for t in batch)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        native_out, native_grads = loss_and_grads(native.train(), input_ids, labels=labels)
        out, grads = loss_and_grads(patched.train(), input_ids, labels=labels)

    torch.testing.assert_close(out.loss, native_out.loss, atol=2e-2, rtol=2e-2)
    assert_grads_close(grads, native_grads, atol=2e-2, rtol=5e-2)


# --------------------------------------------------------------------------------------------------- PEFT LoRA
ATTENTION_PROJECTIONS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
MLP_PROJECTIONS = ["gate_proj", "up_proj", "down_proj"]


def with_lora(model):
    peft = pytest.importorskip("peft")
    torch.manual_seed(11)  # init_lora_weights=False: random, non-zero B, so the adapters change the output
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=ATTENTION_PROJECTIONS + MLP_PROJECTIONS, init_lora_weights=False
    )
    return peft.get_peft_model(model, config)


def lora_loss_and_grads(model, input_ids, labels):
    model.train().zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, labels=labels)
    out.loss.backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("order", ["patch_then_lora", "lora_then_patch"])
def test_lora_adapters_train_like_native(native_model, batch, order):
    """peft 0.21 maps the MLP names onto transformers 5's fused routed experts (``gate_up_proj`` and ``down_proj``
    parameters, adapted in place); the attention projections get LoRA ``Linear`` wrappers. Both run through the
    patched modules, and only adapter weights get gradients, as in the native model."""
    input_ids, labels = batch
    native = with_lora(copy.deepcopy(native_model))
    model = copy.deepcopy(native_model)
    if order == "patch_then_lora":
        apply_liger_kernel_to_deepseek_v3(model=model)
        model = with_lora(model)
    else:
        model = with_lora(model)
        apply_liger_kernel_to_deepseek_v3(model=model.get_base_model())

    base = model.get_base_model()
    assert base.forward.__func__ is lce_forward
    assert {LigerDeepseekV3Attention, LigerSwiGLUMLP, LigerRMSNorm} <= set(module_types(base).values())
    attention = base.model.layers[0].self_attn
    assert isinstance(attention, LigerDeepseekV3Attention) and hasattr(attention.q_b_proj, "lora_A")

    native_out, native_grads = lora_loss_and_grads(native, input_ids, labels)
    out, grads = lora_loss_and_grads(model, input_ids, labels)

    assert out.logits is None  # the fused loss path
    adapter_names = {name for name in grads if "lora_" in name}
    assert grads.keys() == native_grads.keys() == adapter_names
    assert any("self_attn.q_b_proj.lora_A" in name for name in adapter_names)
    assert any("mlp.experts" in name for name in adapter_names)
    torch.testing.assert_close(out.loss.detach(), native_out.loss.detach(), **FP32)
    assert_grads_close(grads, native_grads, **FP32)


# ---------------------------------------------------------------------------------------------- torch.compile
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="inductor's GPU code; the CPU runs (aot_eager and inductor) are in test_compile.py",
)
@pytest.mark.cuda
def test_torch_compile_gives_the_eager_loss_and_grads(native_model, batch):
    """One graph, no break (every kernel is a custom op); numbers must not change. fp32 with TF32 off; 1e-4 covers
    the reordered reductions of inductor's generated code."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = copy.deepcopy(native_model).cuda()
    apply_liger_kernel_to_deepseek_v3(model=model)
    input_ids, labels = (t.cuda() for t in batch)
    eager_out, eager_grads = loss_and_grads(model.train(), input_ids, labels=labels)

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model)
    model.zero_grad(set_to_none=True)
    out = compiled(input_ids, labels=labels)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1

    torch.testing.assert_close(out.loss, eager_out.loss, atol=1e-4, rtol=1e-4)
    assert_grads_close(grads, {name: eager_grads[name] for name in grads}, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------- native and patched side by side
def test_patched_and_native_instances_side_by_side(native, patched, batch):
    input_ids, labels = batch
    reference = copy.deepcopy(native)
    native_types = module_types(native)
    native_first, native_first_grads = loss_and_grads(native.train(), input_ids, labels=labels)

    for _ in range(2):  # interleaved calls: neither model changes the other
        out, grads = loss_and_grads(patched.train(), input_ids, labels=labels)
        native_out, native_grads = loss_and_grads(native, input_ids, labels=labels)
        torch.testing.assert_close(out.loss, native_out.loss, **FP32)
        assert_grads_close(grads, native_grads, **FP32)
        # the native model is untouched: bit for bit what it computed before the patched model ran
        assert torch.equal(native_out.loss, native_first.loss)
        assert_grads_close(native_grads, native_first_grads, atol=0, rtol=0)

    assert module_types(native) == native_types == module_types(reference)
    assert "forward" not in vars(native)
    assert not LIGER_TYPES & set(module_types(native).values())


def test_class_patch_keeps_the_modules_of_models_built_before_it(native_model, batch):
    """A class-level patch rebinds module classes (models built later get Liger modules) and the causal LM's
    ``forward`` (a class attribute: every instance, old ones included, uses ``lce_forward`` until the revert)."""
    input_ids, labels = batch
    with class_patches_reverted():
        native = copy.deepcopy(native_model)
        apply_liger_kernel_to_deepseek_v3()
        patched = DeepseekV3ForCausalLM(native.config)
        patched.load_state_dict(native.state_dict())

        assert LIGER_TYPES <= set(module_types(patched).values())
        assert not LIGER_TYPES & set(module_types(native).values())
        assert replacement_of(native.forward.__func__) is lce_forward  # dressed as the native forward
        native_out, native_grads = loss_and_grads(native.train(), input_ids, labels=labels)
        out, grads = loss_and_grads(patched.train(), input_ids, labels=labels)

    torch.testing.assert_close(out.loss, native_out.loss, **FP32)
    assert_grads_close(grads, native_grads, **FP32)
    # reverted: the old model is fully native again
    assert replacement_of(native.forward.__func__) is not lce_forward
    assert native(input_ids, labels=labels).logits is not None


# ------------------------------------------------------------------------------------------ other model classes
MODEL_CLASSES = {
    "model": (DeepseekV3Model, "last_hidden_state"),
    "causal_lm": (DeepseekV3ForCausalLM, "logits"),
    "sequence_classification": (DeepseekV3ForSequenceClassification, "logits"),
    "token_classification": (DeepseekV3ForTokenClassification, "logits"),
}


@pytest.mark.parametrize("name", MODEL_CLASSES)
def test_every_deepseek_v3_model_class_is_patched(batch, name):
    model_class, output_name = MODEL_CLASSES[name]
    config = tiny_deepseek_v3_config(num_labels=3, pad_token_id=0)
    torch.manual_seed(0)
    native = model_class(config).eval()
    model = copy.deepcopy(native)

    report = apply_liger_kernel_to_deepseek_v3(model=model)

    swapped = {r.target for r in report}
    assert {"DeepseekV3RMSNorm modules", "DeepseekV3Attention modules", "DeepseekV3TopkRouter modules"} <= swapped
    assert LIGER_TYPES <= set(module_types(model).values())
    has_forward_swap = model_class is DeepseekV3ForCausalLM
    assert ("DeepseekV3ForCausalLM.forward of the instance" in swapped) is has_forward_swap
    assert ("forward" in vars(model)) is has_forward_swap
    input_ids = batch[0] % (config.vocab_size - 1) + 1  # no pad token: sequence classification reads the last one
    with torch.no_grad():
        expected = getattr(native(input_ids), output_name)
        actual = getattr(model(input_ids), output_name)
    torch.testing.assert_close(actual, expected, **FP32)
