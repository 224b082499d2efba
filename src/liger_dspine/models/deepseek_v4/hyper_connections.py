"""DeepSeek-V4's decoder layer with its hyper-connections (mHC) in liger-kernel's mHC kernels.

Each V4 layer mixes its ``hc_mult`` residual streams twice (around the attention and around the MoE block), and each
mix is, per token: the weights from the RMS-normed flattened streams times ``fn`` (plus ``base``, times ``scale``):
``pre = sigmoid(.) + eps``, ``post = 2 sigmoid(.)``, ``comb`` a softmax followed by Sinkhorn normalisations; the
block's input ``sum_j pre_j x_j``; and the new streams ``post_k f + sum_j comb[j, k] x_j``. transformers runs that as
dozens of small torch kernels per mix (every Sinkhorn iteration a few launches) over fp32 copies of the streams.

liger-kernel 0.8.5's mHC functions compute the same three steps in fused Triton kernels, with the same Sinkhorn (a
row softmax plus eps, then column and row normalisations with eps in the denominators), so its coefficient matrix
equals V4's ``comb``; its residual mix reads the matrix as [out, in] where V4 reads [in, out], so the layer hands it
``comb`` transposed. The coefficients' projection takes the streams in their dtype and ``fn`` in fp32 (Triton's fp32
products run in TF32 on a GPU; transformers' fp32 ``F.linear`` does not). Under ``torch.compile`` (liger-kernel's
mHC functions are no registered ops) and where the kernels cannot run, the layer runs the native forward.
"""

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer

from liger_dspine._interpreter import kernel_runs_on


def _coefficients(connection, streams: torch.Tensor):
    """(pre [..., hc], post [..., hc], comb [..., hc, hc]) of one ``DeepseekV4HyperConnection`` for ``streams``."""
    from liger_kernel.transformers.functional import liger_mhc_coeffs

    scale = connection.scale
    return liger_mhc_coeffs(
        streams,
        connection.fn.t(),
        connection.base,
        scale[0],
        scale[1],
        scale[2],
        allow_fp32=True,
        tmax=connection.hc_sinkhorn_iters,
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
        from liger_kernel.ops.mhc import _mhc_mm_norm_fwd_kernel

        return not torch.compiler.is_compiling() and kernel_runs_on(hidden_states, _mhc_mm_norm_fwd_kernel)
