"""The frozen target, the drafter and its objective of a ``train-drafter`` run."""

import contextlib
import logging
from types import SimpleNamespace

import torch

logger = logging.getLogger(__name__)


def build_target(args, device, dtype):
    """The frozen causal LM: loaded from ``--target``, or random weights (seeded) from ``--target-config``.
    With ``--liger`` a model type this package patches is patched (instance level). ``--target-parallel`` shards it
    (``parallel``): a ``--target`` folder is then loaded onto the host, and each rank keeps its shards on ``device``."""
    from transformers import AutoConfig

    from liger_dspine.auto_model import causal_lm_class
    from liger_dspine.auto_model import causal_lm_from_config
    from liger_dspine.drafter_training import parallel

    sharding = getattr(args, "target_parallel", "replicate")
    if sharding == "tp":
        target = parallel.load_tensor_parallel_target(args.target, dtype)
    elif args.target:
        config = AutoConfig.from_pretrained(args.target)
        target = causal_lm_class(config).from_pretrained(args.target, dtype=dtype)
        target = target if sharding == "fsdp" else target.to(device)
    else:
        if args.target_config == "tiny":
            from liger_dspine.demo import demo_config

            config = demo_config()
        else:
            config = AutoConfig.from_pretrained(args.target_config)
        if args.target_layers is not None:
            config.num_hidden_layers = args.target_layers
            if hasattr(config, "layer_types") and config.layer_types is not None:
                config.layer_types = config.layer_types[: args.target_layers]
        torch.manual_seed(args.seed)
        with torch.device(device):
            target = causal_lm_from_config(config, dtype=dtype)
    target = target.eval().requires_grad_(False)
    if args.liger:
        _patch_target(target)
    if sharding == "fsdp":
        parallel.shard_target(target, parallel.target_mesh(device))
    return target


def _patch_target(target) -> None:
    from liger_dspine.registry import apply_liger_kernel_to_instance

    try:
        report = apply_liger_kernel_to_instance(target)
    except ValueError as error:  # a model type this package does not patch: it runs natively
        logger.info("target left native: %s", error)
        return
    logger.info("target patched:\n%s", report)


def drafter_config(args, target):
    """From ``--drafter-config`` or the sizes; hidden size, vocabulary and depth of the target are filled in."""
    from liger_dspine.models.dspine import DSpineDraftConfig
    from liger_dspine.models.dspine import build_target_layer_ids

    hidden, vocab = target.config.hidden_size, target.config.vocab_size
    target_layers = target.config.num_hidden_layers
    if args.drafter_config:
        config = DSpineDraftConfig.from_pretrained(args.drafter_config)  # this file, or a folder's config.json
        if (config.hidden_size, config.vocab_size) != (hidden, vocab):
            raise ValueError(
                f"liger-dspine: the drafter config's hidden_size / vocab_size {(config.hidden_size, config.vocab_size)}"
                f" differ from the target's {(hidden, vocab)}"
            )
        if args.mask_token_id is not None or config.mask_token_id is None:
            config.dflash_config = {**config.dflash_config, "mask_token_id": mask_token_id(args, config)}
        return config
    layers = args.drafter_layers
    head_dim = args.drafter_head_dim or min(128, hidden // 2)
    heads = args.drafter_heads or max(1, hidden // head_dim)
    kv_heads = args.drafter_kv_heads or max(1, heads // 4)
    taps = args.target_layer_ids or build_target_layer_ids(target_layers, layers)
    if any(not 0 <= i < target_layers for i in taps):
        if args.target_layer_ids:
            raise ValueError(f"liger-dspine: --target-layer-ids {taps} must lie in [0, {target_layers})")
        raise ValueError(
            f"liger-dspine: the default taps of a {layers}-layer drafter, {taps}, do not fit a {target_layers}-layer "
            "target: give --target-layer-ids"
        )
    if heads % kv_heads and args.drafter_attention != "mla":
        raise ValueError(f"liger-dspine: --drafter-heads {heads} is not a multiple of --drafter-kv-heads {kv_heads}")
    mla_fields, mla_dflash = mla_options(args, target.config) if args.drafter_attention == "mla" else ({}, {})
    return DSpineDraftConfig(
        **mla_fields,
        hidden_size=hidden,
        intermediate_size=args.drafter_intermediate_size or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        max_position_embeddings=max(args.seq_len, getattr(target.config, "max_position_embeddings", 0) or 0),
        block_size=args.block_size,
        num_target_layers=target_layers,
        dflash_config={"mask_token_id": mask_token_id(args, None), "target_layer_ids": list(taps), **mla_dflash},
        dspine_config={
            "transfer_rank": fitted(args, "transfer_rank", min(hidden, vocab - 1)),
            "message_size": args.message_size,
            "top_k": fitted(args, "top_k", vocab),
            "alignment_warmup_steps": args.alignment_warmup_steps,
        },
    )


def fitted(args, name: str, bound: int) -> int:
    """A default cut to ``bound`` (what the target allows); a value the command line gave is kept as given, so the
    drafter config names it if it is too large."""
    value = getattr(args, name)
    return value if name in getattr(args, "given", ()) else min(value, bound)


def mla_options(args, target_config) -> tuple[dict, dict]:
    """The MLA fields of ``--drafter-attention mla`` (top level, ``dflash_config``): each ``--drafter-<field>``, else
    the target's own value when the target has MLA (``kv_lora_rank``); the RoPE layout follows the target's
    ``rope_interleave`` (SpecForge's default, interleaved, without one)."""
    from liger_dspine.drafter_training.options import MLA_OPTIONS
    from liger_dspine.models.dspine.mla_config import mla_settings

    target_has_mla = getattr(target_config, "kv_lora_rank", None) is not None
    fields = {}
    for name in MLA_OPTIONS:
        value = getattr(args, f"drafter_{name}")
        if value is None and target_has_mla:
            value = getattr(target_config, name, None)
        elif value is None and name != "q_lora_rank":
            raise ValueError(
                f"liger-dspine: --drafter-attention mla needs --drafter-{name.replace('_', '-')} (the target has no "
                "MLA sizes to take it from)"
            )
        fields[name] = None if value == 0 and name == "q_lora_rank" else value
    interleaved = getattr(target_config, "rope_interleave", None)
    dflash = {"attention_mode": "mla", "mla_rope_interleaved": True if interleaved is None else bool(interleaved)}
    try:  # a size the drafter config refuses is an argument error
        mla_settings(SimpleNamespace(**fields, dflash_config=dflash))
    except ValueError as error:
        raise ValueError(f"liger-dspine: {error}") from None
    return fields, dflash


def mask_token_id(args, config) -> int:
    if args.mask_token_id is not None:
        return args.mask_token_id
    if config is not None and config.mask_token_id is not None:
        return config.mask_token_id
    if args.dataset is None:
        return 0  # the NUL byte, never in the embedded text
    raise ValueError("liger-dspine: a --dataset needs --mask-token-id (a token id never in the data)")


def build_objective(args, target, device, dtype):
    """The drafter (seeded, its transfer space from the target's head) in its objective; patched with ``--liger``."""
    from liger_dspine import apply_liger_kernel_to_dspine
    from liger_dspine.drafter_training import parallel
    from liger_dspine.models.dspine import DSpineDraftModel
    from liger_dspine.models.dspine import DSpineObjective

    config = drafter_config(args, target)
    torch.manual_seed(args.seed + 1)
    draft = DSpineDraftModel(config).to(device=device, dtype=dtype)
    head, embed = parallel.frozen_views(target)  # a sharded one read whole, gathered per use
    with head.gathered() if isinstance(head, parallel.WholeWeight) else contextlib.nullcontext():
        objective = DSpineObjective(draft, head, embed, num_anchors=args.num_anchors).train()
    if args.liger:
        apply_liger_kernel_to_dspine(model=objective)
    return objective
