"""torch.compile of a patched DeepSeek-V3: the input embedding's gradient by torch's kernel, not inductor's scatter.

``modules/compiled_embedding.py``: under compile the causal-LM forward embeds the ids through ``ops/embedding.py``,
whose weight gradient is one opaque op (inductor would sum it into a zeroed fp32 copy of the table). The tests read
the backward graph AOTAutograd hands to the compiler, and compare the compiled loss and gradients with the native
eager model's. A hook or a forward set on the embedding, or a base model that reads its ids for more than the
embedding, keeps the module call.
"""

import copy

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from liger_dspine import apply_liger_kernel_to_deepseek_v3
from liger_dspine.modules.compiled_embedding import _reads_ids_only_to_embed
from tiny_models import assert_grads_close
from tiny_models import build_model
from tiny_models import grads_of
from tiny_models import labels_with_ignored
from tiny_models import loss_and_grads
from tiny_models import random_batch
from tiny_models import tiny_deepseek_v3_config

OPAQUE = "liger_dspine.embedding_weight_grad.default"
DECOMPOSABLE = "aten.embedding_dense_backward.default"


@pytest.fixture(scope="module")
def native_model():
    return build_model(tiny_deepseek_v3_config())


@pytest.fixture(scope="module")
def batch(native_model):
    input_ids, _ = random_batch(native_model.config, batch=2, seq=6, seed=5)
    return input_ids, labels_with_ignored(input_ids)


def compiled_step(model, *args, **kwargs):
    """(output, grads, the op names of the backward graph)."""
    backward_ops = set()

    def forward_compiler(gm, example_inputs):
        return make_boxed_func(gm.forward)

    def backward_compiler(gm, example_inputs):
        backward_ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler)
    out = torch.compile(model, backend=backend, fullgraph=True)(*args, **kwargs)
    out.loss.backward()
    grads = grads_of(model)
    return out, grads, backward_ops


@pytest.mark.slow  # dynamo and AOTAutograd over the interpreter's kernels
@pytest.mark.parametrize("hooked", [False, "hook", "forward"], ids=["plain", "hooked", "instance_forward"])
def test_compiled_embedding_gradient_is_torchs_kernel_with_the_native_numbers(native_model, batch, hooked):
    input_ids, labels = batch
    native, native_grads = loss_and_grads(copy.deepcopy(native_model).train(), input_ids, labels=labels)
    model = copy.deepcopy(native_model).train()
    apply_liger_kernel_to_deepseek_v3(model=model)
    seen = []
    embed = model.model.embed_tokens
    if hooked == "hook":  # a forward hook on the embedding must run, so the module is called
        embed.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    elif hooked == "forward":  # a forward set on the instance (accelerate's offloading) must run too
        native_forward = embed.forward

        def forward(ids):
            out = native_forward(ids)
            seen.append(out.shape)
            return out

        embed.forward = forward

    out, grads, backward_ops = compiled_step(model, input_ids, labels=labels)

    assert (OPAQUE in backward_ops, DECOMPOSABLE in backward_ops) == ((False, True) if hooked else (True, False))
    assert seen == ([input_ids.shape + (native_model.config.hidden_size,)] if hooked else [])
    torch.testing.assert_close(out.loss, native.loss, atol=1e-5, rtol=1e-5)
    assert_grads_close(grads, native_grads, atol=1e-5, rtol=1e-5)


class _EmbedsOnly(torch.nn.Module):
    def forward(self, input_ids=None, inputs_embeds=None, **kwargs):
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("exactly one")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        return inputs_embeds


class _RoutesByIds(torch.nn.Module):
    def forward(self, input_ids=None, inputs_embeds=None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        return self.layer(inputs_embeds, input_ids=input_ids)


class _EmbedsTwice(torch.nn.Module):
    def forward(self, input_ids=None, inputs_embeds=None, **kwargs):
        return self.embed_tokens(input_ids) + self.embed_tokens(input_ids)


def test_only_a_base_model_that_reads_its_ids_to_embed_them_gets_embeddings():
    assert _reads_ids_only_to_embed(_EmbedsOnly)
    assert not _reads_ids_only_to_embed(_RoutesByIds)
    assert not _reads_ids_only_to_embed(_EmbedsTwice)
    assert _reads_ids_only_to_embed(type(build_model(tiny_deepseek_v3_config()).model))
