"""Arguments of ``liger-dspine train-drafter``, the ``--tiny`` preset and their checks."""

import argparse
import importlib.util
import json
import os

# A CPU-sized run: the demo's tiny DeepSeek-V3 target (hidden 64, byte vocabulary) and a 2-layer drafter.
TINY = dict(
    target_config="tiny",
    seq_len=32,
    batch_size=2,
    num_anchors=8,
    steps=40,
    lr=3e-3,
    block_size=4,
    drafter_heads=2,
    drafter_kv_heads=1,
    drafter_head_dim=32,
    drafter_intermediate_size=128,
    transfer_rank=16,
    message_size=8,
    top_k=4,
    target_layer_ids="0,1",
    dtype="float32",
)
# The MLA sizes of an MLA drafter (--drafter-<name>), SpecForge's config fields.
MLA_OPTIONS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# Defaults of a full-size run (where --tiny does not set them).
DEFAULTS = dict(
    seq_len=2048,
    batch_size=1,
    num_anchors=512,
    steps=1000,
    lr=6e-4,
    block_size=16,
    transfer_rank=1024,
    message_size=512,
    top_k=16,
    drafter_layers=2,
    alignment_warmup_steps=0,
    dtype="auto",
)
# Defaults that depend on the target or on other options, as ``--help`` states them.
DERIVED_DEFAULTS = dict(
    target_layers="the config's",
    dataset="the embedded demo text, as bytes",
    tokenizer="the --target folder",
    drafter_config="built from the sizes below",
    drafter_heads="hidden size / head width",
    drafter_kv_heads="a quarter of the heads",
    drafter_head_dim="min(128, hidden size / 2)",
    drafter_intermediate_size="2 x hidden size",
    transfer_rank="1024, cut to min(hidden size, vocabulary - 1)",
    top_k="16, cut to the vocabulary",
    target_layer_ids="spread over the target's layers",
    mask_token_id="the drafter config's; 0 with the embedded text; required with --dataset",
    **{f"drafter_{name}": "the target's, when it has MLA" for name in MLA_OPTIONS},
)
# Optional packages of --report-to (pip install 'liger-dspine[<name>]').
REPORT_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
# The drafter's sizes: --drafter-config fixes them all, so none may be given with it.
DRAFTER_SIZE_OPTIONS = (
    "drafter_layers",
    "block_size",
    "drafter_heads",
    "drafter_kv_heads",
    "drafter_head_dim",
    "drafter_intermediate_size",
    "transfer_rank",
    "message_size",
    "top_k",
    "target_layer_ids",
    "alignment_warmup_steps",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target (frozen)")
    target.add_argument("--target", help="a causal LM checkpoint folder")
    target.add_argument(
        "--target-config", help="random weights from a config: 'tiny' (the demo's DeepSeek-V3) or a config.json"
    )
    target.add_argument("--target-layers", type=int, help="override num_hidden_layers of --target-config")
    data = parser.add_argument_group("data")
    data.add_argument(
        "--dataset",
        help="JSONL: a list of token ids, {'input_ids': [...], 'loss_mask': [0/1, ...]} or {'messages': [...]} (needs "
        "--tokenizer, or a --target folder with one) per line",
    )
    data.add_argument("--tokenizer", help="tokenizer folder for chat messages")
    data.add_argument("--seq-len", type=int, help="tokens per packed row")
    data.add_argument("--batch-size", type=int, help="rows per micro-batch and rank")
    drafter = parser.add_argument_group("drafter")
    drafter.add_argument(
        "--drafter-config",
        help="a DSpine drafter config file (SpecForge's layout), or a folder holding its config.json",
    )
    drafter.add_argument("--drafter-layers", type=int, help="drafter layers")
    drafter.add_argument("--block-size", type=int, help="tokens per draft block, its anchor included")
    drafter.add_argument("--drafter-heads", type=int, help="attention heads")
    drafter.add_argument("--drafter-kv-heads", type=int, help="key-value heads")
    drafter.add_argument("--drafter-head-dim", type=int, help="head width")
    drafter.add_argument("--drafter-intermediate-size", type=int, help="MLP width")
    drafter.add_argument(
        "--drafter-attention",
        choices=("gqa", "mla"),
        default="gqa",
        help="gqa: grouped-query attention; mla: SpecForge's MLA draft attention",
    )
    drafter.add_argument("--drafter-q-lora-rank", type=int, help="MLA query rank (0: a direct q_proj)")
    drafter.add_argument("--drafter-kv-lora-rank", type=int, help="MLA key-value latent rank")
    drafter.add_argument("--drafter-qk-nope-head-dim", type=int, help="MLA query / key columns without RoPE")
    drafter.add_argument("--drafter-qk-rope-head-dim", type=int, help="MLA query / key columns with RoPE")
    drafter.add_argument("--drafter-v-head-dim", type=int, help="MLA value head width")
    drafter.add_argument("--transfer-rank", type=int, help="rank of the transfer space of the target's head")
    drafter.add_argument("--message-size", type=int, help="width of the messages between block positions")
    drafter.add_argument("--top-k", type=int, help="candidates of the refinement term")
    drafter.add_argument("--target-layer-ids", help="comma-separated target layers to tap, e.g. 0,1,2,3")
    drafter.add_argument(
        "--mask-token-id",
        type=int,
        help="the token id of the drafter's proposal slots; it must never be in the data (a dataset line holding it "
        "is an error)",
    )
    drafter.add_argument(
        "--alignment-warmup-steps", type=int, help="steps of the alignment weight's ramp (SpecForge: 146)"
    )
    drafter.add_argument("--num-anchors", type=int, help="blocks drawn per row at most")
    optim = parser.add_argument_group("optimisation")
    optim.add_argument("--accumulation-steps", type=int, default=1, help="micro-batches per optimizer step")
    optim.add_argument("--lr", type=float, help="AdamW peak learning rate")
    optim.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    optim.add_argument("--warmup-steps", type=int, default=0, help="steps of the learning rate's linear warm-up")
    optim.add_argument(
        "--schedule", choices=("cosine", "linear", "constant"), default="cosine", help="learning rate after warm-up"
    )
    optim.add_argument("--max-grad-norm", type=float, default=1.0, help="0 disables clipping")
    optim.add_argument("--steps", type=int, help="optimizer steps")
    run = parser.add_argument_group("run")
    run.add_argument("--output-dir", default="dspine-drafter", help="folder of the checkpoint-STEP folders")
    run.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    run.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --output-dir")
    run.add_argument(
        "--liger", action=argparse.BooleanOptionalAction, default=True, help="Liger kernels and the fused objective"
    )
    run.add_argument(
        "--drafter-parallel",
        choices=("ddp", "fsdp"),
        default="ddp",
        help="under torchrun: ddp replicates the drafter; fsdp shards it with FSDP2 (fully_shard)",
    )
    run.add_argument(
        "--target-parallel",
        choices=("replicate", "fsdp", "tp"),
        default="replicate",
        help="under torchrun: replicate keeps the frozen target whole on every rank; fsdp shards it with FSDP2 per "
        "decoder layer; tp loads --target with transformers' tensor-parallel plan (tp_plan='auto')",
    )
    run.add_argument("--tiny", action="store_true", help="a CPU-sized run (tiny target and drafter)")
    run.add_argument("--seed", type=int, default=0, help="seed of the weights, the data order and the anchors")
    run.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), help="auto: bfloat16 on CUDA, else float32")
    run.add_argument("--metrics-csv", help="append one row of metrics per step to this CSV")
    run.add_argument(
        "--report-to",
        choices=("none", "tensorboard", "wandb"),
        default="none",
        help="log each step's metrics there too (an optional package: pip install 'liger-dspine[tensorboard]')",
    )
    from liger_dspine.drafter_training import offline_taps
    from liger_dspine.drafter_training import training_eval

    training_eval.add_arguments(parser)
    offline_taps.add_arguments(data)


def fail(message: str):
    raise ValueError(f"liger-dspine: {message}")


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the preset's and the defaults' values, parse the lists, and check everything that needs no model.
    Resolving resolved arguments returns them as they are."""
    if getattr(args, "resolved", False):
        return args
    preset = TINY if args.tiny else {}
    args.given = frozenset(key for key in vars(args) if key != "given" and getattr(args, key) is not None)
    if args.drafter_config:
        sizes = [name for name in DRAFTER_SIZE_OPTIONS if name in args.given]
        if sizes:
            fail(
                f"--drafter-config fixes the drafter's sizes: leave out --{sizes[0].replace('_', '-')} (edit the "
                "config instead)"
            )
    for key, value in {**DEFAULTS, **preset}.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.target and args.target_config:
        fail("give --target or --target-config, not both")
    if not args.target and not args.target_config:
        fail("train-drafter needs a target: --target FOLDER, --target-config tiny|CONFIG.json, or --tiny")
    if args.target and not os.path.isdir(args.target):
        fail(f"--target {args.target!r} is not a folder")
    if args.target_config and args.target_config != "tiny" and not os.path.isfile(args.target_config):
        fail(f"--target-config {args.target_config!r} is neither 'tiny' nor a config file")
    if args.dataset is not None and not os.path.isfile(args.dataset):
        fail(f"--dataset {args.dataset!r} is not a file")
    drafter_config = args.drafter_config
    if drafter_config is not None and not os.path.isfile(drafter_config):
        if not os.path.isdir(drafter_config):
            fail(f"--drafter-config {drafter_config!r} is neither a config file nor a folder")
        if not os.path.isfile(os.path.join(drafter_config, "config.json")):
            fail(f"--drafter-config {drafter_config!r} is a folder without a config.json")
    positive = (
        "steps",
        "seq_len",
        "batch_size",
        "accumulation_steps",
        "num_anchors",
        "drafter_layers",
        "target_layers",
    )
    for name in positive:
        value = getattr(args, name)
        if value is not None and value < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    for name in ("save_every", "warmup_steps", "alignment_warmup_steps", "weight_decay", "max_grad_norm"):
        if getattr(args, name) < 0:
            fail(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not args.lr > 0:
        fail(f"--lr must be > 0, got {args.lr}")
    if args.warmup_steps > args.steps:
        fail(f"--warmup-steps {args.warmup_steps} exceeds --steps {args.steps}")
    if args.block_size < 2:
        fail(f"--block-size must be >= 2 (an anchor and a proposal), got {args.block_size}")
    if args.seq_len < args.block_size:
        fail(f"--seq-len {args.seq_len} is shorter than a block ({args.block_size})")
    mla_options = [name for name in MLA_OPTIONS if getattr(args, f"drafter_{name}") is not None]
    if mla_options and args.drafter_attention != "mla":
        fail(f"--drafter-{mla_options[0].replace('_', '-')} needs --drafter-attention mla")
    if args.drafter_config and args.drafter_attention == "mla":
        fail("--drafter-attention mla builds the drafter from sizes: give it or --drafter-config, not both")
    if args.dataset is not None and args.mask_token_id is None and not _config_names_mask_token(drafter_config):
        fail(
            "a --dataset needs --mask-token-id (a token id never in the data)"
            + (f"; {drafter_config!r} names none" if drafter_config else "")
        )
    report_to = getattr(args, "report_to", "none")
    package = REPORT_PACKAGES.get(report_to)
    if package and importlib.util.find_spec(package) is None:
        fail(f"--report-to {report_to} needs the {package} package: pip install 'liger-dspine[{report_to}]'")
    if isinstance(args.target_layer_ids, str):
        try:
            args.target_layer_ids = [int(i) for i in args.target_layer_ids.split(",")]
        except ValueError:
            fail(f"--target-layer-ids must be comma-separated integers, got {args.target_layer_ids!r}")
    from liger_dspine.drafter_training import offline_taps
    from liger_dspine.drafter_training import parallel
    from liger_dspine.drafter_training import training_eval

    training_eval.check_arguments(args)
    offline_taps.check_arguments(args)
    parallel.check_arguments(args)
    args.resolved = True
    return args


def _config_names_mask_token(drafter_config: str | None) -> bool:
    """Whether a drafter config file (or a folder's config.json) names a ``mask_token_id``, read without building it;
    an unreadable one counts as naming it: building the drafter config then says what is wrong with it."""
    if drafter_config is None:
        return False
    path = drafter_config if os.path.isfile(drafter_config) else os.path.join(drafter_config, "config.json")
    try:
        with open(path) as file:
            config = json.load(file)
    except (OSError, ValueError):
        return True
    if not isinstance(config, dict):
        return True
    dflash = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    return dflash.get("mask_token_id", config.get("mask_token_id")) is not None
