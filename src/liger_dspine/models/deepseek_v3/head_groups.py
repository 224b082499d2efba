"""MLA from the latents to ``o_proj``'s output, keeping only the latents and recomputing by groups of heads.

The opt-in ``recompute_attention`` mode. Heads of MLA are independent from the up-projections on
(``q_b_proj`` / ``kv_b_proj`` rows of one head feed only that head, and ``o_proj`` columns read only its output), so
both passes walk the heads a group at a time:

- forward (no graph): each group's query, key, value and attention output, written into one ``[B, S, H, V]``
  buffer that ``o_proj`` multiplies once; nothing per head is kept, not even ``o_proj``'s input;
- backward: ``d_out = d_y @ W_o`` once, then per group the forward again with autograd on, the ``o_proj`` weight
  gradient of the group's columns, and the backward of the group. The latents' gradients add up over groups in
  fp32; each weight gradient row (or column) belongs to one group and is written once.

So the per-head tensors alive at any time are one group's (about ``_GROUP_BYTES``), not the layer's: at
DeepSeek-V3 widths a layer's query, key, value and output take 1.25 KiB per token and head, 20 GiB at 131072
tokens, and their gradients as much again in the backward.
"""

import torch

# Per-head bytes (query, key, value, output) one group may hold; the group is the largest power-of-two head count
# under it (at least one head).
_GROUP_BYTES = 256 * 2**20


def heads_per_group(num_heads: int, tokens: int, per_token_head_bytes: int) -> int:
    fit = max(1, _GROUP_BYTES // max(1, tokens * per_token_head_bytes))
    return min(num_heads, 1 << (fit.bit_length() - 1))


class HeadGroupedAttention(torch.autograd.Function):
    """``run_group(q_latent, kv_latent, k_rot, q_rows, kv_rows) -> [B, S, g, V]`` runs the heads whose weight rows
    it is given; this op returns ``o_proj(concat over groups) [B, S, hidden]``.

    ``head_widths`` = (heads, query rows per head, key/value rows per head, value width); ``group`` heads at a time.
    """

    @staticmethod
    def forward(ctx, run_group, head_widths, group, q_latent, kv_latent, k_rot, q_weight, kv_weight, o_weight):
        num_heads, q_width, kv_width, v_width = head_widths
        out = None
        for start in range(0, num_heads, group):
            end = min(start + group, num_heads)
            out_group = run_group(
                q_latent,
                kv_latent,
                k_rot,
                q_weight[start * q_width : end * q_width],
                kv_weight[start * kv_width : end * kv_width],
            )
            if out is None:
                out = out_group.new_empty(*out_group.shape[:2], num_heads, v_width)
            out[:, :, start:end] = out_group
            del out_group
        ctx.save_for_backward(q_latent, kv_latent, k_rot, q_weight, kv_weight, o_weight)
        ctx.run_group, ctx.head_widths, ctx.group = run_group, head_widths, group
        device_type = q_latent.device.type
        ctx.autocast = (device_type, torch.get_autocast_dtype(device_type), torch.is_autocast_enabled(device_type))
        return torch.nn.functional.linear(out.flatten(2), o_weight)

    @staticmethod
    def backward(ctx, grad_y):
        device_type, dtype, enabled = ctx.autocast
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):  # the recompute casts as the forward did
            return HeadGroupedAttention._backward(ctx, grad_y)

    @staticmethod
    def _backward(ctx, grad_y):
        q_latent, kv_latent, k_rot, q_weight, kv_weight, o_weight = ctx.saved_tensors
        num_heads, q_width, kv_width, v_width = ctx.head_widths
        needs = ctx.needs_input_grad[3:]
        batch, seq_len = grad_y.shape[:2]
        grad_out = torch.matmul(grad_y, o_weight).view(batch, seq_len, num_heads, v_width)
        grad_y_rows = grad_y.reshape(-1, grad_y.shape[-1])

        # fp32 sums of the latents' gradients over the groups; each weight gradient slice is written once
        latents = (q_latent, kv_latent, k_rot)
        latent_grads = [torch.zeros_like(t, dtype=torch.float32) if need else None for t, need in zip(latents, needs)]
        weight_grads = [torch.empty_like(w) if need else None for w, need in zip((q_weight, kv_weight), needs[3:5])]
        grad_o = torch.empty_like(o_weight) if needs[5] else None

        leaves = [t.detach().requires_grad_(need) for t, need in zip(latents, needs)]
        for start in range(0, num_heads, ctx.group):
            end = min(start + ctx.group, num_heads)
            q_rows, kv_rows = slice(start * q_width, end * q_width), slice(start * kv_width, end * kv_width)
            rows = [q_weight.detach()[q_rows], kv_weight.detach()[kv_rows]]
            rows = [w.requires_grad_(need) for w, need in zip(rows, needs[3:5])]
            with torch.enable_grad():
                out_group = ctx.run_group(*leaves, *rows)
            if grad_o is not None:
                grad_o[:, start * v_width : end * v_width] = grad_y_rows.t() @ out_group.detach().reshape(
                    grad_y_rows.shape[0], -1
                )
            inputs = [t for t in leaves + rows if t.requires_grad]
            if not inputs:
                continue
            grads = iter(torch.autograd.grad(out_group, inputs, grad_out[:, :, start:end]))
            del out_group
            for i, leaf in enumerate(leaves):
                if leaf.requires_grad:
                    latent_grads[i] += next(grads)
            for weight_grad, row, row_slice in zip(weight_grads, rows, (q_rows, kv_rows)):
                if row.requires_grad:
                    weight_grad[row_slice] = next(grads)
        latent_grads = [g if g is None else g.to(t.dtype) for g, t in zip(latent_grads, latents)]
        return None, None, None, *latent_grads, *weight_grads, grad_o
