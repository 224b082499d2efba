"""Tiny DeepSeek-V3 configurations and helpers shared by the tests (CPU-sized: the interpreter is slow)."""

import contextlib
import functools
import importlib

import torch
from transformers import DeepseekV3Config

MODELING_MODULE = "transformers.models.deepseek_v3.modeling_deepseek_v3"
IGNORE_INDEX = -100


def tiny_deepseek_v3_config(**overrides) -> DeepseekV3Config:
    """2 layers (1 dense + 1 MoE), MLA with q_lora_rank, 4 routed experts top-2 in 2 groups, 1 shared expert.

    Every tiny DeepSeek-V3 of the tests and of the benchmark's ``--tiny`` run is this one with overrides.
    ``attn_implementation=None`` leaves the choice to transformers (sdpa where available).
    """
    values = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=1.0,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    values.update(overrides)
    config = DeepseekV3Config(**values)
    if values["attn_implementation"] is not None:
        config._attn_implementation = values["attn_implementation"]
    return config


def tiny_attention_config(q_lora_rank, attn_implementation="eager", rope_interleave=True) -> DeepseekV3Config:
    """The tiny model for the attention tests: value heads (12) wider than the key heads' rope part (8), vocab 64,
    routed scaling 2.5; ``q_lora_rank=None`` projects the queries directly."""
    return tiny_deepseek_v3_config(
        vocab_size=64,
        q_lora_rank=q_lora_rank,
        v_head_dim=12,
        routed_scaling_factor=2.5,
        max_position_embeddings=64,
        rope_interleave=rope_interleave,
        attention_dropout=0.0,
        attn_implementation=attn_implementation,
    )


YARN_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def tiny_rope_config(rope_dim: int, yarn: bool = False) -> DeepseekV3Config:
    """The tiny attention model with ``rope_dim`` rotated dimensions per head, default or YaRN RoPE (factor 4 over
    16 original positions)."""
    rope = YARN_ROPE if yarn else {"rope_type": "default", "rope_theta": 10000.0}
    return tiny_deepseek_v3_config(
        vocab_size=64,
        qk_rope_head_dim=rope_dim,
        v_head_dim=12,
        max_position_embeddings=64,
        rope_parameters=dict(rope),
    )


def tiny_router_config(
    num_experts: int,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    hidden_size: int = 32,
) -> DeepseekV3Config:
    """The tiny model with the router's settings replaced (the router tests' expert counts and groups)."""
    return tiny_deepseek_v3_config(
        hidden_size=hidden_size,
        n_routed_experts=num_experts,
        num_experts_per_tok=top_k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm_topk_prob,
        routed_scaling_factor=routed_scaling_factor,
    )


def build_model(config, seed: int = 0, dtype=torch.float32, device="cpu"):
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).to(device=device, dtype=dtype)
    with torch.no_grad():  # a non-zero router bias makes the group choice depend on it
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0.0, 0.1)
    return model


def random_batch(config, batch: int = 2, seq: int = 8, seed: int = 1, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=generator).to(device)
    return input_ids, input_ids.clone()


def labels_with_ignored(input_ids: torch.Tensor, every: int = 3) -> torch.Tensor:
    """``input_ids`` as labels with every ``every``-th position set to the ignore index."""
    labels = input_ids.clone()
    labels[:, ::every] = IGNORE_INDEX
    return labels


def modeling_module():
    return importlib.import_module(MODELING_MODULE)


def native_experts_class():
    """``DeepseekV3Experts`` (``DeepseekV3NaiveMoe`` in transformers 5.8)."""
    module = modeling_module()
    return getattr(module, "DeepseekV3Experts", None) or module.DeepseekV3NaiveMoe


@functools.cache
def _native_classes() -> tuple[type, ...]:
    """The classes transformers' DeepSeek-V3 modeling module defines (captured once, before any class patch)."""
    assert_transformers_native()
    module = modeling_module()
    return tuple(v for v in vars(module).values() if isinstance(v, type) and v.__module__ == MODELING_MODULE)


def snapshot_modeling_globals() -> dict:
    """Every global of transformers' DeepSeek-V3 modeling module, and every attribute of the classes it defines
    (keys ``"Class.attribute"``, e.g. ``"DeepseekV3ForCausalLM.forward"``)."""
    classes = _native_classes()
    snapshot = dict(vars(modeling_module()))
    for cls in classes:
        snapshot.update({f"{cls.__name__}.{name}": value for name, value in vars(cls).items()})
    return snapshot


def changed_modeling_globals(before: dict) -> list[str]:
    """Names whose object is not the same (identity) as in ``before``: globals added or removed included, class
    attributes added left out (transformers caches values on its classes, e.g. ``..._cached_value``)."""
    after = snapshot_modeling_globals()
    missing = object()
    names = set(before) | {name for name in after if "." not in name}
    return sorted(name for name in names if before.get(name, missing) is not after.get(name, missing))


def assert_transformers_native() -> None:
    module = modeling_module()
    for name in ("DeepseekV3RMSNorm", "DeepseekV3MLP"):
        assert getattr(module, name).__module__ == MODELING_MODULE, f"{name} is patched at class level"
    assert native_experts_class().__module__ == MODELING_MODULE
    assert module.DeepseekV3ForCausalLM.forward.__module__ == MODELING_MODULE


@contextlib.contextmanager
def class_patches_reverted():
    """Run a block that may patch transformers at class level; afterwards revert and check every global is back."""
    from liger_dspine import revert_liger_kernel_to_deepseek_v3

    assert_transformers_native()
    before = snapshot_modeling_globals()
    try:
        yield before
    finally:
        revert_liger_kernel_to_deepseek_v3()
        changed = changed_modeling_globals(before)
        assert not changed, f"globals of {MODELING_MODULE} not restored: {changed}"


def module_types(model: torch.nn.Module) -> dict[str, type]:
    return {name: type(module) for name, module in model.named_modules()}


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameter name -> gradient (a clone; zeros where the parameter got none)."""
    return {
        name: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for name, p in model.named_parameters()
    }


def loss_and_grads(model: torch.nn.Module, *args, **kwargs):
    """One forward with ``model.zero_grad()`` before and ``loss.backward()`` after: (output, grads)."""
    model.zero_grad(set_to_none=True)
    output = model(*args, **kwargs)
    output.loss.backward()
    return output, grads_of(model)


def train_on_batches(model: torch.nn.Module, batches, steps: int, optimizer) -> torch.Tensor:
    """``steps`` training steps (language-model loss, the batch as its own labels) cycling through ``batches``: the
    losses as an fp32 tensor."""
    model.train()
    losses = []
    for step in range(steps):
        input_ids = batches[step % len(batches)]
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
    return torch.stack(losses)


def assert_grads_close(actual: dict, expected: dict, atol: float, rtol: float) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


SDPA_FUNCTIONS = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)


def exporting_while_compiling(monkeypatch) -> None:
    """transformers' exporting check (5.24 and later) answers as torch 2.11's dynamo makes it answer: True while
    compiling. Older transformers have no such check and build the mask under compile anyway."""
    import transformers.masking_utils as masking_utils

    monkeypatch.setattr(masking_utils, "is_torchdynamo_exporting", torch.compiler.is_compiling, raising=False)


def compiled_sdpa_step(model, *args, fullgraph: bool = True, **kwargs):
    """One compiled training step: (output, grads, [(attn_mask is None, is_causal) of each sdpa call in the graph
    dynamo captured]); the graph runs as captured."""
    calls = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in SDPA_FUNCTIONS:
                mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
                calls.append((mask is None, bool(node.kwargs.get("is_causal", False))))
        return gm.forward

    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    out = torch.compile(model, backend=backend, fullgraph=fullgraph)(*args, **kwargs)
    out.loss.backward()
    return out, grads_of(model), calls
