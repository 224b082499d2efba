"""A tiny DSpine drafter trained natively and with the Liger patch against a tiny DeepSeek-V3 target, side by side.

The target has random weights (nothing is downloaded) and stays frozen: each step captures its taps and final
states on a batch of the embedded corpus (:class:`~liger_dspine.models.dspine.capture.TargetCapture`, which
keeps only those) and hands them to the drafter's objective, as a trainer capturing them on the fly does. The patched
copy is converted at instance level
(``apply_liger_kernel_to_dspine(model=objective)``): Liger RMSNorm and SwiGLU in the drafter, fused frozen-head
terms in the objective. So that the loss falls within the demo's few steps, the drafter learns one window of the
corpus (the same window every step, new anchors each step); a real run trains on a dataset with ``train-drafter``.
AdamW's ``eps`` is 1e-3 so that parameters with near-zero gradients do not turn fp32 rounding differences into full
steps: the two curves then agree to about 1e-6.
"""

import copy
import time

import torch
from tqdm import tqdm

from liger_dspine.demo import corpus_batches
from liger_dspine.demo import demo_config
from liger_dspine.demo import print_comparison

TARGET_LAYER_IDS = [0, 1]  # both layers of the demo target
MASK_TOKEN_ID = 0  # the NUL byte, never in the corpus
STEPS = 12
SEQ_LEN = 16
BATCH_SIZE = 1
NUM_ANCHORS = 12
BLOCK_SIZE = 4
LR = 1e-2
ADAM_EPS = 1e-3
# One H200, a Qwen3-8B-like drafter (benchmark/RESULTS.md, "DSpine drafter training").
GPU_FIGURES = (
    "on one H200, a DSpine training step of a Qwen3-8B-like drafter (5 layers, hidden 4096, vocabulary 151936, bf16) "
    "runs 1.84x faster with 0.43x the peak memory, and the objective alone 3.18x faster with 0.10x"
)


def dspine_demo_config(target_config):
    """A 2-layer drafter as wide as the target (H 64, 2 heads of 32, 1 KV head), block 4, r 16, m 8, K 4."""
    from liger_dspine.models.dspine import DSpineDraftConfig

    return DSpineDraftConfig(
        hidden_size=target_config.hidden_size,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=target_config.vocab_size,
        max_position_embeddings=target_config.max_position_embeddings,
        block_size=BLOCK_SIZE,
        num_target_layers=target_config.num_hidden_layers,
        dflash_config={"mask_token_id": MASK_TOKEN_ID, "target_layer_ids": TARGET_LAYER_IDS},
        dspine_config={"transfer_rank": 16, "message_size": 8, "top_k": 4, "alignment_warmup_steps": 0},
    )


def train(objective, capture, batches, device, seed: int, desc: str) -> list[float]:
    """AdamW steps on the drafter; each step reseeds, so both runs draw the same anchors and teacher forcing."""
    optimizer = torch.optim.AdamW(objective.draft_model.parameters(), lr=LR, eps=ADAM_EPS)
    objective.train()
    losses = []
    for step, input_ids in enumerate(tqdm(batches, desc=desc, unit="step")):
        batch = capture(input_ids.to(device))
        torch.manual_seed(seed + step)
        out = objective(**batch, global_step=step, total_steps=len(batches))
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    return losses


def run_dspine_demo(steps: int = STEPS, seed: int = 0) -> int:
    from transformers import DeepseekV3ForCausalLM

    from liger_dspine import apply_liger_kernel_to_dspine
    from liger_dspine.models.dspine import DSpineDraftModel
    from liger_dspine.models.dspine import DSpineObjective
    from liger_dspine.models.dspine.capture import TargetCapture

    device = "cuda" if torch.cuda.is_available() else "cpu"
    where = "CUDA kernels" if device == "cuda" else "Triton's interpreter on the CPU"
    print(
        f"\nliger-dspine DSpine demo: 2-layer drafter (block {BLOCK_SIZE}) on a tiny frozen DeepSeek-V3 target, "
        f"{steps} AdamW steps, {where}"
    )
    target_config = demo_config()
    torch.manual_seed(seed)
    target = DeepseekV3ForCausalLM(target_config).to(device).eval().requires_grad_(False)
    draft = DSpineDraftModel(dspine_demo_config(target_config)).to(device)
    native = DSpineObjective(draft, target.lm_head, target.model.embed_tokens, num_anchors=NUM_ANCHORS)
    patched = copy.deepcopy(native)
    report = apply_liger_kernel_to_dspine(model=patched)
    print(report)
    capture = TargetCapture(target, TARGET_LAYER_IDS)
    batches = corpus_batches(seq_len=SEQ_LEN, batch_size=BATCH_SIZE, steps=1, seed=seed) * steps  # one window

    start = time.perf_counter()
    native_losses = train(native, capture, batches, device, seed, "native")
    native_s = time.perf_counter() - start
    start = time.perf_counter()
    patched_losses = train(patched, capture, batches, device, seed, "liger-dspine")
    patched_s = time.perf_counter() - start

    status = print_comparison(native_losses, patched_losses, native_s, patched_s, device, GPU_FIGURES)
    first, last = native_losses[0], native_losses[-1]
    print(f"learning: the drafter's loss went from {first:.3f} at step 0 to {last:.3f} at step {steps - 1}")
    return status
