"""DeepSeek-V4's decoder layer and final stream collapse with their hyper-connections (mHC) in Triton kernels.

Each V4 layer mixes its ``hc_mult`` residual streams twice (around the attention and around the MoE block), and each
mix is, per token: the weights from the RMS-normed flattened streams times ``fn`` (plus ``base``, times ``scale``):
``pre = sigmoid(.) + eps``, ``post = 2 sigmoid(.)``, ``comb`` a softmax followed by Sinkhorn normalisations; the
block's input ``sum_j pre_j x_j``; and the new streams ``post_k f + sum_j comb[j, k] x_j``. transformers runs that as
dozens of small torch kernels per mix (every Sinkhorn iteration a few launches) over fp32 copies of the streams.

Here each step is one of this package's kernels, all with the token count as a run-time value (one compilation per
model, where liger-kernel 0.8.5's mHC kernels compile again for each new token count): the coefficients' projection
and RMS factor (ops/mhc_projection.py: fp32 products as transformers', no fp32 copy of the streams), the split,
sigmoids and Sinkhorn iterations (ops/mhc_coefficients.py, V4's order of normalisations), and the collapse and the
residual mix (ops/mhc_streams.py, fp32 sums). Under ``torch.compile``, where the kernels cannot run, and where a
hyper-connection module carries a forward or hooks of its own (accelerate's offload hooks of ``device_map="auto"``,
which load its weights only when it is called), the layer runs the native forward, with a warning for the last.
"""

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead

from liger_dspine import patching
from liger_dspine._interpreter import kernel_runs_on
from liger_dspine.ops.mhc_coefficients import liger_mhc_coefficients
from liger_dspine.ops.mhc_projection import liger_mhc_projection
from liger_dspine.ops.mhc_streams import liger_mhc_collapse
from liger_dspine.ops.mhc_streams import liger_mhc_mix
from liger_dspine.transformers_compat import norm_epsilon


def _coefficients(connection, streams: torch.Tensor):
    """(pre [..., hc], post [..., hc], comb [..., hc, hc]) of one ``DeepseekV4HyperConnection`` for ``streams``."""
    return liger_mhc_coefficients(
        streams,
        connection.fn,
        connection.base,
        connection.scale,
        connection.hc_sinkhorn_iters,
        rms_eps=norm_epsilon(connection.input_norm),
        pre_eps=connection.hc_eps,
        sinkhorn_eps=connection.hc_eps,
        post_mult=2.0,
    )


def _mix(streams: torch.Tensor, block, connection, norm, **kwargs) -> torch.Tensor:
    """The new streams around one block: collapse, norm, block, expand and mix."""
    pre, post, comb = _coefficients(connection, streams)
    output = block(norm(liger_mhc_collapse(streams, pre)), **kwargs)
    if isinstance(output, tuple):  # the attention returns (output, weights)
        output = output[0]
    return liger_mhc_mix(streams, output, post, comb)


class LigerDeepseekV4DecoderLayer(DeepseekV4DecoderLayer):
    """V4 decoder layer whose two hyper-connection mixes run in this package's mHC kernels; parameters and
    submodules as the native class."""

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        if not self._liger_applies(hidden_states):
            return super().forward(hidden_states, input_ids=input_ids, **kwargs)
        streams = _mix(hidden_states, self.self_attn, self.attn_hc, self.input_layernorm, **kwargs)
        return _mix(streams, self.mlp, self.ffn_hc, self.post_attention_layernorm, input_ids=input_ids)

    def _liger_applies(self, hidden_states: torch.Tensor) -> bool:
        if not _kernels_apply(hidden_states):
            return False
        hooked = [name for name in ("attn_hc", "ffn_hc") if _runs_its_own_call(getattr(self, name))]
        if hooked:
            patching.warn_kept_native(
                "DeepseekV4DecoderLayer's hyper-connections (for LigerDeepseekV4DecoderLayer)",
                f"{' and '.join(hooked)} carry a forward or hooks of their own (accelerate's offload hooks load "
                "weights only when the module is called), which the mHC kernels would bypass",
            )
            return False
        return True


def _runs_its_own_call(module: torch.nn.Module) -> bool:
    return "forward" in vars(module) or bool(module._forward_pre_hooks or module._forward_hooks)


class LigerDeepseekV4HyperHead(DeepseekV4HyperHead):
    """V4's final collapse of the streams, ``sum_j pre_j x_j`` with ``pre = sigmoid(scale * rms(x) @ hc_fn^T +
    hc_base) + eps``: the projection in this package's kernel (no fp32 copy of the streams, which transformers' keeps
    for backward), the collapse in the mHC collapse kernel; parameters as the native class."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _kernels_apply(x):
            return super().forward(x)
        hc, width = x.shape[-2], x.shape[-2] * x.shape[-1]
        mix, _ = liger_mhc_projection(x.reshape(-1, width), self.hc_fn, norm_epsilon(self.input_norm))
        pre = torch.sigmoid(mix * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return liger_mhc_collapse(x, pre.view(*x.shape[:-2], hc))


def _kernels_apply(hidden_states: torch.Tensor) -> bool:
    from liger_dspine.ops.mhc_projection import _mhc_projection_forward_kernel

    return not torch.compiler.is_compiling() and kernel_runs_on(hidden_states, _mhc_projection_forward_kernel)
