"""Under torch.compile, the causal-LM forwards embed the input ids themselves (``ops/embedding.py``).

Inductor computes an embedding table's gradient over a zeroed fp32 copy of the table (see ``ops/embedding.py``);
the op there runs torch's eager kernel instead. The causal-LM forward passes ``inputs_embeds`` to the base model in
place of ``input_ids`` only where that changes nothing else:

- the base model's ``forward`` reads ``input_ids`` only to check it against ``inputs_embeds`` and to call
  ``self.embed_tokens(input_ids)`` (read from its source once per class; DeepSeek-V4 also routes by token id, and a
  multimodal model looks for image tokens, so both keep their ids);
- ``embed_tokens`` is a plain ``nn.Embedding`` (no scaling subclass, no ``max_norm``, dense gradient) with a plain
  weight, no hooks and no forward of its own (FSDP, ZeRO-3, accelerate's offloading, adapters and
  ``enable_input_require_grads`` keep the module call).

Eager code is left as it is: torch's kernel is what ``nn.Embedding`` runs there already.
"""

import ast
import functools
import inspect
import textwrap

import torch
import torch.nn as nn
from torch.nn.modules import module as module_globals

from liger_dspine.modules.config_reading import has_module_hooks
from liger_dspine.ops.embedding import liger_embedding


def compiled_input_embeddings(causal_lm: nn.Module, input_ids, inputs_embeds):
    """``(input_ids, inputs_embeds)`` for ``causal_lm.model``: ``(None, embeddings)`` when compiling and the model
    only embeds the ids with a plain embedding (see the module), else as given."""
    if not torch.compiler.is_compiling() or input_ids is None or inputs_embeds is not None:
        return input_ids, inputs_embeds
    base = getattr(causal_lm, "model", None)
    embed = getattr(base, "embed_tokens", None)
    if base is None or not _plain_embedding(embed) or not _only_embeds_ids(type(base)):
        return input_ids, inputs_embeds
    return None, liger_embedding(input_ids, embed.weight, embed.padding_idx, embed.scale_grad_by_freq)


def _plain_embedding(embed) -> bool:
    if type(embed) is not nn.Embedding or embed.max_norm is not None or embed.sparse:
        return False
    if "forward" in vars(embed):
        return False  # a forward set on the instance (accelerate's offloading hooks load the weight in it)
    if type(embed.weight) is not nn.Parameter:
        return False  # a DTensor (tensor or FSDP2 sharding) or another tensor subclass
    global_hooks = (module_globals._global_forward_hooks, module_globals._global_forward_pre_hooks)
    return not has_module_hooks(embed) and not any(global_hooks)


@torch._dynamo.assume_constant_result
def _only_embeds_ids(base_class: type) -> bool:
    return _reads_ids_only_to_embed(base_class)


@functools.cache
def _reads_ids_only_to_embed(base_class: type) -> bool:
    """Whether ``base_class.forward`` uses ``input_ids`` only in ``... input_ids is None ...`` tests and as the one
    argument of ``self.embed_tokens(input_ids)`` (which it calls once)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(base_class.forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    embeds = 0
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Name) and node.id == "input_ids" and isinstance(node.ctx, ast.Load)):
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Compare) and _is_none_test(parent):
            continue
        if isinstance(parent, ast.Call) and _is_embed_call(parent):
            embeds += 1
            continue
        return False
    return embeds == 1


def _is_none_test(compare: ast.Compare) -> bool:
    return all(isinstance(op, (ast.Is, ast.IsNot)) for op in compare.ops) and all(
        isinstance(value, ast.Constant) and value.value is None for value in compare.comparators
    )


def _is_embed_call(call: ast.Call) -> bool:
    func = call.func
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "embed_tokens"
        and isinstance(func.value, ast.Name)
        and func.value.id == "self"
        and len(call.args) == 1
        and not call.keywords
    )
