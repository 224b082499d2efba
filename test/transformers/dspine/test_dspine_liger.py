"""use_liger_kernel=True (LigerRMSNorm + LigerSwiGLUMLP built in) against the native drafter.

One training step through the accumulation replay path (two micro-batches, SGD): losses, gradients and updated
parameters must agree. On CPU the Liger kernels run in Triton's interpreter (fp32 only, slow: tiny shapes).
Tolerances as in dspine.md section 7.4: 2e-5 in fp32, 0.02 in bf16, and a gradient cosine above 0.999.
"""

import pytest
import torch

from liger_dspine.models.dspine import DSpineAccumulationWindow
from liger_dspine.models.dspine import DSpineDraftModel
from liger_dspine.models.dspine import DSpineObjective
from tiny_dspine import TINY_MASK_TOKEN
from tiny_dspine import seeded_draft
from tiny_dspine import target_batch
from tiny_dspine import tiny_draft_config
from tiny_dspine import tiny_target
from tiny_dspine import to_device

pytest.importorskip("liger_kernel")


def build_pair(target, dtype, device):
    """A native drafter and a Liger drafter with the same weights (head_dim 16: one KV head)."""
    config = tiny_draft_config(head_dim=16, num_attention_heads=2, num_key_value_heads=1)
    native = seeded_draft(target, config, seed=321)
    liger = DSpineDraftModel(config, use_liger_kernel=True)
    liger.load_state_dict(native.state_dict(), strict=True)
    assert set(liger.state_dict()) == set(native.state_dict())
    return [to_device(model, device, dtype) for model in (native, liger)]


def training_step(draft, target, batches, step):
    objective = DSpineObjective(
        draft, target.lm_head, target.model.embed_tokens, num_anchors=3, objective_chunk_blocks=2
    )
    objective.train()
    window = DSpineAccumulationWindow(objective, accumulation_steps=len(batches))
    torch.manual_seed(7)
    for batch in batches:
        window.prepass(batch, global_step=step, total_steps=600)
    outputs = window.replay()
    codes = draft.transfer_codes.clone()
    loss = sum(o.loss_terms[0].detach() for o in outputs) / sum(o.loss_terms[1] for o in outputs)
    grads = {name: p.grad.detach().float().clone() for name, p in draft.named_parameters()}
    optimizer = torch.optim.SGD(draft.parameters(), lr=0.01)
    optimizer.step()
    assert target.lm_head.weight.grad is None and target.model.embed_tokens.weight.grad is None
    assert torch.equal(draft.transfer_codes, codes) and draft.transfer_codes.dtype == torch.float32
    updated = {name: p.detach().float().clone() for name, p in draft.named_parameters()}
    return loss.float(), grads, updated


def make_batches(target, device):
    batches = []
    for seed in (1, 2):
        generator = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, TINY_MASK_TOKEN, (2, 10), generator=generator)
        loss_mask = torch.ones(2, 10)
        loss_mask[0, : seed + 1] = 0
        batch = target_batch(target, input_ids.to(device), loss_mask.to(device)).as_kwargs()
        batches.append(batch)
    return batches


def compare(native, liger, tolerance):
    (native_loss, native_grads, native_params), (liger_loss, liger_grads, liger_params) = native, liger
    assert abs(liger_loss - native_loss) <= max(tolerance, tolerance * abs(native_loss))
    for name, grad in native_grads.items():
        assert torch.isfinite(liger_grads[name]).all(), name
        torch.testing.assert_close(liger_grads[name], grad, atol=tolerance, rtol=tolerance, msg=name)
        torch.testing.assert_close(liger_params[name], native_params[name], atol=tolerance, rtol=tolerance, msg=name)
    flat_native = torch.cat([g.flatten() for g in native_grads.values()])
    flat_liger = torch.cat([liger_grads[name].flatten() for name in native_grads])
    assert (flat_liger - flat_native).norm() / flat_native.norm() < tolerance
    assert torch.nn.functional.cosine_similarity(flat_liger, flat_native, dim=0) > 0.999


@pytest.mark.slow
def test_liger_matches_native_fp32_through_replay():
    target = tiny_target()
    native, liger = build_pair(target, torch.float32, "cpu")
    batches = make_batches(target, "cpu")
    compare(training_step(native, target, batches, 100), training_step(liger, target, batches, 100), 2e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("attention", ["sdpa", "flex_attention"])
@pytest.mark.parametrize("step", [100, 300])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 0.02)])
def test_liger_matches_native_cuda(step, dtype, tolerance, attention):
    target = tiny_target(dtype=dtype).to("cuda")
    native, liger = build_pair(target, dtype, "cuda")
    for model in (native, liger):
        model.config._attn_implementation = attention
    batches = make_batches(target, "cuda")
    compare(training_step(native, target, batches, step), training_step(liger, target, batches, step), tolerance)
