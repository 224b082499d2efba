"""The default patch under transformers' expert parallelism (``DistributedConfig(ep_size=2)``, its all-to-all and
all-reduce dispatch) on two gloo ranks, against one unpatched process on the same batch.

The two ranks form one group that holds the same batch (``tp_size=2`` with an empty tensor-parallel plan), each rank
holding half of the routed experts; the loss and every gathered gradient must equal the single process's on every
rank. The patch is applied at class level before loading, and on the sharded model, and the Liger experts must run
under the dispatch in both cases (their calls are counted). fp32; 1e-5 covers the reordered reductions.
"""

import pytest
import torch

from one_process_reference import FP32
from one_process_reference import assert_matches
from one_process_reference import batch
from one_process_reference import gathered_grads
from one_process_reference import saved_reference
from spawned_ranks import run_on_gloo_ranks
from tiny_models import tiny_deepseek_v3_config

pytest.importorskip("transformers.distributed.expert_parallel", reason="transformers' expert parallelism")
pytestmark = pytest.mark.slow  # spawned gloo ranks loading a model each: a minute or more
SCENARIOS = [(order, impl) for order in ("class", "instance") for impl in ("all_to_all", "all_reduce")]


def _batch(config):
    return batch(config, 2)


def _scenario(path, order, implementation):
    from transformers import DeepseekV3ForCausalLM
    from transformers.distributed import DistributedConfig

    import liger_dspine
    from liger_dspine.modules import grouped_experts

    calls = []
    kernel = grouped_experts.liger_grouped_experts
    grouped_experts.liger_grouped_experts = lambda *a: calls.append(a[3].shape[0]) or kernel(*a)
    if order == "class":
        liger_dspine.apply_liger_kernel_to_deepseek_v3()
    try:
        layout = DistributedConfig(tp_size=2, tp_plan={}, ep_size=2, ep_implementation=implementation)
        model = DeepseekV3ForCausalLM.from_pretrained(path, distributed_config=layout, dtype=torch.float32).train()
        if order == "instance":
            liger_dspine.apply_liger_kernel_to_deepseek_v3(model=model)
        input_ids, labels = _batch(model.config)
        out = model(input_ids, labels=labels)
        out.loss.backward()
        grads = gathered_grads(model)
        return {"loss": out.loss.detach(), "grads": grads, "experts_per_call": calls}
    finally:
        grouped_experts.liger_grouped_experts = kernel
        liger_dspine.revert_liger_kernel_to_deepseek_v3()


def _rank(rank, world_size, path):
    import torch.distributed as dist

    results = {scenario: _scenario(path, *scenario) for scenario in SCENARIOS}
    gathered = [None] * world_size
    dist.all_gather_object(gathered, results)
    return gathered


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    return saved_reference(tmp_path_factory.mktemp("tiny_v3"), rows=2)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, saved_model):
    return run_on_gloo_ranks(tmp_path_factory.mktemp("ep"), 2, _rank, saved_model[0])


@pytest.mark.parametrize("scenario", SCENARIOS, ids=["-".join(s) for s in SCENARIOS])
def test_default_patch_under_expert_parallel_matches_one_process(ranks, saved_model, scenario):
    _, loss, grads = saved_model
    config = tiny_deepseek_v3_config()
    for rank_results in ranks:
        result = rank_results[scenario]
        # the Liger experts ran, once per MoE layer, on this rank's half of the experts
        moe_layers = config.num_hidden_layers - config.first_k_dense_replace
        assert result["experts_per_call"] == [config.n_routed_experts // 2] * moe_layers
        assert_matches(result, loss, grads)


def test_routes_to_other_ranks_experts_add_nothing():
    """Under the all-reduce dispatch a rank sees routes to other ranks' experts as the id ``num_local_experts`` with
    weight 0: the Liger experts give what transformers' own experts give for them (nothing), values and gradients."""
    import copy

    from liger_dspine.modules.grouped_experts import LigerGroupedExperts
    from tiny_models import native_experts_class

    config = tiny_deepseek_v3_config(n_routed_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    native = native_experts_class()(config)
    for weight in (native.gate_up_proj, native.down_proj):
        torch.nn.init.normal_(weight, std=0.2)
    native._is_expert_parallel = True
    liger = copy.deepcopy(native)
    LigerGroupedExperts.convert(liger)
    x = torch.randn(5, config.hidden_size)
    index = torch.tensor([[0, 4], [4, 4], [3, 1], [2, 4], [4, 0]])  # 4: another rank's expert
    weights = torch.rand(5, 2).masked_fill(index == 4, 0.0)
    outputs = []
    for module in (native, liger):
        xi, wi = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = module(xi, index, wi)
        out.backward(torch.ones_like(out))
        outputs.append((out, xi.grad, wi.grad, module.gate_up_proj.grad, module.down_proj.grad))
    for got, expected in zip(outputs[1], outputs[0]):
        torch.testing.assert_close(got, expected, **FP32)
    assert outputs[1][0][1].abs().max() == 0  # token 1 routes only to other ranks
