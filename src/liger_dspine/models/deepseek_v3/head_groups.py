"""MLA from the latents to ``o_proj``'s output, run by groups of heads.

Heads of MLA are independent from the up-projections on (``q_b_proj`` / ``kv_b_proj`` rows of one head feed only
that head, and ``o_proj`` columns read only its output), so both passes can walk the heads a group at a time:

- forward: each group's query, key, value and attention output; the outputs go into one ``[B, S, H, V]`` buffer
  that ``o_proj`` multiplies once and that is freed at once (``o_proj``'s input is not kept);
- backward: per group, the group's columns of ``d_out = d_y @ W_o``, the ``o_proj`` weight gradient of those
  columns and the backward of the group. The latents' gradients add up over groups in fp32; each weight gradient
  row (or column) belongs to one group and is written once.

Two modes:

- ``recompute=True`` (the opt-in ``recompute_attention``): the forward builds no graph and keeps only the latents;
  the backward runs each group's forward again with autograd on. Nothing per head is kept between the passes.
- ``recompute=False`` (the default attention at long sequences): each group's graph is kept from the forward, so
  the per-head tensors are kept as usual, but the backward's gradients of the query, key, value and of the
  ``kv_b_proj`` output exist for one group at a time instead of for every head at once.

At DeepSeek-V3 widths a layer's query, key, value and output take 1.25 KiB per token and head (20 GiB at 131072
tokens for 128 heads), and their gradients as much again in the backward.
"""

import torch

from liger_dspine.ops.first_order import first_order_only

# Per-head bytes (query, key, value, output) one group may hold, by mode; the group is the largest power-of-two
# head count under it (at least one head). Kept graphs use larger groups: only the backward's transients shrink.
RECOMPUTE_GROUP_BYTES = 256 * 2**20
KEPT_GROUP_BYTES = 2 * 2**30


def heads_per_group(num_heads: int, tokens: int, per_token_head_bytes: int, budget: int) -> int:
    fit = max(1, budget // max(1, tokens * per_token_head_bytes))
    return min(num_heads, 1 << (fit.bit_length() - 1))


class _Group:
    """One head group: its head range, its weight rows, and (once run with autograd) its output and leaves."""

    def __init__(self, start, end, widths):
        _, q_width, kv_width, v_width = widths
        self.heads = slice(start, end)
        self.q_rows = slice(start * q_width, end * q_width)
        self.kv_rows = slice(start * kv_width, end * kv_width)
        self.o_columns = slice(start * v_width, end * v_width)
        self.out = self.rows = None

    def run(self, run_group, leaves, q_weight, kv_weight, needs):
        """Forward of the group with autograd on, from detached leaves (``needs``: which of the five inputs need a
        gradient); returns the output and keeps the graph."""
        rows = [q_weight.detach()[self.q_rows], kv_weight.detach()[self.kv_rows]]
        self.rows = [w.requires_grad_(need) for w, need in zip(rows, needs[3:5])]
        with torch.enable_grad():
            self.out = run_group(*leaves, *self.rows)
        return self.out


def _leaves(latents, needs):
    return [t.detach().requires_grad_(need) for t, need in zip(latents, needs)]


class LigerHeadGroupedAttentionFunction(torch.autograd.Function):
    """``run_group(q_latent, kv_latent, k_rot, q_rows, kv_rows) -> [B, S, g, V]`` runs the heads whose weight rows
    it is given; this op returns ``o_proj(concat over groups) [B, S, hidden]``.

    ``head_widths`` = (heads, query rows per head, key/value rows per head, value width); ``group`` heads at a time.
    """

    kernel_ops = ()  # its kernels are those of ``run_group`` (custom ops); torch ops otherwise

    @staticmethod
    def forward(
        ctx, run_group, head_widths, group, recompute, q_latent, kv_latent, k_rot, q_weight, kv_weight, o_weight
    ):
        num_heads, _, _, v_width = head_widths
        needs = ctx.needs_input_grad[4:]
        groups = [_Group(start, min(start + group, num_heads), head_widths) for start in range(0, num_heads, group)]
        latents = (q_latent, kv_latent, k_rot)
        leaves = None if recompute else _leaves(latents, needs)
        out = None
        for part in groups:
            if recompute:
                out_group = run_group(q_latent, kv_latent, k_rot, q_weight[part.q_rows], kv_weight[part.kv_rows])
            else:
                out_group = part.run(run_group, leaves, q_weight, kv_weight, needs).detach()
            if out is None:
                out = out_group.new_empty(*out_group.shape[:2], num_heads, v_width)
            out[:, :, part.heads] = out_group
            del out_group
        ctx.save_for_backward(q_latent, kv_latent, k_rot, q_weight, kv_weight, o_weight)
        ctx.run_group, ctx.groups, ctx.leaves, ctx.head_widths = run_group, groups, leaves, head_widths
        device_type = q_latent.device.type
        ctx.autocast = (device_type, torch.get_autocast_dtype(device_type), torch.is_autocast_enabled(device_type))
        return torch.nn.functional.linear(out.flatten(2), o_weight)

    @staticmethod
    @first_order_only
    def backward(ctx, grad_y):
        device_type, dtype, enabled = ctx.autocast
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):  # a recompute casts as the forward did
            return (None,) * 4 + LigerHeadGroupedAttentionFunction._backward(ctx, grad_y)

    @staticmethod
    def _backward(ctx, grad_y):
        if ctx.groups is None:
            raise RuntimeError(
                "liger-dspine: backward through head-grouped MLA a second time; its per-group graphs were freed by "
                "the first backward (retain_graph=True does not keep them)"
            )
        q_latent, kv_latent, k_rot, q_weight, kv_weight, o_weight = ctx.saved_tensors
        needs = ctx.needs_input_grad[4:]
        grad_y_rows = grad_y.reshape(-1, grad_y.shape[-1])

        # fp32 sums of the latents' gradients over the groups; each weight gradient slice is written once
        latents = (q_latent, kv_latent, k_rot)
        latent_grads = [torch.zeros_like(t, dtype=torch.float32) if need else None for t, need in zip(latents, needs)]
        q_grad, kv_grad = [torch.empty_like(w) if need else None for w, need in zip((q_weight, kv_weight), needs[3:5])]
        o_grad = torch.empty_like(o_weight) if needs[5] else None

        leaves = ctx.leaves or _leaves(latents, needs)
        groups = list(ctx.groups)
        if ctx.leaves is not None:
            ctx.groups = None  # kept graphs: each group's is freed once its backward ran
        while groups:
            part = groups.pop(0)
            out_group, part.out = part.out, None
            if out_group is None:  # recompute
                out_group = part.run(ctx.run_group, leaves, q_weight, kv_weight, needs)
                part.out = None
            if o_grad is not None:
                o_grad[:, part.o_columns] = grad_y_rows.t() @ out_group.detach().reshape(grad_y_rows.shape[0], -1)
            inputs = [t for t in leaves + part.rows if t.requires_grad]
            if not inputs:
                continue
            # the group's slice of d_out = d_y @ W_o, one group at a time (the whole is [B, S, H * V])
            grad_out = torch.matmul(grad_y, o_weight[:, part.o_columns]).view(out_group.shape)
            grads = iter(torch.autograd.grad(out_group, inputs, grad_out))
            del grad_out, out_group
            for i, leaf in enumerate(leaves):
                if leaf.requires_grad:
                    latent_grads[i] += next(grads)
            for weight_grad, row, rows in zip((q_grad, kv_grad), part.rows, (part.q_rows, part.kv_rows)):
                if row.requires_grad:
                    weight_grad[rows] = next(grads)
        latent_grads = [g if g is None else g.to(t.dtype) for g, t in zip(latent_grads, latents)]
        return (*latent_grads, q_grad, kv_grad, o_grad)


# torch.compile runs it as it is (a graph break on each side): its backward runs autograd over per-group graphs.
@torch.compiler.disable
def liger_head_grouped_attention(
    run_group, head_widths, group, recompute, q_latent, kv_latent, k_rot, q_weight, kv_weight, o_weight
) -> torch.Tensor:
    """:class:`LigerHeadGroupedAttentionFunction` outside any ``torch.compile`` graph; arguments as its ``forward``."""
    return LigerHeadGroupedAttentionFunction.apply(
        run_group, head_widths, group, recompute, q_latent, kv_latent, k_rot, q_weight, kv_weight, o_weight
    )
