"""A tiny DeepSeek-V3 trained natively and with the Liger patch on embedded text, side by side.

On a CPU the patched model's Triton kernels run through Triton's interpreter: the demo shows that the two runs compute
the same losses, not how fast the kernels are; the GPU figures it prints come from ``benchmark/RESULTS.md``.
"""

import copy
import time
from importlib import resources

import torch
from tqdm import tqdm

STEPS = 6
SEQ_LEN = 32
BATCH_SIZE = 1
# One H200, DeepSeek-V3's real widths, bf16 training steps (benchmark/RESULTS.md, "DeepSeek-V3 training step").
GPU_FIGURES = (
    "on one H200 at DeepSeek-V3's real widths (bf16 training steps), liger-dspine runs 1.16x transformers' tokens/s "
    "at 2 layers / 4096 tokens and 1.30x at 8 layers, and needs 0.50x liger-kernel's peak memory at 32768 tokens "
    "(recompute_attention=True)"
)
INTERPRETER = (
    "the patched run is slower on a CPU because Triton's interpreter runs each kernel in Python and NumPy, one program "
    "instance after another (about 500x slower than compiled kernels): on a CPU this demo checks results, not speed"
)


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


def run_demo(steps: int = STEPS, seed: int = 0) -> int:
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
    print(report)
    batches = corpus_batches(seq_len=SEQ_LEN, batch_size=BATCH_SIZE, steps=steps, seed=seed)

    start = time.perf_counter()
    native_losses = train(native, batches, device, "native")
    native_s = time.perf_counter() - start
    start = time.perf_counter()
    patched_losses = train(patched, batches, device, "liger-dspine")
    patched_s = time.perf_counter() - start

    return print_comparison(native_losses, patched_losses, native_s, patched_s, device, GPU_FIGURES)


def print_comparison(native_losses, patched_losses, native_s, patched_s, device, gpu_figures, tolerance=1e-3) -> int:
    """Both loss curves side by side, whether they agree, what the times mean, and the GPU figures; 0 when they
    agree."""
    print("\nstep  native loss  liger-dspine loss  |diff|")
    for step, (a, b) in enumerate(zip(native_losses, patched_losses)):
        print(f"{step:4d}  {a:11.6f}  {b:17.6f}  {abs(a - b):.2e}")
    largest = max(abs(a - b) for a, b in zip(native_losses, patched_losses))
    same = "the same losses" if largest < tolerance else f"DIFFERENT losses (more than {tolerance:.0e} apart)"
    print(f"\nresult: patched and native runs give {same}: largest difference {largest:.2e} (fp32)")
    times = f"time: native {native_s:.1f} s, liger-dspine {patched_s:.1f} s"
    if device == "cpu":
        print(f"{times}; {INTERPRETER}")
    else:
        print(f"{times}; a model this small measures launch overheads, not the kernels")
    print(f"GPU: {gpu_figures}")
    return 0 if largest < tolerance else 1
