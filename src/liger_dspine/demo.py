"""A tiny DeepSeek-V3 trained natively and with the Liger patch on embedded text, side by side."""

import copy
import time
from importlib import resources

import torch
from tqdm import tqdm


def demo_config(vocab_size: int = 256):
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=1.0,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    return config


def corpus_batches(seq_len: int, batch_size: int, steps: int, seed: int):
    """Byte-level windows of the embedded corpus: [steps] batches of [batch_size, seq_len] token ids."""
    text = resources.files("liger_dspine").joinpath("data/demo_corpus.txt").read_bytes()
    tokens = torch.tensor(list(text), dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - seq_len, (steps, batch_size), generator=generator)
    return [torch.stack([tokens[s : s + seq_len] for s in row]) for row in starts]


def train(model, batches, device, desc: str) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    losses = []
    for input_ids in tqdm(batches, desc=desc, unit="step"):
        input_ids = input_ids.to(device)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def run_demo(steps: int = 8, seed: int = 0) -> int:
    from transformers import DeepseekV3ForCausalLM

    from liger_dspine import apply_liger_kernel_to_deepseek_v3

    device = "cuda" if torch.cuda.is_available() else "cpu"
    where = "CUDA kernels" if device == "cuda" else "Triton's interpreter on the CPU"
    print(f"liger-dspine demo: tiny DeepSeek-V3 (2 layers, MLA, 4 experts top-2), {steps} AdamW steps, {where}")
    config = demo_config()
    torch.manual_seed(seed)
    native = DeepseekV3ForCausalLM(config).to(device)
    patched = copy.deepcopy(native)
    report = apply_liger_kernel_to_deepseek_v3(model=patched)
    batches = corpus_batches(seq_len=32, batch_size=2, steps=steps, seed=seed)

    start = time.perf_counter()
    native_losses = train(native, batches, device, "native")
    native_s = time.perf_counter() - start
    start = time.perf_counter()
    patched_losses = train(patched, batches, device, "liger-dspine")
    patched_s = time.perf_counter() - start

    return print_comparison(native_losses, patched_losses, native_s, patched_s, where, report)


def print_comparison(native_losses, patched_losses, native_s, patched_s, where, report) -> int:
    """Both loss curves side by side, the largest difference and the patch report; 0 when they agree."""
    print("\nstep  native loss  liger-dspine loss  |diff|")
    for step, (a, b) in enumerate(zip(native_losses, patched_losses)):
        print(f"{step:4d}  {a:11.6f}  {b:17.6f}  {abs(a - b):.2e}")
    largest = max(abs(a - b) for a, b in zip(native_losses, patched_losses))
    print(f"\nlargest loss difference: {largest:.2e}")
    print(f"time: native {native_s:.1f} s, liger-dspine {patched_s:.1f} s ({where})")
    print(f"\n{report}")
    return 0 if largest < 1e-3 else 1
