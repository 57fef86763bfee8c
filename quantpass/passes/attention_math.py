"""The computations a rewritten graph calls in place of PyTorch's opaque attention ops.

`F.multi_head_attention_forward` (what Dynamo keeps of `nn.MultiheadAttention`),
`torch._transformer_encoder_layer_fwd` (`nn.TransformerEncoderLayer`'s eval fast path) and
`torch._native_multi_head_attention` run their projections inside one call, out of reach of a
linear site. `lower_attention.py` replaces such a call (found by `patterns/attention.py`) by one of
the functions here, which compute the same thing in eval mode (no dropout) with every projection a *slot*:

- `("dense", weight, bias)`: `F.linear`, as PyTorch does it;
- `("quantized", backend, device_type, differentiable, op_args)`: the quantized linear op a linear
  site would call, `op_args` being its arguments after the activation (weights, bias, keys...).

The packed input projection `in_proj_weight` [3E, E] stays one weight matrix: quantized, it runs on
each distinct input (query, key/value) whole and the wanted rows of its output are kept.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..kernels import ops


def project(x: torch.Tensor, slot: tuple, extra_bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W.T + b` through a dense or quantized slot (see the module docstring)."""
    if slot[0] == "dense":
        out = F.linear(x, slot[1], slot[2])
    else:
        _, backend, device_type, differentiable, op_args = slot
        out = ops.linear_call(backend, device_type, differentiable)(x, *op_args)
    return out if extra_bias is None else out + extra_bias


def _in_projection(query, key, value, in_proj, q_proj, k_proj, v_proj, in_bias):
    """q, k, v as `F._in_projection_packed` / `F._in_projection` compute them."""
    embed = query.shape[-1]
    if in_proj is None:  # separate q/k/v weights; the biases are chunks of in_proj_bias
        biases = (None, None, None) if in_bias is None else in_bias.chunk(3)
        return tuple(project(x, s, b) for x, s, b in zip((query, key, value), (q_proj, k_proj, v_proj), biases))
    if key is value and query is key:  # self-attention: one product
        proj = project(query, in_proj).unflatten(-1, (3, embed)).unsqueeze(0).transpose(0, -2).squeeze(-2)
        proj = proj.contiguous()
        return proj[0], proj[1], proj[2]
    if in_proj[0] == "dense":  # PyTorch's own split of the packed weight
        _, weight, bias = in_proj
        weights = weight.split([embed, embed, embed])
        biases = (None, None, None) if bias is None else bias.split([embed, embed, embed])
        return tuple(F.linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases))
    computed: list[tuple[torch.Tensor, torch.Tensor]] = []  # the quantized packed weight, whole, per distinct input
    outputs = []
    for i, x in enumerate((query, key, value)):
        full = next((out for source, out in computed if source is x), None)
        if full is None:
            full = project(x, in_proj)
            computed.append((x, full))
        outputs.append(full[..., i * embed : (i + 1) * embed])
    return tuple(outputs)


def multi_head_attention(
    query,
    key,
    value,
    num_heads: int,
    out_proj: tuple,
    in_proj: tuple | None = None,
    q_proj: tuple | None = None,
    k_proj: tuple | None = None,
    v_proj: tuple | None = None,
    in_bias: torch.Tensor | None = None,
    bias_k: torch.Tensor | None = None,
    bias_v: torch.Tensor | None = None,
    add_zero_attn: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    need_weights: bool = True,
    attn_mask: torch.Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
    dropout_p: float = 0.0,
):
    """`F.multi_head_attention_forward` in eval mode (sequence-first), projections through slots.
    `dropout_p` is taken and not applied, as PyTorch does outside training (the graph passes it on:
    under `dynamic=True` it is a symbolic float that must keep a user)."""
    is_batched = query.dim() == 3
    if not is_batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
    tgt_len, bsz, embed_dim = query.shape
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask,
        mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask),
        other_name="attn_mask",
        target_type=query.dtype,
    )
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # scaled_dot_product_attention applies the causal mask itself
    else:
        attn_mask = F._canonical_mask(
            mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="", target_type=query.dtype,
            check_other=False,
        )  # fmt: skip
        if key_padding_mask is not None:
            is_causal = False
    head_dim = embed_dim // num_heads
    q, k, v = _in_projection(query, key, value, in_proj, q_proj, k_proj, v_proj, in_bias)
    if attn_mask is not None and attn_mask.dim() == 2:
        attn_mask = attn_mask.unsqueeze(0)
    if bias_k is not None and bias_v is not None:
        k = torch.cat([k, bias_k.repeat(1, bsz, 1)])
        v = torch.cat([v, bias_v.repeat(1, bsz, 1)])
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
    q = q.reshape(tgt_len, bsz * num_heads, head_dim).transpose(0, 1)
    k = k.reshape(k.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
    v = v.reshape(v.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
    if add_zero_attn:
        zeros = torch.zeros((bsz * num_heads, 1, head_dim), dtype=k.dtype, device=k.device)
        k, v = torch.cat([k, zeros], dim=1), torch.cat([v, zeros], dim=1)
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
    src_len = k.size(1)
    if key_padding_mask is not None:
        key_padding_mask = (
            key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, num_heads, -1, -1).reshape(bsz * num_heads, 1, src_len)
        )
        attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
    if need_weights:
        q_scaled = q * math.sqrt(1.0 / float(head_dim))
        if attn_mask is not None:
            weights = torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
        else:
            weights = torch.bmm(q_scaled, k.transpose(-2, -1))
        weights = F.softmax(weights, dim=-1)
        out = torch.bmm(weights, v).transpose(0, 1).reshape(tgt_len * bsz, embed_dim)
        out = project(out, out_proj).view(tgt_len, bsz, -1)
        weights = weights.view(bsz, num_heads, tgt_len, src_len)
        if average_attn_weights:
            weights = weights.mean(dim=1)
        if not is_batched:
            out, weights = out.squeeze(1), weights.squeeze(0)
        return out, weights
    if attn_mask is not None:
        if attn_mask.size(0) == 1 and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(0)
        else:
            attn_mask = attn_mask.view(bsz, num_heads, -1, src_len)
    q = q.view(bsz, num_heads, tgt_len, head_dim)
    k = k.view(bsz, num_heads, src_len, head_dim)
    v = v.view(bsz, num_heads, src_len, head_dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal)
    out = out.permute(2, 0, 1, 3).reshape(bsz * tgt_len, embed_dim)
    out = project(out, out_proj).view(tgt_len, bsz, -1)
    return (out if is_batched else out.squeeze(1)), None


def _merged_masks(mask, mask_type, batch: int, num_heads: int):
    """(attn_mask, key_padding_mask) from the fast paths' one mask: type 0 [L, S] attention mask,
    1 [B, S] key padding, 2 [B, H or 1, L, S] (`nn.MultiheadAttention.merge_masks`)."""
    if mask is None:
        return None, None
    if mask_type == 1:
        return None, mask
    if mask_type == 2:
        mask = mask.expand(batch, num_heads, *mask.shape[-2:])
        return mask.reshape(batch * num_heads, *mask.shape[-2:]), None
    return mask, None


def native_multi_head_attention(
    query, key, value, num_heads, in_proj, out_proj, mask, need_weights, average_attn_weights, mask_type
):
    """`torch._native_multi_head_attention` (batch-first) through slots."""
    attn_mask, padding = _merged_masks(mask, mask_type, query.shape[0], num_heads)
    if query is key and key is value:
        query = key = value = query.transpose(0, 1)
    else:
        query, key, value = (x.transpose(0, 1) for x in (query, key, value))
    out, weights = multi_head_attention(
        query, key, value, num_heads, out_proj, in_proj=in_proj, key_padding_mask=padding,
        need_weights=need_weights, attn_mask=attn_mask, average_attn_weights=average_attn_weights,
    )  # fmt: skip
    return out.transpose(0, 1), weights


def transformer_encoder_layer(
    src, num_heads, in_proj, out_proj, use_gelu, norm_first, eps, norm1, norm2, linear1, linear2, mask, mask_type
):
    """`torch._transformer_encoder_layer_fwd` (batch-first, eval) through slots; `norm1`/`norm2` are
    (weight, bias) pairs."""
    embed_dim = src.shape[-1]
    attn_mask, padding = _merged_masks(mask, mask_type, src.shape[0], num_heads)
    activation = F.gelu if use_gelu else F.relu

    def attend(x):
        x = x.transpose(0, 1)
        out = multi_head_attention(
            x, x, x, num_heads, out_proj, in_proj=in_proj, key_padding_mask=padding, need_weights=False,
            attn_mask=attn_mask,
        )[0]  # fmt: skip
        return out.transpose(0, 1)

    def feed_forward(x):
        return project(activation(project(x, linear1)), linear2)

    def norm(x, weight_bias):
        return F.layer_norm(x, (embed_dim,), *weight_bias, eps)

    if norm_first:
        x = src + attend(norm(src, norm1))
        return x + feed_forward(norm(x, norm2))
    x = norm(src + attend(src), norm1)
    return norm(x + feed_forward(x), norm2)
