"""Built-in models for `quantpass run` and the model benchmark: small transformers with seeded random
weights (nothing is downloaded), or a local transformers checkpoint directory.

Random weights are enough to measure what quantization does to a model's numerics and speed; they
say nothing about task accuracy.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

import torch

# name -> (transformers config class, config fields, one line for humans). Sized so that
# `quantpass run` (two Inductor compiles, two short generations) stays under 2 minutes on 2 CPU cores.
# fmt: off
PRESETS: dict[str, tuple[str, dict, str]] = {
    "moe": ("Qwen3MoeConfig", dict(
        hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, intermediate_size=512,
        decoder_sparse_step=1, mlp_only_layers=[], vocab_size=1024, max_position_embeddings=512,
        tie_word_embeddings=False,
    ), "Qwen3-MoE style: 2 layers, hidden 256, 8 experts (top-2, intermediate 256), vocab 1024"),
    "dense": ("LlamaConfig", dict(
        hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=768, vocab_size=1024, max_position_embeddings=512, tie_word_embeddings=False,
    ), "Llama style: 2 layers, hidden 256, intermediate 768, vocab 1024"),
}
# fmt: on
DEFAULT_PRESET = "moe"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# transformers 5.x MoE experts: the default eager loop graph-breaks and its experts never reach a
# graph; `grouped_mm` captures the whole model in one graph (fp32 weights go through transformers'
# opaque `grouped_mm_fallback` op under compile, which quantpass recognises too).
EXPERTS_IMPLEMENTATION = "grouped_mm"


@dataclass
class LoadedModel:
    model: torch.nn.Module
    name: str  # the preset name or the checkpoint directory
    description: str
    vocab_size: int

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in unique_parameters(self.model))


def unique_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Parameters counted once (tied weights appear once)."""
    return list({id(p): p for p in model.parameters()}.values())


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> str:
    # bf16 matmuls on CPUs without AMX / AVX512-BF16 are several times slower than fp32 (measured
    # here on an AVX2 EPYC: 16x256x512 takes ~3-8 ms in bf16, ~0.3 ms in fp32), so CPU uses fp32.
    return "bfloat16" if torch.device(device).type == "cuda" else "float32"


def load_model(name_or_dir: str = DEFAULT_PRESET, dtype: str | None = None, device: str | None = None, seed: int = 0):
    """A preset by name (random weights from `seed`) or a local checkpoint directory -> LoadedModel."""
    device = device or default_device()
    dtype = dtype or default_dtype(device)
    if dtype not in DTYPES:
        raise ValueError(f"invalid dtype {dtype!r}; valid: {', '.join(sorted(DTYPES))}")
    transformers = _transformers()
    if name_or_dir in PRESETS:
        class_name, fields, description = PRESETS[name_or_dir]
        config = getattr(transformers, class_name)(**fields)
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
        name = name_or_dir
    elif (Path(name_or_dir) / "config.json").is_file():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            name_or_dir, local_files_only=True, dtype=DTYPES[dtype]
        )
        config, name = model.config, str(name_or_dir)
        description = f"{type(model).__name__} from {name_or_dir}"
    else:
        raise ValueError(
            f"invalid model {name_or_dir!r}: not a preset ({', '.join(PRESETS)}) "
            "nor a directory holding a transformers checkpoint (config.json + *.safetensors)"
        )
    if model._can_set_experts_implementation():  # an MoE model (dense ones refuse the setting)
        model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    model = model.to(device=device, dtype=DTYPES[dtype]).eval()
    model.config.use_cache = False  # generation re-runs the whole sequence: see measure.greedy_generate
    return LoadedModel(model, name, f"{description}; {dtype} on {device}", config.vocab_size)


def prompt_ids(vocab_size: int, length: int = 16, seed: int = 1234, device: str = "cpu") -> torch.Tensor:
    """The fixed prompt, `[1, length]` token ids drawn from a seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, length), generator=generator).to(device)


def _transformers():
    try:
        return importlib.import_module("transformers")
    except ImportError:
        raise ValueError(
            "the built-in models need transformers: pip install 'transformers>=5' (or pip install -e '.[dev]')"
        ) from None
