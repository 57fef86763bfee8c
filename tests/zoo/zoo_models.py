"""The zoo's architectures: tiny random-config models, seeded, built from configs (nothing downloaded).

Every model is small enough to compile in seconds (hidden 32-64, 1-2 layers, vocab 128). Weights
use `initializer_range`-style std 0.1 where the config has one (0.02, the usual default, leaves
2-layer logits almost untouched by the layers: a broken layer would hide under a high cosine).
MoE models use transformers' `grouped_mm` (bf16: `torch._grouped_mm` compiles only in bf16) or
`batched_mm` (fp32) experts: its 'eager' loop never reaches a graph (`quantpass.backend.experts_warning`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared tiny MoE configs
from tiny_moe_models import CONFIGS as MOE_CONFIGS

VOCAB, BATCH, LENGTH = 128, 2, 9  # 9 tokens: an odd M
STD = 0.1
SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
LLM = dict(**SMALL, num_key_value_heads=2, max_position_embeddings=64, initializer_range=STD)
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
GPT = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, initializer_range=STD, **IDS)
BART_LIKE = dict(
    vocab_size=VOCAB,
    d_model=64,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=128,
    decoder_ffn_dim=128,
    init_std=STD,
    **IDS,
)
MAMBA = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    state_size=8,
    expand=2,
    time_step_rank=8,
    initializer_range=STD,
)
MLA = dict(kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
MAMBA2 = dict(mamba_n_heads=4, mamba_d_state=8, mamba_n_groups=1)
ROUTER_SCALE = 4.0
# Granite scales attention by 1/head_dim like its released checkpoints (the config's default 1.0
# leaves scores unscaled). Their embedding x12 / residual x0.22 are left at 1.0: in two tiny layers
# they bury the layers under the embeddings (NVFP4 cosine 0.9995, blind to a broken layer).
GRANITE_MULTIPLIERS = dict(attention_multiplier=1 / 16)


def _first_tensor(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple):
        return _first_tensor(out[0])
    return out[0]  # a ModelOutput: its first non-None field (logits, last_hidden_state)


@dataclass(frozen=True)
class Arch:
    """One zoo entry: `build()` returns the model in eval mode, `inputs()` its keyword arguments."""

    name: str
    family: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], dict]
    output: Callable[[object], torch.Tensor] = _first_tensor  # the tensor compared with eager's
    moe: bool = False


def token_ids(batch: int = BATCH, length: int = LENGTH, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def ids() -> dict:
    return {"input_ids": token_ids()}


def padded() -> dict:
    """Token ids with an attention mask whose second row is padded: the encoders' usual input."""
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    mask[1, -3:] = 0
    return {"input_ids": token_ids(), "attention_mask": mask}


def seq2seq() -> dict:
    return {"input_ids": token_ids(), "decoder_input_ids": token_ids(length=5, seed=2)}


def pixels(size: int = 32) -> dict:
    return {"pixel_values": torch.randn(BATCH, 3, size, size, generator=torch.Generator().manual_seed(3))}


def _hf(model_class, config_class, **config):
    def build():
        torch.manual_seed(0)
        return model_class.from_config(config_class(**config)).eval()

    return build


def _moe(name: str, experts: str | None, dtype, router_scale: float = ROUTER_SCALE) -> Callable[[], nn.Module]:
    """A tiny MoE causal LM whose router weights are scaled by `router_scale`.

    With std-0.1 routers many tokens' top-k choices are near ties, and rounding alone flips them:
    GPT-OSS with only one attention projection in INT8 gave cosine 0.9874 on quantpass's CPU kernel
    and 0.9998 on the reference kernel, from the same weights (2026-12-01). Scaled x4, both give
    0.9995: the cosine then measures quantization, not which near-tied expert won. DeepSeek-V4 scores
    experts by sqrt(softplus(logit)), which narrows the gaps: x4 still let INT8-rounded weights in
    eager flip one token's layer-1 expert (cosine 0.9974, quantpass the same); x16 gives 0.9995.
    """

    def build():
        torch.manual_seed(0)
        config = MOE_CONFIGS[name]() if name in MOE_CONFIGS else _granite_moe_config()
        implementation = {} if experts is None else {"experts_implementation": experts}  # None: the model's own
        model = tf.AutoModelForCausalLM.from_config(config, **implementation)
        with torch.no_grad():
            for pname, param in model.named_parameters():
                if pname.endswith(("mlp.gate.weight", "router.weight")):
                    param.mul_(router_scale)
        return model.to(dtype).eval()

    return build


def _granite_moe_config():
    return tf.GraniteMoeConfig(**LLM, num_local_experts=4, num_experts_per_tok=2, **IDS, **GRANITE_MULTIPLIERS)


def _clip_output(out) -> torch.Tensor:
    return torch.cat([out.text_embeds.flatten(), out.image_embeds.flatten()])


# ---- plain torch shapes ----


class SequentialMLP(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(64, 96), nn.Linear(96, 64))


class DeepMLP(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 96), nn.ReLU(), nn.Linear(96, 48))


class SelfAttention(nn.Module):
    """`nn.MultiheadAttention` used as self-attention (its packed in_proj_weight + out_proj)."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(64, 4, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


class DecoderLayer(nn.Module):
    """`nn.TransformerDecoderLayer`: self-attention, then cross-attention on a memory (key = value)."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(64, 4, dim_feedforward=128, batch_first=True)

    def forward(self, tgt, memory):
        return self.layer(tgt, memory)


class LinearTwice(nn.Module):
    """One Linear called twice in a forward: `head(x) + head(2 * x)`."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 96)
        self.head = nn.Linear(96, 32)

    def forward(self, x):
        h = torch.relu(self.up(x))
        return self.head(h) + self.head(2 * h)


class SharedBlock(nn.Module):
    """ALBERT-style weight sharing: one block applied three times."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))

    def forward(self, x):
        for _ in range(3):
            x = x + self.block(x)
        return x


def _torch(module_class, **kwargs):
    def build():
        torch.manual_seed(0)
        return module_class(**kwargs).eval()

    return build


def activations(name: str = "input", length: int = LENGTH, seed: int = 4) -> Callable[[], dict]:
    return lambda: {name: torch.randn(BATCH, length, 64, generator=torch.Generator().manual_seed(seed))}


AUTO_LM, AUTO = tf.AutoModelForCausalLM, tf.AutoModel
ARCHS = [
    # ---- decoder LLMs ----
    Arch("llama", "decoder", _hf(AUTO_LM, tf.LlamaConfig, **LLM, **IDS), ids),
    Arch("mistral", "decoder", _hf(AUTO_LM, tf.MistralConfig, **LLM, **IDS), ids),
    Arch("qwen2", "decoder", _hf(AUTO_LM, tf.Qwen2Config, **LLM, **IDS), ids),
    Arch("qwen3", "decoder", _hf(AUTO_LM, tf.Qwen3Config, **LLM, head_dim=16, **IDS), ids),
    Arch("gemma", "decoder", _hf(AUTO_LM, tf.GemmaConfig, **LLM, head_dim=16, **IDS), ids),
    Arch("gemma2", "decoder", _hf(AUTO_LM, tf.Gemma2Config, **LLM, head_dim=16, **IDS), ids),
    Arch("granite", "decoder", _hf(AUTO_LM, tf.GraniteConfig, **LLM, **IDS, **GRANITE_MULTIPLIERS), ids),
    Arch("olmo2", "decoder", _hf(AUTO_LM, tf.Olmo2Config, **LLM, **IDS), ids),
    Arch("cohere", "decoder", _hf(AUTO_LM, tf.CohereConfig, **LLM, **IDS), ids),
    Arch("phi", "decoder", _hf(AUTO_LM, tf.PhiConfig, **LLM, **IDS), ids),
    Arch("phi3", "decoder", _hf(AUTO_LM, tf.Phi3Config, **LLM, **IDS, rope_parameters=None), ids),
    Arch("stablelm", "decoder", _hf(AUTO_LM, tf.StableLmConfig, **LLM, **IDS), ids),
    Arch(
        "gpt2",
        "decoder",
        _hf(AUTO_LM, tf.GPT2Config, **GPT),
        ids,
    ),
    Arch(
        "gpt_bigcode",
        "decoder",
        _hf(AUTO_LM, tf.GPTBigCodeConfig, **GPT),
        ids,
    ),
    Arch(
        "gptj",
        "decoder",
        _hf(AUTO_LM, tf.GPTJConfig, **GPT, rotary_dim=8),
        ids,
    ),
    Arch(
        "codegen",
        "decoder",
        _hf(AUTO_LM, tf.CodeGenConfig, **GPT, rotary_dim=8),
        ids,
    ),
    Arch("gpt_neox", "decoder", _hf(AUTO_LM, tf.GPTNeoXConfig, **LLM, **IDS), ids),
    Arch(
        "falcon",
        "decoder",
        _hf(
            AUTO_LM,
            tf.FalconConfig,
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            initializer_range=STD,
            **IDS,
        ),
        ids,
    ),
    Arch(
        "bloom",
        "decoder",
        _hf(
            AUTO_LM, tf.BloomConfig, vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, initializer_range=STD, **IDS
        ),
        ids,
    ),
    Arch(
        "opt",
        "decoder",
        _hf(
            AUTO_LM,
            tf.OPTConfig,
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=128,
            word_embed_proj_dim=64,
            max_position_embeddings=64,
            init_std=STD,
            **IDS,
        ),
        ids,
    ),
    Arch("gemma3", "decoder", _hf(AUTO_LM, tf.Gemma3TextConfig, **LLM, head_dim=16, **IDS), ids),
    Arch(  # AltUp streams, LAuReL low-rank residuals, per-layer token inputs
        "gemma3n",
        "decoder",
        _hf(
            AUTO_LM,
            tf.Gemma3nTextConfig,
            **{**LLM, "intermediate_size": [128, 128]},
            head_dim=16,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=8,
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=VOCAB,
            num_kv_shared_layers=0,
            laurel_rank=8,
            activation_sparsity_pattern=[0.0, 0.0],
            **IDS,
        ),
        ids,
    ),
    Arch(  # multi-head latent attention in a dense model
        "minicpm3",
        "decoder",
        _hf(AUTO_LM, tf.MiniCPM3Config, **{**LLM, "num_key_value_heads": 4}, **MLA, **IDS),
        ids,
    ),
    # ---- state-space decoders and hybrids (Mamba reads `dt_proj.weight @ x`: a linear, weight on the left) ----
    Arch(  # Mamba-2 layers with an attention layer
        "bamba",
        "decoder",
        _hf(AUTO_LM, tf.BambaConfig, **LLM, attn_layer_indices=[1], **MAMBA2, mamba_d_head=32, **IDS),
        ids,
    ),
    Arch(  # attention and Mamba-2 side by side in every layer
        "falcon_h1", "decoder", _hf(AUTO_LM, tf.FalconH1Config, **LLM, head_dim=16, **MAMBA2, **IDS), ids
    ),
    Arch("mamba", "decoder", _hf(AUTO_LM, tf.MambaConfig, **MAMBA), ids),
    Arch("falcon_mamba", "decoder", _hf(AUTO_LM, tf.FalconMambaConfig, **MAMBA), ids),
    # ---- encoders ----
    Arch(
        "bert",
        "encoder",
        _hf(tf.AutoModelForMaskedLM, tf.BertConfig, **SMALL, initializer_range=STD, max_position_embeddings=64),
        padded,
    ),
    Arch(
        "roberta",
        "encoder",
        _hf(AUTO, tf.RobertaConfig, **SMALL, initializer_range=STD, max_position_embeddings=64, pad_token_id=1),
        padded,
    ),
    Arch(
        "albert",
        "encoder",
        _hf(AUTO, tf.AlbertConfig, **SMALL, embedding_size=32, initializer_range=STD, max_position_embeddings=64),
        padded,
    ),
    Arch(
        "deberta_v2",
        "encoder",
        _hf(
            AUTO,
            tf.DebertaV2Config,
            **SMALL,
            initializer_range=STD,
            max_position_embeddings=64,
            relative_attention=True,
            position_buckets=16,
            pos_att_type=["p2c", "c2p"],
        ),
        padded,
    ),
    Arch(
        "distilbert",
        "encoder",
        _hf(
            AUTO,
            tf.DistilBertConfig,
            vocab_size=VOCAB,
            dim=64,
            n_layers=2,
            n_heads=4,
            hidden_dim=128,
            max_position_embeddings=64,
            initializer_range=STD,
        ),
        padded,
    ),
    Arch(
        "electra",
        "encoder",
        _hf(AUTO, tf.ElectraConfig, **SMALL, embedding_size=32, initializer_range=STD, max_position_embeddings=64),
        padded,
    ),
    Arch(  # q/k/v/o/r are einsums on [d_model, n_head, d_head] weights
        "xlnet",
        "encoder",
        _hf(
            AUTO, tf.XLNetConfig, vocab_size=VOCAB, d_model=64, n_layer=2, n_head=4, d_inner=128, initializer_range=STD
        ),
        padded,
    ),
    Arch(  # r_kernel is an einsum on a [d_model, n_head, d_head] weight
        "funnel",
        "encoder",
        _hf(
            AUTO,
            tf.FunnelConfig,
            vocab_size=VOCAB,
            d_model=64,
            n_head=4,
            d_head=16,
            d_inner=128,
            block_sizes=[1, 1],
            num_decoder_layers=1,
            initializer_range=STD,
            architectures=["FunnelModel"],  # the config's own is None, which AutoModel can't read
        ),
        padded,
    ),
    # ---- encoder-decoders ----
    Arch(
        "t5",
        "encoder-decoder",
        _hf(
            tf.AutoModelForSeq2SeqLM,
            tf.T5Config,
            vocab_size=VOCAB,
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=1,
            num_heads=4,
            relative_attention_num_buckets=8,
            decoder_start_token_id=0,
            **IDS,
        ),
        seq2seq,
    ),
    Arch(
        "bart",
        "encoder-decoder",
        _hf(
            tf.AutoModelForSeq2SeqLM,
            tf.BartConfig,
            **BART_LIKE,
            max_position_embeddings=64,
        ),
        seq2seq,
    ),
    Arch(
        "whisper",
        "encoder-decoder",
        _hf(
            tf.AutoModelForSpeechSeq2Seq,
            tf.WhisperConfig,
            **BART_LIKE,
            num_mel_bins=16,
            max_source_positions=16,
            max_target_positions=32,
            decoder_start_token_id=1,
        ),
        lambda: {
            "input_features": torch.randn(BATCH, 16, 32, generator=torch.Generator().manual_seed(5)),
            "decoder_input_ids": token_ids(length=5, seed=2),
        },
    ),
    # ---- vision ----
    Arch(
        "vit",
        "vision",
        _hf(AUTO, tf.ViTConfig, **{**SMALL, "vocab_size": None}, image_size=32, patch_size=8, initializer_range=STD),
        pixels,
    ),
    Arch(
        "clip",
        "vision",
        _hf(
            AUTO,
            tf.CLIPConfig,
            text_config=dict(**SMALL, max_position_embeddings=16, projection_dim=32),
            vision_config=dict(**{**SMALL, "vocab_size": None}, image_size=32, patch_size=8, projection_dim=32),
            projection_dim=32,
        ),
        lambda: {**ids(), **pixels()},
        output=_clip_output,
    ),
    Arch(
        "swin",
        "vision",
        _hf(
            AUTO,
            tf.SwinConfig,
            image_size=32,
            patch_size=4,
            embed_dim=32,
            depths=[1, 1],
            num_heads=[2, 4],
            window_size=4,
            initializer_range=STD,
        ),
        pixels,
    ),
    # ---- mixture of experts ----
    Arch("mixtral", "moe", _moe("mixtral", "grouped_mm", torch.bfloat16), ids, moe=True),
    Arch("qwen2_moe", "moe", _moe("qwen2_moe", "batched_mm", torch.float32), ids, moe=True),
    Arch("qwen3_moe", "moe", _moe("qwen3_moe", "grouped_mm", torch.bfloat16), ids, moe=True),
    Arch("olmoe", "moe", _moe("olmoe", "batched_mm", torch.float32), ids, moe=True),
    Arch("deepseek_v3", "moe", _moe("deepseek_v3", "grouped_mm", torch.bfloat16), ids, moe=True),
    Arch("gpt_oss", "moe", _moe("gpt_oss", "batched_mm", torch.float32), ids, moe=True),
    Arch("granitemoe", "moe", _moe("granitemoe", "grouped_mm", torch.bfloat16), ids, moe=True),
    Arch("llama4", "moe", _moe("llama4", None, torch.float32), ids, moe=True),
    Arch("glm4_moe", "moe", _moe("glm4_moe", "grouped_mm", torch.bfloat16), ids, moe=True),
    Arch("qwen3_next", "moe", _moe("qwen3_next", "batched_mm", torch.float32), ids, moe=True),
    Arch("hunyuan_v1_moe", "moe", _moe("hunyuan_v1_moe", "grouped_mm", torch.bfloat16), ids, moe=True),
    Arch("minimax", "moe", _moe("minimax", "batched_mm", torch.float32), ids, moe=True),
    Arch("lfm2_moe", "moe", _moe("lfm2_moe", "grouped_mm", torch.bfloat16), ids, moe=True),
    Arch("zaya", "moe", _moe("zaya", "grouped_mm", torch.bfloat16), ids, moe=True),
    Arch("deepseek_v4", "moe", _moe("deepseek_v4", "batched_mm", torch.float32, router_scale=16.0), ids, moe=True),
    Arch("inkling", "moe", _moe("inkling", "grouped_mm", torch.bfloat16), ids, moe=True),
    Arch("jamba", "moe", _moe("jamba", "batched_mm", torch.float32), ids, moe=True),
    # ---- plain torch ----
    Arch("sequential_mlp", "torch", _torch(SequentialMLP), activations()),
    Arch("deep_mlp", "torch", _torch(DeepMLP), activations()),
    Arch(
        "transformer_encoder_layer",
        "torch",
        _torch(nn.TransformerEncoderLayer, d_model=64, nhead=4, dim_feedforward=128, batch_first=True),
        activations("src"),
    ),
    Arch("multihead_attention", "torch", _torch(SelfAttention), activations("x")),
    Arch("linear_twice", "torch", _torch(LinearTwice), activations("x")),
    Arch("shared_block", "torch", _torch(SharedBlock), activations("x")),
    Arch(
        "transformer_decoder_layer",
        "torch",
        _torch(DecoderLayer),
        lambda: {**activations("tgt", length=5, seed=6)(), **activations("memory")()},
    ),
]
BY_NAME = {arch.name: arch for arch in ARCHS}
