"""Tiny configurations of the models built from DeepSeek-V3's classes, and what each patch must replace.

Each model: 2 layers (a dense MLP then a MoE layer where the model has MoE), the widths of the tiny DeepSeek-V3
(``tiny_models.py``), 4 routed experts top-2 with 1 shared expert. A model missing from the installed transformers
is skipped by the tests that use it (``FamilyCase.modeling_or_skip``).
"""

import importlib
import importlib.util
from dataclasses import dataclass
from dataclasses import field
from dataclasses import replace

import pytest
import torch
import transformers
from packaging.version import Version

MLA = dict(
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    rope_interleave=True,
)
MOE = dict(
    moe_intermediate_size=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    norm_topk_prob=True,
    routed_scaling_factor=1.5,
)
COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


V2_MLA = {key: value for key, value in MLA.items() if key != "rope_interleave"}
SOFTMAX_MOE = dict(
    moe_intermediate_size=16,
    n_routed_experts=6,
    num_experts_per_tok=2,
    n_group=3,
    topk_group=2,
    n_shared_experts=1,
    routed_scaling_factor=1.5,
)


MISTRAL4_ROPE = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=2.0,
    original_max_position_embeddings=4,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale_all_dim=1.0,
    mscale=1.0,
    llama_4_scaling_beta=0.1,
    partial_rotary_factor=0.5,
)


MISTRAL4_TEXT = {**COMMON, **MLA, **SOFTMAX_MOE, "first_k_dense_replace": 1, "rope_parameters": MISTRAL4_ROPE}
MISTRAL3_VISION = dict(
    hidden_size=16, intermediate_size=16, num_attention_heads=2, num_hidden_layers=1, head_dim=8, image_size=16,
    patch_size=4,
)  # fmt: skip


DSA = dict(
    **{key: value for key, value in MLA.items() if key != "rope_interleave"},  # always interleaved
    **MOE,
    index_topk=4,
    index_head_dim=16,
    index_n_heads=2,
)
KIMI_VISION = dict(
    hidden_size=16,
    intermediate_size=16,
    num_attention_heads=2,
    num_hidden_layers=1,
    pos_emb_height=4,
    pos_emb_width=4,
)


# DeepSeek-V4: one layer of each attention kind and router kind (hash, then learned), 2 hyper-connection streams;
# a SwiGLU limit below the tiny model's gate / up magnitudes, so that the clamps bite; the auxiliary loss on.
V4 = dict(
    vocab_size=96,
    hidden_size=32,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    q_lora_rank=16,
    partial_rotary_factor=0.5,
    num_experts_per_tok=2,
    n_routed_experts=4,
    n_shared_experts=1,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
    mlp_layer_types=["hash_moe", "moe", "moe"],
    hc_mult=2,
    hc_sinkhorn_iters=3,
    swiglu_limit=0.05,
    sliding_window=4,
    o_groups=2,
    o_lora_rank=8,
    index_n_heads=2,
    index_head_dim=8,  # below the fused indexer kernel's 16: the scorer runs native here (test_indexer_scores.py)
    index_topk=2,
    max_position_embeddings=128,
    output_router_logits=True,
    router_aux_loss_coef=0.1,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


# Ergo: a dense ReLU² layer, then a MoE layer (ReLU² experts with a norm each, a sigmoid top-2 router of one group)
# with full attention (no RoPE, logits scaled by global_attention_scale); the first layer's window of 4 bites at 8
# tokens.
ERGO = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    first_dense_intermediate_size=48,
    num_dense_blocks=1,
    moe_intermediate_size=16,
    shared_intermediate_size=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_routed_scaling_factor=1.5,
    sliding_window=4,
    global_attention_every_n_layers=2,
    global_attention_scale=2.0,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


@dataclass(frozen=True)
class FamilyCase:
    model_type: str
    prefix: str
    config_values: dict
    swapped: tuple[str, ...]  # the native classes and methods the spec replaces
    mla: bool = True
    moe: bool = True
    swiglu: bool = True  # its MLPs are SwiGLU (LigerSwiGLUMLP); Ergo's are ReLU² without a gate
    extra: dict = field(default_factory=dict)
    forwards: str = "liger_dspine.modules.causal_lm_forward"  # the module of the loss forwards the spec binds
    # a multimodal model whose text model comes from another modeling module (Kimi K2.5: DeepSeek-V3's)
    causal_lm: str = ""  # default <prefix>ForCausalLM
    base: str = ""  # the class an instance patch needs; default <prefix>PreTrainedModel
    text_modeling: str = ""  # the modeling module of the text model's classes, when not the model's own
    decoder: str = "model"  # the path of the decoder (its .layers) in the causal LM
    liger_modules: tuple[str, ...] = ()  # where the Liger<Native> classes live; default models/<type>/modules.py
    native_kept: tuple[str, ...] = ()  # classes named like a swapped kind that no Liger module computes
    # gradients so ill-conditioned that native fp32 itself is off from fp64 by about 1e-3 (DeepSeek-V4's Sinkhorn
    # hyper-connection head): the patched run is held to an fp64 native run instead (see assert_trains_as_native)
    fp64_reference: bool = False
    min_transformers: str = ""  # the oldest transformers the patch supports, where older ones have the model
    # options that the tests' patch turns on besides the defaults (swaps off by default); the swapped list includes
    # what they swap
    apply_options: dict = field(default_factory=dict)
    opt_in: tuple[str, ...] = ()  # the swapped classes that only those options swap
    swapped_since: dict = field(default_factory=dict)  # swapped classes a default patch replaces from that version
    # swapped names whose option is off by default and that the tests' patch leaves off (Ergo's ce_forward, tested
    # in its own file): the family tests expect them native
    default_off: tuple[str, ...] = ()
    # the modeling module, where the model type has none of its own (param2moe builds GLM-4.5's classes)
    modeling: str = ""

    @property
    def swapped_here(self) -> tuple[str, ...]:
        """The swapped names a default patch replaces in the installed transformers."""
        installed = Version(transformers.__version__)
        return tuple(
            n
            for n in self.swapped
            if Version(self.swapped_since.get(n, "0")) <= installed and n not in self.default_off
        )

    def lce_forward(self):
        """The function the tests' patch binds as the causal LM's forward: ``lce_forward`` of ``forwards``, or the
        native forward where that swap is off by default."""
        if f"{self.causal_lm_name}.forward" in self.default_off:
            return getattr(self.modeling_or_skip(), self.causal_lm_name).forward
        return getattr(importlib.import_module(self.forwards), "lce_forward")

    @property
    def modeling_name(self) -> str:
        return self.modeling or f"transformers.models.{self.model_type}.modeling_{self.model_type}"

    @property
    def modeling_names(self) -> tuple[str, ...]:
        """Every modeling module whose classes the patch replaces: the model's own first."""
        return (self.modeling_name, self.text_modeling) if self.text_modeling else (self.modeling_name,)

    @property
    def causal_lm_name(self) -> str:
        return self.causal_lm or f"{self.prefix}ForCausalLM"

    @property
    def base_name(self) -> str:
        return self.base or f"{self.prefix}PreTrainedModel"

    @property
    def liger_module_names(self) -> tuple[str, ...]:
        return self.liger_modules or (f"liger_dspine.models.{self.model_type}.modules",)

    def decoder_of(self, model):
        return model.get_submodule(self.decoder)

    @property
    def vocab_size(self) -> int:
        return self.config().get_text_config(decoder=True).vocab_size

    def modeling_or_skip(self):
        if self.min_transformers and Version(transformers.__version__) < Version(self.min_transformers):
            pytest.skip(f"the {self.model_type} patch needs transformers >= {self.min_transformers}")
        if self.modeling and importlib.util.find_spec(f"transformers.models.{self.model_type}") is None:
            pytest.skip(f"this transformers has no {self.model_type}")  # its modeling module is another model's
        try:
            return importlib.import_module(self.modeling_name)
        except ModuleNotFoundError:
            pytest.skip(f"this transformers has no {self.model_type}")

    def config(self, **overrides):
        from transformers import AutoConfig

        self.modeling_or_skip()

        values = {**self.config_values, **overrides}
        config = AutoConfig.for_model(self.model_type, **values)
        config._attn_implementation = "eager"
        return config

    def build(self, seed: int = 0, **overrides):
        modeling = self.modeling_or_skip()
        torch.manual_seed(seed)
        model = getattr(modeling, self.causal_lm_name)(self.config(**overrides)).float()
        with torch.no_grad():  # a non-zero router bias makes the group choice depend on it
            for module in model.modules():
                if hasattr(module, "e_score_correction_bias"):
                    module.e_score_correction_bias.normal_(0.0, 0.1)
                if hasattr(module, "tid2eid"):  # DeepSeek-V4's hash router: distinct experts per token (not all 0)
                    vocab, top_k = module.tid2eid.shape
                    experts = module.weight.shape[0]
                    module.tid2eid.copy_(torch.stack([torch.randperm(experts)[:top_k] for _ in range(vocab)]))
        return model

    def apply_fn(self):
        import functools

        import liger_dspine

        return functools.partial(
            getattr(liger_dspine, f"apply_liger_kernel_to_{self.model_type}"), **self.apply_options
        )

    def revert_fn(self):
        import liger_dspine

        return getattr(liger_dspine, f"revert_liger_kernel_to_{self.model_type}")


def own_no_split_lists(modeling) -> dict[type, object]:
    """The classes a modeling module defines with a ``_no_split_modules`` of their own, with that list."""
    return {
        cls: vars(cls)["_no_split_modules"]
        for cls in vars(modeling).values()
        if isinstance(cls, type) and cls.__module__ == modeling.__name__ and "_no_split_modules" in vars(cls)
    }


def _moe_swaps(prefix: str) -> tuple[str, ...]:
    return (f"{prefix}Experts", f"{prefix}TopkRouter", f"{prefix}MoE.route_tokens_to_experts")


def _case(model_type, prefix, values, mla=True, moe=True) -> FamilyCase:
    swapped = [f"{prefix}RMSNorm", f"{prefix}MLP"]
    if moe:
        swapped.append(f"{prefix}Experts")
    if mla:
        swapped.append(f"{prefix}Attention")
    if moe:
        swapped += [f"{prefix}TopkRouter", f"{prefix}MoE.route_tokens_to_experts"]
    swapped.append(f"{prefix}ForCausalLM.forward")
    return FamilyCase(model_type, prefix, values, tuple(swapped), mla, moe)


def _swapped(prefix, moe_block=None, routes_in_block=False) -> tuple[str, ...]:
    """What a spec of ``models/deepseek_v2/spec.py`` replaces; with ``routes_in_block``, the MoE block's routing
    method too (DeepSeek-V2 before transformers 5.17, Mistral-Small-4 before 5.13)."""
    moe = (f"{prefix}Experts",) if moe_block else ()
    router = (f"{prefix}TopkRouter",) if moe_block else ()
    if routes_in_block:
        router += (f"{moe_block}.route_tokens_to_experts",)
    return (f"{prefix}RMSNorm", f"{prefix}MLP", *moe, f"{prefix}Attention", *router, f"{prefix}ForCausalLM.forward")


CASES = {
    case.model_type: case
    for case in (
        _case("glm4_moe_lite", "Glm4MoeLite", {**COMMON, **MLA, **MOE, "mlp_layer_types": ["dense", "sparse"]}),
        # A.X-K1 always has a q_lora_rank; its MoE layers end in a post_mlp_layernorm
        _case("axk1", "AXK1", {**COMMON, **MLA, **MOE, "mlp_layer_types": ["dense", "sparse"]}),
        # dense: MLA with a Qwen3-like MLP, no router or experts
        _case("youtu", "Youtu", {**COMMON, **MLA}, moe=False),
        # GQA attention (2 key-value heads, q/k norms, partial RoPE) stays native
        _case(
            "glm4_moe",
            "Glm4Moe",
            {**COMMON, **MOE, "num_key_value_heads": 2, "first_k_dense_replace": 1, "use_qk_norm": True},
            mla=False,
        ),
        _case("dots1", "Dots1", {**COMMON, **MOE, "num_key_value_heads": 2, "first_k_dense_replace": 1}, mla=False),
        # DeepSeek-V3's MLPs, experts and grouped router (logits in fp32 under autocast too); its gated GQA attention
        # stays native
        _case(
            "minicpm5_moe",
            "MiniCPM5Moe",
            {**COMMON, **MOE, "num_key_value_heads": 2, "head_dim": 8, "mlp_layer_types": ["dense", "sparse"]},
            mla=False,
        ),
        # a config that builds Glm4MoeForCausalLM (full-head RoPE, q/k norms native to GLM-4.5), with a tied head
        replace(
            _case(
                "param2moe",
                "Glm4Moe",
                {
                    **COMMON,
                    **MOE,
                    "num_key_value_heads": 2,
                    "head_dim": 8,
                    "first_k_dense_replace": 1,
                    "use_qk_norm": True,
                    "tie_word_embeddings": True,
                },
                mla=False,
            ),
            modeling="transformers.models.glm4_moe.modeling_glm4_moe",
            liger_modules=("liger_dspine.models.glm4_moe.modules",),
        ),
        # norms (fp32 weights, "gemma" casting) and the router; ReLU² MLPs and experts, attention and head native;
        # the ce_forward loss (cross_entropy=True) is tested in family/test_ergo.py
        FamilyCase(
            "ergo",
            "Ergo",
            ERGO,
            ("ErgoRMSNorm", "ErgoTopkRouter", "ErgoForCausalLM.forward"),
            mla=False,
            swiglu=False,
            native_kept=("ErgoMLP", "ErgoExperts"),
            default_off=("ErgoForCausalLM.forward",),
            # each branch's output is normalised again (post-attention / post-feedforward norms): those small outputs'
            # norms amplify fp32 rounding over the SGD steps, about 10x in two steps native against native (only
            # the experts' summation order changed), so each step is held to the fp64 run's weights
            fp64_reference=True,
        ),
        # softmax router, greedy (the group-max selection is swept in ops/test_moe_router_softmax.py, against the
        # router class of transformers >= 5.17); RoPE turning pairs in place
        FamilyCase(
            "deepseek_v2",
            "DeepseekV2",
            {**COMMON, **V2_MLA, **SOFTMAX_MOE, "topk_method": "greedy", "first_k_dense_replace": 1},
            _swapped("DeepseekV2", moe_block="DeepseekV2Moe", routes_in_block=True),
        ),
        # dense MLA with half-split RoPE; scaled embeddings, residuals and head input (hidden / 4 before lm_head)
        FamilyCase(
            "minicpm3",
            "MiniCPM3",
            {**COMMON, **V2_MLA, "scale_emb": 12, "scale_depth": 1.4, "dim_model_base": 8},
            _swapped("MiniCPM3"),
            moe=False,
            forwards="liger_dspine.models.minicpm3.forward",
        ),
        # DSA: the indexer keeps 4 of up to 8 keys per query, so its sparse mask changes the attention; the MLA
        # attention takes the Liger forward from transformers 5.24 (latents in the cache), the indexer's scores run
        # in the fused kernel
        FamilyCase(
            "deepseek_v32",
            "DeepseekV32",
            {**COMMON, **DSA, "first_k_dense_replace": 1},
            _case("deepseek_v32", "DeepseekV32", {}).swapped + ("DeepseekV32Indexer",),
            liger_modules=("liger_dspine.models.deepseek_v32.modules", "liger_dspine.models.deepseek_v32.indexer"),
            swapped_since={"DeepseekV32Attention": "5.24"},
        ),
        # as DeepSeek-V3.2 (interleaved RoPE in the indexer); the second layer reuses the first layer's top-k ("shared"
        # indexer type), which the attention returns
        FamilyCase(
            "glm_moe_dsa",
            "GlmMoeDsa",
            {**COMMON, **DSA, "mlp_layer_types": ["dense", "sparse"], "indexer_types": ["full", "shared"]},
            _case("glm_moe_dsa", "GlmMoeDsa", {}).swapped + ("GlmMoeDsaIndexer",),
            liger_modules=("liger_dspine.models.glm_moe_dsa.modules", "liger_dspine.models.glm_moe_dsa.indexer"),
            swapped_since={"GlmMoeDsaAttention": "5.24"},
        ),
        # multimodal: DeepSeek-V3's text model under a vision tower (kept native, GELU MLPs); text-only batches
        FamilyCase(
            "kimi_k25",
            "DeepseekV3",
            {
                "text_config": {**COMMON, **MLA, **MOE, "first_k_dense_replace": 1},
                "vision_config": KIMI_VISION,
                "projection_hidden_size": KIMI_VISION["hidden_size"],
                "tie_word_embeddings": False,
            },
            _case("kimi_k25", "DeepseekV3", {}).swapped[:-1] + ("Kimi_K25ForConditionalGeneration.forward",),
            forwards="liger_dspine.models.kimi_k25.forward",
            causal_lm="Kimi_K25ForConditionalGeneration",
            base="Kimi_K25PreTrainedModel",
            text_modeling="transformers.models.deepseek_v3.modeling_deepseek_v3",
            decoder="model.language_model",
            liger_modules=("liger_dspine.models.deepseek_v3.attention", "liger_dspine.models.deepseek_v3.router"),
            native_kept=("Kimi_K25VisionMLP",),
        ),
        # clamped MLPs and experts, norms, the learned and hash routers, the attention (opt-in), loss with the aux
        # loss; RoPE, compressors and hyper-connections native
        FamilyCase(
            "deepseek_v4",
            "DeepseekV4",
            V4,
            (
                "DeepseekV4RMSNorm",
                "DeepseekV4MLP",
                "DeepseekV4Experts",
                "DeepseekV4TopKRouter",
                "DeepseekV4HashRouter",
                "DeepseekV4Attention",
                "DeepseekV4DecoderLayer",
                "DeepseekV4HyperHead",
                "DeepseekV4IndexerScorer",
                "DeepseekV4ForCausalLM.forward",
            ),
            mla=False,
            forwards="liger_dspine.models.deepseek_v4.forward",
            liger_modules=(
                "liger_dspine.models.deepseek_v4.modules",
                "liger_dspine.models.deepseek_v4.router",
                "liger_dspine.models.deepseek_v4.attention",
                "liger_dspine.models.deepseek_v4.hyper_connections",
                "liger_dspine.models.deepseek_v4.indexer",
            ),
            native_kept=("DeepseekV4UnweightedRMSNorm",),
            fp64_reference=True,
            min_transformers="5.17",
        ),
        # softmax router with top-2 group scores, 6 experts in 3 groups, no bias; interleaved RoPE and Llama-4's query
        # scale, which past position 4 differs from 1 here
        FamilyCase(
            "mistral4",
            "Mistral4",
            MISTRAL4_TEXT,
            _swapped("Mistral4", moe_block="Mistral4MoE", routes_in_block=True),
        ),
        # Mistral-Small-4 as its checkpoints load: a mistral4 text model under a Pixtral vision tower (kept native)
        # and a projector with an RMSNorm; text-only batches
        FamilyCase(
            "mistral3",
            "Mistral4",
            {
                "text_config": {"model_type": "mistral4", **MISTRAL4_TEXT},
                "vision_config": MISTRAL3_VISION,
                "spatial_merge_size": 1,
                "tie_word_embeddings": False,
            },
            ("Mistral3RMSNorm",)
            + _swapped("Mistral4", moe_block="Mistral4MoE", routes_in_block=True)[:-1]
            + ("Mistral3ForConditionalGeneration.forward",),
            forwards="liger_dspine.models.mistral3.forward",
            causal_lm="Mistral3ForConditionalGeneration",
            base="Mistral3PreTrainedModel",
            text_modeling="transformers.models.mistral4.modeling_mistral4",
            decoder="model.language_model",
            liger_modules=("liger_dspine.models.mistral4.modules",),
        ),
    )
}
