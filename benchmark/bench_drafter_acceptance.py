"""Drafter quality, native against the Liger path: both train the same DSpine drafter from the same weights on the
same batches, and their offline acceptance lengths (``eval-drafter``'s) must rise well above the untrained drafter's
and agree.

The target is a random DeepSeek-V3 at its real widths (hidden 7168, MLA, vocabulary 129280; 4 layers, the fourth MoE
with 256 experts top-8) whose token embeddings have unit standard deviation and whose attention outputs are scaled by
0.2, so that its next token is a function of the current one and its greedy continuations are learnable in a few
hundred steps (a random target's continuations are deterministic; their patterns are what a drafter learns). Such a
target shows that both paths train alike, not a real model's speed-up. The drafter is the one ``train-drafter``
builds for that target (its defaults: 2 layers, blocks of 16, top-16 candidates, transfer rank 1024). Training rows
are the target's greedy continuations of random prompts, captured once; held-out prompts come from another seed.
Native: the drafter's native modules and the eager objective. Liger: the patched drafter
(``apply_liger_kernel_to_dspine``: Liger RMSNorm, SwiGLU, attention and injection) and the fused objective. At the
end ``spec_generate`` runs the Liger-trained drafter at batch 1 against ``target.generate``.

    python benchmark/bench_drafter_acceptance.py          # GPU, bf16: 300 steps a path
    python benchmark/bench_drafter_acceptance.py --tiny   # CPU check of the script (tiny models, a few steps, fp32)

Writes data/drafter_acceptance{,_tiny}.{csv,md} (and .png with matplotlib). It passes when, after the last step, both
paths' refined and plain acceptance lengths exceed the untrained drafter's by ``--min-rise`` and differ by at most
``--tolerance`` (by default three standard errors of the difference over the held-out blocks).
"""

import argparse
import copy
import csv
import json
import os
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")
FIELDS = ["impl", "step", "loss", "refined", "plain", "step_s"]

# DeepSeek-V3's widths (its config.json), at 4 layers: three dense, one MoE
DEEPSEEK_V3 = dict(
    hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=128,
    num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1,
    first_k_dense_replace=3, routed_scaling_factor=2.5, vocab_size=129280, num_hidden_layers=4,
)  # fmt: skip
TINY_DEEPSEEK_V3 = dict(
    hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
    num_experts_per_tok=2, n_group=2, topk_group=2, n_shared_experts=1, first_k_dense_replace=3,
    routed_scaling_factor=1.0, vocab_size=96, num_hidden_layers=4,
)  # fmt: skip
# (target, drafter options of train-drafter, data, training) of the GPU run and of --tiny
SIZES = {
    "gpu": dict(
        target=DEEPSEEK_V3, drafter_args=[],
        prompt=16, continuation=240, train_rows=256, rows_per_step=8, anchors=64, eval_rows=32, eval_anchors=64,
        generate_prompts=8, steps=300, eval_every=100, lr=1e-4, dtype="bfloat16", confined_to=1024,
    ),
    "tiny": dict(
        target=TINY_DEEPSEEK_V3,
        drafter_args=["--block-size", "4", "--top-k", "3", "--transfer-rank", "8", "--message-size", "4",
                      "--drafter-head-dim", "8", "--target-layer-ids", "0,2"],
        prompt=4, continuation=28, train_rows=8, rows_per_step=1, anchors=4, eval_rows=1, eval_anchors=6,
        generate_prompts=1, steps=2, eval_every=2, lr=2e-2, dtype="float32", confined_to=None,
    ),
}  # fmt: skip
ATTENTION_SCALE = 0.2
# With the initializer's 0.02, a token's embedding is swamped by the layers' outputs (standard deviation about 2 at
# hidden 7168), which carry the context mean picked up by attention: the next token then depends on the whole context
# (at hidden 1024, 76% of next tokens follow from the current one; with unit embeddings, 100%).
EMBEDDING_STD = 1.0
# A random head at real widths gives nearly flat logits over the whole vocabulary (top-two margins below bf16's
# rounding) and a map no drafter can learn from a few hundred steps; the GPU target's head reaches only the first
# tokens (``confined_to``), with these logit margins (normalised hidden states have unit RMS).
HEAD_LOGIT_STD = 4.0


def train_drafter_args(sizes: dict, folder: str, dtype: str):
    """train-drafter's resolved arguments for a random target of ``sizes["target"]`` (its config written to
    ``folder``) and the drafter options of ``sizes``; the mask token is the last id. The target stays native (both
    paths share it; only the drafter's path differs)."""
    from transformers import DeepseekV3Config

    from liger_dspine.drafter_training.options import add_arguments
    from liger_dspine.drafter_training.options import resolve

    config = DeepseekV3Config(**sizes["target"], max_position_embeddings=4096, tie_word_embeddings=False)
    path = os.path.join(folder, "target_config.json")
    with open(path, "w") as handle:
        json.dump(config.to_dict(), handle)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    mask = str(sizes["target"]["vocab_size"] - 1)
    argv = ["--target-config", path, "--mask-token-id", mask, "--seq-len", "4096", "--dtype", dtype, "--no-liger"]
    return resolve(parser.parse_args(argv + sizes["drafter_args"]))


def build_target(args, device, dtype, tokens: int | None):
    """train-drafter's random target, its attention outputs scaled by ATTENTION_SCALE. With ``tokens``, its embeddings
    are redrawn at EMBEDDING_STD, and its head's rows past the first ``tokens`` are zero and those are redrawn with
    logits of standard deviation HEAD_LOGIT_STD: its greedy continuations stay among the first ``tokens`` ids, with
    clear margins between the top two logits."""
    from liger_dspine.drafter_training import setup

    target = setup.build_target(args, device, dtype)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(ATTENTION_SCALE)
        if tokens is not None:
            head = target.lm_head.weight
            generator = torch.Generator(device=head.device).manual_seed(3)
            target.model.embed_tokens.weight.normal_(0.0, EMBEDDING_STD, generator=generator)
            rows = torch.randn(tokens, head.shape[1], generator=generator, device=head.device, dtype=torch.float32)
            head.zero_()
            head[:tokens] = (rows * HEAD_LOGIT_STD / head.shape[1] ** 0.5).to(head.dtype)
    return target


@torch.no_grad()
def continuations(target, rows: int, prompt: int, new_tokens: int, seed: int, prompt_ids: int):
    """[rows, prompt + new_tokens]: greedy continuations of random prompts of ids below ``prompt_ids`` (the mask
    token never in a prompt)."""
    generator = torch.Generator().manual_seed(seed)
    device = target.lm_head.weight.device
    prompts = torch.randint(0, prompt_ids, (rows, prompt), generator=generator).to(device)
    out = []
    for start in range(0, rows, 64):
        chunk = prompts[start : start + 64]
        out.append(
            target.generate(
                chunk,
                attention_mask=torch.ones_like(chunk),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
        )
    return torch.cat(out)


def train_path(name, draft, target, batches, sequences, sizes, liger: bool, writer, rows):
    from liger_dspine import apply_liger_kernel_to_dspine
    from liger_dspine.drafter_training.evaluation import offline_acceptance
    from liger_dspine.models.dspine import DSpineObjective

    objective = DSpineObjective(
        draft, target.lm_head, target.model.embed_tokens, num_anchors=sizes["anchors"], fused_objective=liger
    ).train()
    if liger:
        apply_liger_kernel_to_dspine(model=objective)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=sizes["lr"])
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    torch.manual_seed(7)  # the same anchor and teacher-forcing draws on both paths
    steps = sizes["steps"]
    results = None
    for step in range(1, steps + 1):
        sync()
        start = time.perf_counter()
        output = objective(**batches[(step - 1) % len(batches)], global_step=step - 1, total_steps=steps)
        output.loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        step_s = time.perf_counter() - start
        if step % sizes["eval_every"] == 0 or step == steps:
            state = torch.random.get_rng_state()
            results = offline_acceptance(draft, target, sequences)
            torch.random.set_rng_state(state)
            row = dict(impl=name, step=step, loss=float(output.loss.detach()), step_s=step_s)
            row.update(refined=results["refined"].mean_acceptance_length, plain=results["plain"].mean_acceptance_length)
            rows.append(row)
            writer.writerow(row)
            print(f"{name:>7} step {step:4d}: loss {row['loss']:.4f}, acceptance {row['refined']:.3f} "
                  f"(plain {row['plain']:.3f}), {step_s * 1e3:.0f} ms/step", flush=True)  # fmt: skip
    return results


def sampling_tolerance(first, second) -> float:
    """Three standard errors of the difference of two mean acceptance lengths over their held-out blocks: the spread
    that sampling the blocks alone gives two equal drafters."""
    variance = sum(stats.accepted.float().var().item() / stats.blocks for stats in (first, second))
    return 3.0 * variance**0.5


def end_to_end_lines(draft, target, prompts: torch.Tensor, new_tokens: int) -> list[str]:
    """spec_generate at batch 1 on each prompt, refined and plain, against target.generate(do_sample=False): acceptance
    length, tokens per target forward, draft and verify time, tokens/s of each, and whether the output is generate's
    (in bf16 a verification's rounding may differ from decoding's one token at a time, and an argmax with it). One
    prompt of each is run first as a warm-up."""
    sync = torch.cuda.synchronize if prompts.is_cuda else (lambda: None)

    def generate(row):
        return target.generate(row[None], max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)

    def timed(function, row):
        sync()
        start = time.perf_counter()
        result = function(row)
        sync()
        return result, time.perf_counter() - start

    generate(prompts[0])
    references = [timed(generate, row) for row in prompts]
    reference_rate = sum(r.shape[1] - len(row) for (r, _), row in zip(references, prompts)) / sum(
        s for _, s in references
    )
    lines = [
        f"target.generate at batch 1: {reference_rate:.1f} tokens/s",
        "",
        "| draft | mean acceptance length | tokens / target forward | draft s | verify s | tokens/s | vs generate "
        "| = generate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for refine in (True, False):

        def speculate(row, refine=refine):
            return draft.spec_generate(target, row[None], new_tokens, refine=refine)

        speculate(prompts[0])
        runs = [timed(speculate, row) for row in prompts]
        outputs = [output for output, _ in runs]
        lengths = [length for output in outputs for length in output.acceptance_lengths]
        tokens = sum(output.new_tokens for output in outputs)
        forwards = sum(output.target_forwards for output in outputs)
        rate = tokens / sum(seconds for _, seconds in runs)
        same = sum(torch.equal(output.sequences, r) for output, (r, _) in zip(outputs, references))
        lines.append(
            f"| {'refined' if refine else 'plain'} | {sum(lengths) / len(lengths):.3f} | {tokens / forwards:.3f} | "
            f"{sum(o.draft_s for o in outputs):.2f} | {sum(o.verify_s for o in outputs):.2f} | {rate:.1f} | "
            f"{rate / reference_rate:.2f}x | {same}/{len(outputs)} |"
        )
    return lines


def plot(rows: list[dict], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axis = plt.subplots(figsize=(7, 4))
    for impl in ("native", "liger"):
        points = [row for row in rows if row["impl"] == impl]
        for variant, style in (("refined", "-"), ("plain", "--")):
            axis.plot(
                [r["step"] for r in points], [r[variant] for r in points], style, marker="o", label=f"{impl} {variant}"
            )
    axis.set(xlabel="step", ylabel="offline acceptance length", title="DSpine drafter: native and Liger training")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def main(argv=None) -> dict:
    threads = torch.get_num_threads()
    try:
        return run(argv)
    finally:
        torch.set_num_threads(threads)


def run(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU, a few steps")
    parser.add_argument("--steps", type=int, help="training steps a path (default: 300, --tiny: 2)")
    parser.add_argument("--eval-every", type=int, help="evaluate every N steps (default: 100, --tiny: 2)")
    parser.add_argument("--min-rise", type=float, default=0.5, help="required rise over the untrained drafter")
    parser.add_argument(
        "--tolerance", type=float, help="largest native-Liger acceptance difference (default: 3 standard errors)"
    )
    parser.add_argument("--lr", type=float, help="AdamW learning rate (default: 1e-4, --tiny: 2e-2)")
    parser.add_argument("--out", default=DATA, help="folder of the CSV, table and plot")
    parser.add_argument("--budget-s", type=float, help="accepted for run_gpu.sh; the run is bounded by --steps")
    args = parser.parse_args(argv)

    from liger_dspine.cli import _setup_device

    _setup_device(args.tiny)  # before any kernel module is imported: --tiny runs on the CPU, through the interpreter
    from liger_dspine.drafter_training.evaluation import EvalSequence
    from liger_dspine.drafter_training.evaluation import offline_acceptance
    from liger_dspine.models.dspine import DSpineDraftModel
    from liger_dspine.models.dspine.capture import TargetCapture

    if args.tiny:
        torch.set_num_threads(1)  # tiny ops: one thread beats two on a shared CPU
    sizes = dict(SIZES["tiny" if args.tiny else "gpu"])
    sizes.update(
        {k: v for k, v in (("steps", args.steps), ("eval_every", args.eval_every), ("lr", args.lr)) if v is not None}
    )
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = getattr(torch, sizes["dtype"])
    with tempfile.TemporaryDirectory() as folder:
        options = train_drafter_args(sizes, folder, sizes["dtype"])
        target = build_target(options, device, dtype, sizes["confined_to"])
    from liger_dspine.drafter_training import setup

    config = setup.drafter_config(options, target)
    prompt_ids = sizes["confined_to"] or config.mask_token_id
    capture = TargetCapture(target, config.target_layer_ids)
    rows_per_step = sizes["rows_per_step"]
    started = time.perf_counter()
    train = continuations(target, sizes["train_rows"], sizes["prompt"], sizes["continuation"], 1, prompt_ids)
    print(f"training rows: {tuple(train.shape)} in {time.perf_counter() - started:.1f} s", flush=True)
    batches = [capture(train[i : i + rows_per_step]) for i in range(0, len(train), rows_per_step)]
    held_out = continuations(
        target, sizes["eval_rows"], sizes["prompt"], sizes["eval_anchors"] + config.block_size - 1, 2, prompt_ids
    )
    sequences = [
        EvalSequence(row, sizes["prompt"], sizes["eval_anchors"], capture(row[None])["hidden_states"])
        for row in held_out
    ]

    torch.manual_seed(1)
    initial = DSpineDraftModel(config).to(device=device, dtype=dtype)
    initial.initialize_transfer_space(target.lm_head.weight.float())
    with torch.no_grad():  # writes at 0 would leave the spine out of the first steps
        for write in initial.injection.writes:
            write.weight.normal_(0.0, 0.02)
    untrained = offline_acceptance(initial, target, sequences)
    untrained = {name: stats.mean_acceptance_length for name, stats in untrained.items()}
    print(f"untrained: acceptance {untrained['refined']:.3f} (plain {untrained['plain']:.3f})")

    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "drafter_acceptance" + ("_tiny" if args.tiny else ""))
    rows = [dict(impl="untrained", step=0, loss=float("nan"), step_s=0.0, **untrained)]
    with open(stem + ".csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerow(rows[0])
        trained, last = {}, {}
        for name, liger in (("native", False), ("liger", True)):
            trained[name] = copy.deepcopy(initial)
            last[name] = train_path(name, trained[name], target, batches, sequences, sizes, liger, writer, rows)

    final = {row["impl"]: row for row in rows}  # the last row of each path
    checks, tolerances = {}, {}
    for variant in ("refined", "plain"):
        for impl in ("native", "liger"):
            checks[f"{impl} {variant} rises"] = final[impl][variant] >= untrained[variant] + args.min_rise
        tolerances[variant] = args.tolerance
        if tolerances[variant] is None:
            tolerances[variant] = sampling_tolerance(last["native"][variant], last["liger"][variant])
        checks[f"{variant} agrees"] = abs(final["native"][variant] - final["liger"][variant]) <= tolerances[variant]
    passed = all(checks.values())
    lines = ["| impl | step | loss | refined | plain | ms/step |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['impl']} | {r['step']} | {r['loss']:.4f} | {r['refined']:.3f} | {r['plain']:.3f} | "
            f"{r['step_s'] * 1e3:.0f} |"
        )
    lines += ["", "end to end (spec_generate, greedy, the Liger-trained drafter):", ""]
    prompts = held_out[: sizes["generate_prompts"], : sizes["prompt"]]
    lines += end_to_end_lines(trained["liger"], target, prompts, sizes["eval_anchors"])
    lines += ["", "native - Liger acceptance difference, and its tolerance: " + ", ".join(
        f"{v} {final['native'][v] - final['liger'][v]:+.3f} (within {tolerances[v]:.3f})" for v in tolerances
    )]  # fmt: skip
    lines += ["", f"{'passed' if passed else 'FAILED'}: " + ", ".join(f"{k}: {v}" for k, v in checks.items())]
    lines += [f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, dtype {sizes['dtype']}"]
    with open(stem + ".md", "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    plotted = plot(rows, stem + ".png")
    print(f"wrote {stem}.csv, {stem}.md" + (f", {plotted}" if plotted else " (no plot: matplotlib is not installed)"))
    return {"rows": rows, "checks": checks, "passed": passed}


if __name__ == "__main__":
    raise SystemExit(0 if main()["passed"] else 1)
