"""DeepSeek-V4's decoder layer with its hyper-connections (mHC) in liger-kernel's mHC kernels.

Each V4 layer mixes its ``hc_mult`` residual streams twice (around the attention and around the MoE block), and each
mix is, per token: the weights from the RMS-normed flattened streams times ``fn`` (plus ``base``, times ``scale``):
``pre = sigmoid(.) + eps``, ``post = 2 sigmoid(.)``, ``comb`` a softmax followed by Sinkhorn normalisations; the
block's input ``sum_j pre_j x_j``; and the new streams ``post_k f + sum_j comb[j, k] x_j``. transformers runs that as
dozens of small torch kernels per mix (every Sinkhorn iteration a few launches) over fp32 copies of the streams.

Here the three steps run in Triton kernels: the coefficients' projection and RMS factor in this package's kernel
(ops/mhc_projection.py: fp32 products as transformers', no fp32 copy of the streams, and one compilation where
liger-kernel's takes about 70 s at V4's widths), the split, sigmoids and Sinkhorn iterations (a row softmax plus eps,
then column and row normalisations with eps in the denominators, so the matrix equals V4's ``comb``) and the
collapse and the residual mix in liger-kernel 0.8.5's mHC kernels. Its residual mix reads the matrix as [out, in]
where V4 reads [in, out], so the layer hands it ``comb`` transposed. liger-kernel's mHC kernels take the token count
as a compile-time constant: each new token count compiles them again (about 10 s at V4's widths). Under
``torch.compile`` (liger-kernel's mHC functions are no registered ops) and where the kernels cannot run, the layer
runs the native forward.
"""

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead

from liger_dspine._interpreter import kernel_runs_on
from liger_dspine.ops.mhc_coefficients import liger_mhc_coefficients
from liger_dspine.ops.mhc_projection import liger_mhc_projection


def _coefficients(connection, streams: torch.Tensor):
    """(pre [..., hc], post [..., hc], comb [..., hc, hc]) of one ``DeepseekV4HyperConnection`` for ``streams``."""
    return liger_mhc_coefficients(
        streams,
        connection.fn,
        connection.base,
        connection.scale,
        connection.hc_sinkhorn_iters,
        rms_eps=connection.input_norm.eps,
        pre_eps=connection.hc_eps,
        sinkhorn_eps=connection.hc_eps,
        post_mult=2.0,
    )


def _mix(streams: torch.Tensor, block, connection, norm, **kwargs) -> torch.Tensor:
    """The new streams around one block: collapse, norm, block, expand and mix."""
    from liger_kernel.transformers.functional import liger_mhc_post_res
    from liger_kernel.transformers.functional import liger_mhc_pre

    pre, post, comb = _coefficients(connection, streams)
    output = block(norm(liger_mhc_pre(streams, pre)), **kwargs)
    if isinstance(output, tuple):  # the attention returns (output, weights)
        output = output[0]
    return liger_mhc_post_res(streams, output, post, comb.transpose(-1, -2))


class LigerDeepseekV4DecoderLayer(DeepseekV4DecoderLayer):
    """V4 decoder layer whose two hyper-connection mixes run in liger-kernel's mHC kernels; parameters and
    submodules as the native class."""

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        if not self._liger_applies(hidden_states):
            return super().forward(hidden_states, input_ids=input_ids, **kwargs)
        streams = _mix(hidden_states, self.self_attn, self.attn_hc, self.input_layernorm, **kwargs)
        return _mix(streams, self.mlp, self.ffn_hc, self.post_attention_layernorm, input_ids=input_ids)

    @staticmethod
    def _liger_applies(hidden_states: torch.Tensor) -> bool:
        return _kernels_apply(hidden_states)


class LigerDeepseekV4HyperHead(DeepseekV4HyperHead):
    """V4's final collapse of the streams, ``sum_j pre_j x_j`` with ``pre = sigmoid(scale * rms(x) @ hc_fn^T +
    hc_base) + eps``: the projection in this package's kernel (no fp32 copy of the streams, which transformers' keeps
    for backward), the collapse in liger-kernel's; parameters as the native class."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _kernels_apply(x):
            return super().forward(x)
        from liger_kernel.transformers.functional import liger_mhc_pre

        hc, width = x.shape[-2], x.shape[-2] * x.shape[-1]
        mix, _ = liger_mhc_projection(x.reshape(-1, width), self.hc_fn, self.input_norm.eps)
        pre = torch.sigmoid(mix * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return liger_mhc_pre(x, pre.view(*x.shape[:-2], hc))


def _kernels_apply(hidden_states: torch.Tensor) -> bool:
    from liger_dspine.ops.mhc_projection import _mhc_projection_forward_kernel

    return not torch.compiler.is_compiling() and kernel_runs_on(hidden_states, _mhc_projection_forward_kernel)
