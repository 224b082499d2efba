"""``fp8=True`` under FSDP2 and under DeepSpeed ZeRO-3 on two gloo ranks, against one process running the same two
half batches.

FP8 scales depend on what a GEMM sees: the weight gradient scales each feature over the tokens of its operands, so a
rank's half batch gets other scales than the whole batch would. The reference is therefore one process with the same
fp8 patch taking the two halves one after the other (gradients accumulated, then halved, as FSDP2's mean reduction
gives them). FSDP2 and ZeRO-3 gather each weight whole around the FP8 GEMMs, so the ranks must match it to fp32
rounding: FSDP2's gradients directly; ZeRO-3's through one SGD step of learning rate 1 (its gradients live in the
optimizer's partitions), which must move every parameter by the reference's gradient.
"""

import pytest
import torch

from one_process_reference import FP32
from one_process_reference import assert_matches
from one_process_reference import batch
from one_process_reference import fully_shard_layers
from one_process_reference import rank_rows
from one_process_reference import rank_step
from spawned_ranks import run_on_gloo_ranks
from tiny_models import build_model
from tiny_models import tiny_deepseek_v3_config

pytestmark = pytest.mark.slow  # spawned gloo ranks loading a model each: a minute or more
BATCH = 4
WORLD_SIZE = 2
# every FP8 GEMM's dims multiples of 16 (kv_a_proj_with_mqa: kv_lora_rank + rope)
FP8_WIDTHS = dict(qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=16, q_lora_rank=16)


def _fsdp2_fp8(rank, world_size, path):
    from transformers import DeepseekV3ForCausalLM

    import liger_dspine
    from liger_dspine.modules.swiglu import LigerFP8SwiGLUMLP

    model = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    fully_shard_layers(model, world_size)
    liger_dspine.apply_liger_kernel_to_deepseek_v3(model=model, fp8=True)
    result = rank_step(model, rank, world_size, BATCH)
    result["fp8_mlp"] = isinstance(model.model.layers[0].mlp, LigerFP8SwiGLUMLP)
    return result


def _zero3_fp8(rank, world_size, path):
    import deepspeed
    from transformers import DeepseekV3ForCausalLM

    import liger_dspine
    from liger_dspine.modules.swiglu import LigerFP8SwiGLUMLP

    liger_dspine.apply_liger_kernel_to_deepseek_v3(fp8=True)
    try:
        model = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).train()
        zero3 = {
            "train_micro_batch_size_per_gpu": BATCH // world_size,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3},
            "zero_allow_untested_optimizer": True,
            "gradient_clipping": 0.0,  # the plain SGD step of the reference
        }
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=zero3
        )
        input_ids, labels = batch(model.config, BATCH)
        share = rank_rows(rank, world_size, BATCH)
        loss = engine(input_ids[share], labels=labels[share]).loss
        engine.backward(loss)
        engine.step()
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            params = {name: p.detach().clone() for name, p in model.named_parameters()}
        return {"params": params, "fp8_mlp": isinstance(model.model.layers[0].mlp, LigerFP8SwiGLUMLP)}
    finally:
        liger_dspine.revert_liger_kernel_to_deepseek_v3()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(saved model path, loss and gradients of one fp8-patched process over the two half batches)."""
    import liger_dspine

    folder = tmp_path_factory.mktemp("tiny_v3_fp8")
    config = tiny_deepseek_v3_config(**FP8_WIDTHS)
    model = build_model(config)
    model.save_pretrained(folder)
    liger_dspine.apply_liger_kernel_to_deepseek_v3(model=model.train(), fp8=True)
    input_ids, labels = batch(config, BATCH)
    losses = []
    for rank in range(WORLD_SIZE):
        share = rank_rows(rank, WORLD_SIZE, BATCH)
        out = model(input_ids[share], labels=labels[share])
        out.loss.backward()
        losses.append(out.loss.detach())
    grads = {name: p.grad / WORLD_SIZE for name, p in model.named_parameters()}
    stepped = {name: (p - p.grad / WORLD_SIZE).detach() for name, p in model.named_parameters()}  # SGD, lr 1
    return str(folder), torch.stack(losses).mean(), grads, stepped


def test_fp8_under_fsdp2_matches_one_process_on_the_same_halves(tmp_path, reference):
    path, loss, grads, _ = reference
    result = run_on_gloo_ranks(tmp_path, WORLD_SIZE, _fsdp2_fp8, path)
    assert result["fp8_mlp"]
    assert_matches(result, loss, grads)


def test_fp8_under_zero3_steps_as_one_process_on_the_same_halves(tmp_path, reference):
    pytest.importorskip("deepspeed", reason="DeepSpeed (a test extra)")
    path, _, _, stepped = reference
    result = run_on_gloo_ranks(tmp_path, WORLD_SIZE, _zero3_fp8, path, limit_s=900)
    assert result["fp8_mlp"]
    assert result["params"].keys() == stepped.keys()
    for name, expected in stepped.items():
        torch.testing.assert_close(result["params"][name], expected, **FP32, msg=name)
