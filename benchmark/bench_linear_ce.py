"""Linear cross entropy at DeepSeek-V3's lm_head (V=129280, H=7168, bf16): liger-kernel's fused linear CE
(token chunks, [V, H] weight-gradient accumulator) against liger-dspine's vocabulary-chunked op.

For each implementation and token count: forward + backward time (mean of --iters after --warmup), peak memory
above the inputs (hidden, weight) over one forward + backward, and the bytes saved from forward to backward.
Implementations:
    liger           liger_fused_linear_cross_entropy as lce_forward calls it (accumulator in the weight's dtype)
    liger-fp32acc   the same with accum_dtype=torch.float32 (fp32 [V, H] accumulator)
    liger-cmc8      the same with chunk_mem_const=8 (8x larger token chunks: fewer accumulator passes)
    vocab           liger_vocab_chunked_linear_cross_entropy (default chunk), dW written chunk by chunk

    python benchmark/bench_linear_ce.py                        # T = 4096, 16384, 32768; writes data/linear_ce.csv
    python benchmark/bench_linear_ce.py --tokens 4096 --impls liger vocab
"""

import argparse
import csv
import logging
import os

import torch

import liger_dspine  # noqa: F401  (before any kernel module)

logger = logging.getLogger("bench_linear_ce")
GIB = 2**30
IGNORE_INDEX = -100
IMPLS = ("liger", "liger-fp32acc", "liger-cmc8", "vocab")
FIELDS = ["impl", "tokens", "vocab", "hidden", "dtype", "fwd_bwd_ms", "peak_gib", "saved_gib", "loss", "status"]


def loss_fn(impl: str):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    from liger_dspine.ops.linear_cross_entropy import liger_vocab_chunked_linear_cross_entropy

    if impl == "vocab":
        return lambda h, w, y: liger_vocab_chunked_linear_cross_entropy(h, w, y)[0]
    options = {"liger": {}, "liger-fp32acc": {"accum_dtype": torch.float32}, "liger-cmc8": {"chunk_mem_const": 8}}
    kwargs = options[impl]
    return lambda h, w, y: (
        liger_fused_linear_cross_entropy(h, w, y, ignore_index=IGNORE_INDEX, return_token_accuracy=True, **kwargs).loss
    )


def make_inputs(tokens, hidden_size, vocab, dtype, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=generator, device="cuda", dtype=dtype)
    weight = torch.randn(vocab, hidden_size, generator=generator, device="cuda", dtype=dtype) * hidden_size**-0.5
    targets = torch.randint(0, vocab, (tokens,), generator=generator, device="cuda")
    targets[::16] = IGNORE_INDEX
    return hidden.requires_grad_(True), weight.requires_grad_(True), targets


def step(fn, hidden, weight, targets):
    hidden.grad = weight.grad = None
    loss = fn(hidden, weight, targets)
    loss.backward()
    return loss


def saved_bytes(fn, hidden, weight, targets) -> int:
    """Bytes of the distinct storages autograd keeps from forward to backward, the inputs excluded."""
    storages = {}
    inputs = {hidden.untyped_storage().data_ptr(), weight.untyped_storage().data_ptr()}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in inputs:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    hidden.grad = weight.grad = None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn(hidden, weight, targets)
    loss.backward()
    return sum(storages.values())


def measure(impl, tokens, hidden_size, vocab, dtype, warmup, iters) -> dict:
    row = dict(impl=impl, tokens=tokens, vocab=vocab, hidden=hidden_size, dtype=str(dtype).replace("torch.", ""))
    fn = loss_fn(impl)
    hidden, weight, targets = make_inputs(tokens, hidden_size, vocab, dtype)
    try:
        for _ in range(warmup):
            step(fn, hidden, weight, targets)
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
        loss = step(fn, hidden, weight, targets)
        torch.cuda.synchronize()
        row["peak_gib"] = round((torch.cuda.max_memory_allocated() - baseline) / GIB, 3)
        row["loss"] = round(loss.item(), 5)
        row["saved_gib"] = round(saved_bytes(fn, hidden, weight, targets) / GIB, 3)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            step(fn, hidden, weight, targets)
        end.record()
        torch.cuda.synchronize()
        row["fwd_bwd_ms"] = round(start.elapsed_time(end) / iters, 2)
        row["status"] = "ok"
    except torch.cuda.OutOfMemoryError:
        row["status"] = "oom"
    finally:
        del hidden, weight, targets
        torch.cuda.empty_cache()
    return row


def print_table(rows: list[dict]) -> None:
    header = f"{'impl':<14} {'tokens':>7} {'fwd+bwd ms':>11} {'peak GiB':>9} {'saved GiB':>10} {'loss':>9}  status"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['impl']:<14} {r['tokens']:>7} {r.get('fwd_bwd_ms', ''):>11} {r.get('peak_gib', ''):>9} "
            f"{r.get('saved_gib', ''):>10} {r.get('loss', ''):>9}  {r['status']}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--vocab", type=int, default=129280)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "data", "linear_ce.csv"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("bench_linear_ce.py needs a CUDA device")

    rows = []
    for tokens in args.tokens:
        for impl in args.impls:
            row = measure(impl, tokens, args.hidden, args.vocab, torch.bfloat16, args.warmup, args.iters)
            logger.info("%s", row)
            rows.append(row)
    print_table(rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
