"""One rank of a short DeepSeek-V3 training run under one multi-GPU engine, native or patched (run by torchrun).

    torchrun --nproc-per-node N benchmark/multi_gpu_train.py --engine tp --impl liger-dspine --out DIR

Engines: ddp (DistributedDataParallel), tp (transformers' tp_plan), ep (expert parallel over the tensor-parallel
group), fsdp2 (transformers' FSDP2 plan), tp_fsdp (tp x FSDP2, N >= 4), ep_fsdp (EP x FSDP2, N >= 4), zero3
(DeepSpeed ZeRO-3). Every data-parallel group trains on its own slice of the same synthetic batches (fixed seed), so
the native and patched runs of one engine see the same data. Rank 0 writes ``<engine>_<impl>.json``: the loss of
every step, tokens/s over the steps after the first, and each rank's peak memory.

``--tiny`` is the CPU check of the script (gloo, fp32, a tiny model, Triton's interpreter); otherwise NCCL, bf16 and
a 2-layer model of DeepSeek-V3's widths.
"""

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

ENGINES = ("ddp", "tp", "ep", "fsdp2", "tp_fsdp", "ep_fsdp", "zero3")


def layout(engine: str, world: int) -> tuple[dict | None, int]:
    """(DistributedConfig arguments, number of data-parallel groups) of ``engine`` on ``world`` ranks."""
    half = max(world // 2, 1)
    return {
        "ddp": (None, world),
        "zero3": (None, world),
        "tp": (dict(tp_size=world), 1),
        "ep": (dict(tp_size=world, tp_plan={}, ep_size=world), 1),
        "fsdp2": (dict(fsdp_size=world), world),
        "tp_fsdp": (dict(tp_size=2, fsdp_size=half), half),
        "ep_fsdp": (dict(fsdp_size=world, ep_size=2), world),
    }[engine]


def model_config(tiny: bool):
    from transformers import DeepseekV3Config

    if tiny:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "test"))
        from tiny_models import tiny_deepseek_v3_config

        return tiny_deepseek_v3_config()
    return DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=128, num_key_value_heads=128,
        n_routed_experts=16, num_experts_per_tok=8, n_group=8, topk_group=4, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=8192,
    )  # fmt: skip


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=ENGINES, required=True, help="the multi-GPU engine")
    parser.add_argument("--impl", choices=("native", "liger-dspine"), required=True, help="unpatched or patched")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    parser.add_argument("--seq", type=int, default=4096, help="tokens per row (default 4096)")
    parser.add_argument("--rows", type=int, default=1, help="rows per data-parallel group and step (default 1)")
    parser.add_argument("--tiny", action="store_true", help="CPU, gloo, fp32, a tiny model: checks the script")
    parser.add_argument("--out", required=True, help="folder for <engine>_<impl>.json")
    args = parser.parse_args(argv)

    if args.tiny:
        os.environ.setdefault("LIGER_DSPINE_INTERPRET", "1")
        args.seq = min(args.seq, 6)
    import liger_dspine

    device = "cpu" if args.tiny else "cuda"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if args.engine == "zero3":
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    dist.init_process_group("gloo" if args.tiny else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.float32 if args.tiny else torch.bfloat16
    sizes, data_groups = layout(args.engine, world)
    config = model_config(args.tiny)

    from transformers import DeepseekV3ForCausalLM

    folder = os.path.join(tempfile.gettempdir(), f"multi_gpu_model_{'tiny' if args.tiny else 'v3'}")
    if rank == 0 and not os.path.exists(os.path.join(folder, "config.json")):
        torch.manual_seed(0)
        DeepseekV3ForCausalLM(config).to(dtype).save_pretrained(folder)
    dist.barrier()
    if args.impl == "liger-dspine":
        liger_dspine.apply_liger_kernel_to_deepseek_v3()
    kwargs = {"dtype": dtype}
    if sizes is not None:
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(**sizes)
    model = DeepseekV3ForCausalLM.from_pretrained(folder, **kwargs).train()
    if sizes is None:
        model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    if args.engine == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif args.engine == "zero3":
        import deepspeed

        ds_config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": args.rows}
        ds_config["bf16"] = {"enabled": dtype == torch.bfloat16}
        model, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

    group = rank * data_groups // world
    generator = torch.Generator().manual_seed(1234)
    losses, start = [], None
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (data_groups * args.rows, args.seq), generator=generator)
        ids = ids[group * args.rows : (group + 1) * args.rows].to(device)
        out = model(input_ids=ids, labels=ids)
        if args.engine == "zero3":
            model.backward(out.loss)
            model.step()
        else:
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        loss = out.loss.detach().float().clone()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
        if step == 0:
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = (args.steps - 1) * data_groups * args.rows * args.seq
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")])
    peaks = [torch.zeros_like(peak) for _ in range(world)]
    dist.all_gather(peaks, peak)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        result = {
            "engine": args.engine, "impl": args.impl, "ranks": world, "seq": args.seq, "losses": losses,
            "tokens_per_s": tokens / elapsed if elapsed > 0 and args.steps > 1 else None,
            "peak_gib_per_rank": [p.item() for p in peaks],
        }  # fmt: skip
        with open(os.path.join(args.out, f"{args.engine}_{args.impl}.json"), "w") as f:
            json.dump(result, f)
        print(json.dumps({k: v for k, v in result.items() if k != "losses"}), "final loss", losses[-1], flush=True)
    # Gloo's worker threads can hold finished work (with its tensors) of the engines' subgroups; a rank that frees
    # them during interpreter shutdown aborts. Free them now, and tear the groups down only once every rank is here.
    del model, optimizer, out
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Everything is written and every group torn down: skip the interpreter's finalisation, where a gloo thread that
    # outlives its group can take the process down (std::terminate) after a successful run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
