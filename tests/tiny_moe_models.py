"""Tiny MoE models for tests: transformers 5.x configs and two hand-written MoE styles, seeded, no downloads.

`initializer_range=0.1` (not the default 0.02) makes the experts matter: with 0.02, zeroing every
expert still leaves the logits of tiny Mixtral at cosine 0.995 to the original, so a cosine test
could not see a broken MoE; with 0.1 zeroing them gives ~0.70.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers

COMMON = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
    initializer_range=0.1,
)
# The op a rewritten MoE layer becomes: the generic one, or a cpu backend's graph op with its arguments.
MOE_OPS = ("quantpass.fused_moe", "quantpass.fused_moe_cpu", "quantpass.fused_moe_cpu_cxx")


def moe_op_count(counts) -> int:
    """MoE layers lowered to a fused MoE op, from `fx_utils.op_counts`."""
    return sum(counts[name] for name in MOE_OPS)


CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(
        **COMMON, intermediate_size=128, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **COMMON,
        intermediate_size=128,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_hidden_layers=2,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON,
        head_dim=16,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    ),
    # shared experts as a 3-D weight under torch.bmm (every token through each): grouped linears
    "inkling": lambda: transformers.InklingTextConfig(
        **COMMON,
        head_dim=16,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=16,
        sliding_window_size=8,
        d_rel=4,
        rel_extent=16,
        num_hidden_layers=2,
        intermediate_size=128,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=2,
    ),
    "phimoe": lambda: transformers.PhimoeConfig(  # sparsemixer routing: max and masked_fill, no topk
        **COMMON, intermediate_size=64, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2
    ),
    "olmoe": lambda: transformers.OlmoeConfig(
        **COMMON, intermediate_size=32, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, eos_token_id=1
    ),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4},
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    ),
    # Mamba layers, an attention layer, experts in every other layer (router: feed_forward.router)
    "jamba": lambda: transformers.JambaConfig(
        **COMMON,
        intermediate_size=128,
        num_hidden_layers=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=8,
        mamba_dt_rank=8,
        use_mamba_kernels=False,
    ),
    "gpt_oss": lambda: transformers.GptOssConfig(
        **COMMON,
        head_dim=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
    ),
    # Llama 4: a bmm of every expert's [E, H, 2I] weight with its slice of a dense [E, T, H] batch (routing
    # scores scale the inputs); its own code, no `experts_implementation`
    "llama4": lambda: transformers.Llama4TextConfig(
        **COMMON,
        head_dim=16,
        intermediate_size=64,
        intermediate_size_mlp=128,
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
    ),
    "glm4_moe": lambda: transformers.Glm4MoeConfig(
        **COMMON,
        head_dim=16,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=0,
        n_group=1,
        topk_group=1,
    ),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        **COMMON,
        head_dim=16,
        intermediate_size=128,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_hidden_layers=2,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        layer_types=["full_attention", "full_attention"],
    ),
    "hunyuan_v1_moe": lambda: transformers.HunYuanMoEV1Config(
        **COMMON,
        head_dim=16,
        intermediate_size=64,
        num_hidden_layers=2,
        num_experts=4,
        moe_topk=2,
    ),
    "minimax": lambda: transformers.MiniMaxConfig(
        **COMMON,
        head_dim=16,
        intermediate_size=64,
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["full_attention", "full_attention"],
    ),
    "lfm2_moe": lambda: transformers.Lfm2MoeConfig(
        **COMMON,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_experts=4,
        num_experts_per_tok=2,
        num_dense_layers=0,
        layer_types=["full_attention", "full_attention"],
    ),
    "deepseek_v4": lambda: transformers.DeepseekV4Config(  # hash-routed first layer, clamped SwiGLU experts
        **{**COMMON, "num_key_value_heads": 1},
        head_dim=16,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        q_lora_rank=32,
        num_experts_per_tok=2,
        n_routed_experts=4,
        n_shared_experts=1,
        swiglu_limit=1.0,  # clamps a share of the tiny model's projections (its default 10.0: none)
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        hc_mult=2,
        hc_sinkhorn_iters=4,
        mlp_layer_types=["hash_moe", "moe"],
        sliding_window=8,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=4,
        num_nextn_predict_layers=0,
        qk_rope_head_dim=8,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "zaya": lambda: transformers.ZayaConfig(  # top-1 routing: each token goes to one expert
        **COMMON,
        head_dim=16,
        num_hidden_layers=2,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=1,
        router_hidden_size=32,
        layer_types=["hybrid", "hybrid"],
    ),
}


def tiny_moe(name: str, experts_implementation: str, dtype=torch.bfloat16, seed: int = 0, **overrides) -> nn.Module:
    config = CONFIGS[name]()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    implementation = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    model = transformers.AutoModelForCausalLM.from_config(config, **implementation)
    return model.to(dtype).eval()


H, I, E, K = 64, 32, 4, 2  # hidden, intermediate, experts, top-k  # noqa: E741


class GatherEinsumMoE(nn.Module):
    """gpt-fast style: separate w1 (gate) / w3 (up) / w2 [E, ...] gathered by `W[topk_ids]`, einsum.

    `gate` names the parameter whose projection goes through the SiLU (w1 in gpt-fast);
    `pre_activation`, if given, is applied to the gate projection before the SiLU (a model that
    must defeat the activation matcher: `clamp(max=50)`, an op it does not know).
    """

    def __init__(self, gate: str = "w1", pre_activation=None):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, I, H) * 0.1)
        self.w3 = nn.Parameter(torch.randn(E, I, H) * 0.1)
        self.w2 = nn.Parameter(torch.randn(E, H, I) * 0.1)
        self.gate_param = gate
        self.pre_activation = pre_activation

    def experts(self, x, expert_weights, expert_indices):  # [T, H], [T, K], [T, K] -> [T, H]
        x1 = torch.einsum("ti,taoi->tao", x, self.w1[expert_indices])
        x3 = torch.einsum("ti, taoi -> tao", x, self.w3[expert_indices])
        if self.pre_activation is not None:
            x1, x3 = (self.pre_activation(x1), x3) if self.gate_param == "w1" else (x1, self.pre_activation(x3))
        hidden = F.silu(x1) * x3 if self.gate_param == "w1" else x1 * F.silu(x3)
        y = torch.einsum("tao,taio->tai", hidden, self.w2[expert_indices])
        return torch.einsum("tai,ta->ti", y, expert_weights)

    def forward(self, x):
        x = x.view(-1, H)
        weights, indices = torch.topk(F.softmax(self.gate(x), dim=-1), K, dim=-1)
        return self.experts(x, weights / weights.sum(dim=-1, keepdim=True), indices)


class ExpertMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3, self.w2 = (
            nn.Linear(H, I, bias=False),
            nn.Linear(H, I, bias=False),
            nn.Linear(I, H, bias=False),
        )

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ModuleListMoE(nn.Module):
    """Mixtral v1 style: a ModuleList of expert MLPs. `dense`: every expert runs on every token and a
    [T, E] scatter of the top-k weights combines them (one graph); else the `torch.where` loop (its
    frame is skipped by Dynamo unless `capture_dynamic_output_shape_ops`)."""

    def __init__(self, dense: bool):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([ExpertMLP() for _ in range(E)])
        self.dense = dense

    def forward(self, x):
        x = x.view(-1, H)
        weights, selected = torch.topk(F.softmax(self.gate(x), dim=-1), K, dim=-1)
        if self.dense:
            dense_weights = torch.zeros(x.shape[0], E, dtype=x.dtype).scatter(1, selected, weights)  # [T, E]
            return sum(expert(x) * dense_weights[:, e : e + 1] for e, expert in enumerate(self.experts))
        out = torch.zeros_like(x)
        mask = F.one_hot(selected, num_classes=E).permute(2, 1, 0)
        for e, expert in enumerate(self.experts):
            slot, token = torch.where(mask[e])
            out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out


class OneLayer(nn.Module):
    """x + mlp(x), with the MoE at `layers.0.mlp` like a real decoder."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleDict({"mlp": mlp})])

    def forward(self, x):
        return x + self.layers[0]["mlp"](x).view(x.shape)


class SortedExperts(nn.Module):
    """The transformers `grouped_mm` experts, written out (bf16: `torch._grouped_mm` compiles only in
    bf16). `unpermute=False` forgets to restore token order: a near miss that must not be proven."""

    def __init__(self, unpermute: bool = True):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(E, H, I) * 0.1)
        self.unpermute = unpermute

    def forward(self, x):
        x = x.view(-1, H)
        weights, ids = torch.topk(F.softmax(self.gate(x), dim=-1), K, dim=-1)
        sorted_ids, perm = torch.sort(ids.reshape(-1))
        counts = torch.histc(sorted_ids.float(), bins=E, min=0, max=E - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        gate, up = torch._grouped_mm(x[perm // K], self.gate_up_proj.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
        out = torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(-2, -1), offs=offsets)
        out = out * weights.reshape(-1)[perm].unsqueeze(-1)
        if self.unpermute:
            inverse = torch.empty_like(perm)
            inverse[perm] = torch.arange(perm.size(0))
            out = out[inverse]
        return out.view(-1, K, H).sum(dim=1)


def defeat_activation(model: nn.Module) -> nn.Module:
    """A tiny GPT-OSS whose experts clamp their swigluoai output at 50: no fused MoE computes that."""
    experts = [m for m in model.modules() if isinstance(getattr(m, "limit", None), float) and hasattr(m, "_apply_gate")]
    assert experts, "defeat_activation expects GPT-OSS experts (their own `_apply_gate` and `limit`)"
    for module in experts:
        module._apply_gate = lambda gate_up, own=module._apply_gate: own(gate_up).clamp(max=50)
    return model


def eager_and_compiled_logits(model: nn.Module, ids: torch.Tensor, backend) -> tuple[torch.Tensor, torch.Tensor]:
    """(eager logits, logits through `torch.compile(model, backend=backend)`), after a Dynamo reset."""
    torch._dynamo.reset()
    with torch.no_grad():
        return model(ids).logits, torch.compile(model, backend=backend)(ids).logits
