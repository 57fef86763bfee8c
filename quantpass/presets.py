"""Built-in models for `quantpass run` and the model benchmark, or a local transformers checkpoint.

The presets are small transformers trained in-process on a synthetic language (nothing is
downloaded): a few seconds on CPU the first time, then loaded from `~/.cache/quantpass/presets`.
A trained model's logits are peaked where its language is predictable, so top-1 token agreement
and greedy generation measure what quantization changed; with random weights the logits are
nearly flat and the top-1 token flips under any noise (median top-1/top-2 gap 0.14 standard
deviations of the logits, measured on the random-weight moe preset).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("quantpass")

# name -> (transformers config class, config fields, one line for humans). Sized so that weights
# dominate the time of a forward (on CPU the weight-only kernels then beat bf16 matmuls) while
# training stays short, and `quantpass run` fits in 2 minutes on 2 CPU cores.
# fmt: off
PRESETS: dict[str, tuple[str, dict, str]] = {
    "moe": ("Qwen3MoeConfig", dict(
        hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512, intermediate_size=1024,
        decoder_sparse_step=1, mlp_only_layers=[], vocab_size=512, max_position_embeddings=512,
        tie_word_embeddings=False,
    ), "Qwen3-MoE style: 2 layers, hidden 512, 8 experts (top-2, intermediate 512), vocab 512"),
    "dense": ("LlamaConfig", dict(
        hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=2048, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False,
    ), "Llama style: 2 layers, hidden 512, intermediate 2048, vocab 512"),
}
# fmt: on
# The preset `quantpass run` takes per device type. On CPU the MoE experts run through a per-expert
# loop of weight-only kernels (no fused MoE kernel), which barely beats the unquantized experts
# (bf16, 1 thread, M=16, CPU time per forward of the moe preset, 2026-12-01: 17.5 ms unquantized,
# 14.8 ms INT8, 17.7 ms INT4; the dense preset: 18.8, 14.2, 11.6 ms), so CPU shows the dense one.
DEFAULT_PRESETS = {"cpu": "dense", "cuda": "moe"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# transformers 5.x MoE experts: the default eager loop graph-breaks and its experts never reach a
# graph; `grouped_mm` captures the whole model in one graph (fp32 weights go through transformers'
# opaque `grouped_mm_fallback` op under compile, which quantpass recognises too).
EXPERTS_IMPLEMENTATION = "grouped_mm"


@dataclass(frozen=True)
class Language:
    """A synthetic language: `words` words of `lengths` tokens, every token in one word only (inside
    a word the next token is certain); each word is followed by one of `len(successors)` words with
    these probabilities. About 2/3 of positions have one right answer, the rest a clear favourite."""

    words: int = 128
    lengths: tuple[int, int] = (2, 4)  # shortest, longest
    successors: tuple[float, ...] = (0.6, 0.3, 0.1)
    seed: int = 0

    def tables(self, vocab_size: int) -> tuple[list[list[int]], torch.Tensor]:
        """(the spelling of each word, `[words, successors]` word ids that may follow each word)."""
        generator = torch.Generator().manual_seed(self.seed)
        lengths = torch.randint(self.lengths[0], self.lengths[1] + 1, (self.words,), generator=generator)
        if int(lengths.sum()) > vocab_size:
            raise ValueError(f"the language needs {int(lengths.sum())} tokens; the vocabulary has {vocab_size}")
        tokens = torch.randperm(vocab_size, generator=generator)[: int(lengths.sum())]
        spelling = [word.tolist() for word in torch.split(tokens, lengths.tolist())]
        follow = torch.stack(
            [torch.randperm(self.words, generator=generator)[: len(self.successors)] for _ in range(self.words)]
        )
        return spelling, follow

    def sample(self, vocab_size: int, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """`[batch, length]` token ids of running text, each row starting at a random word."""
        spelling, follow = self.tables(vocab_size)
        probabilities = torch.tensor(self.successors)
        rows = []
        for _ in range(batch):
            word, row = int(torch.randint(self.words, (1,), generator=generator)), []
            while len(row) < length:
                row += spelling[word]
                word = int(follow[word, torch.multinomial(probabilities, 1, generator=generator)])
            rows.append(row[:length])
        return torch.tensor(rows)


LANGUAGE = Language()
# Adam on batches of running text, one CPU thread (deterministic, and no slower on a shared
# 2-core machine). Measured 2026-12-01: loss 6.4 -> 0.8 nats (the language's floor is ~0.3), top-1
# accuracy 0.78 (dense) / 0.79 (moe) of the ~0.87 possible, median top-1/top-2 logit gap 0.9 / 1.7
# standard deviations of the logits (0.14 untrained); 18 s / 21 s of CPU time.
TRAINING = dict(steps=60, batch=8, length=32, lr=5e-3, seed=0)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    name: str  # the preset name or the checkpoint directory
    description: str
    vocab_size: int
    language: Language | None = None  # the presets' language; None for a checkpoint
    # A pre-quantized checkpoint, or one quantized as it loads: loads the quantized model (its
    # layers hold the checkpoint's formats); `model` is then its dequantized twin.
    load_quantized: Callable[[], torch.nn.Module] | None = None

    def quantizable(self) -> torch.nn.Module:
        """A model to compile with quantpass, next to `model` (which stays unquantized)."""
        if self.load_quantized is not None:
            return _ready(self.load_quantized())
        from .measure import quantized_copy

        return quantized_copy(self.model)

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in unique_parameters(self.model))

    def prompt(self, length: int = 16, seed: int = 1234) -> torch.Tensor:
        """The fixed prompt, `[1, length]`: text of the preset's language, or (a checkpoint, whose
        tokenizer quantpass doesn't use) token ids drawn from a seeded generator."""
        device = next(self.model.parameters()).device
        generator = torch.Generator().manual_seed(seed)
        if self.language is not None:
            return self.language.sample(self.vocab_size, 1, length, generator).to(device)
        return torch.randint(0, self.vocab_size, (1, length), generator=generator).to(device)


def unique_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Parameters counted once (tied weights appear once)."""
    return list({id(p): p for p in model.parameters()}.values())


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> str:
    # bf16 everywhere. On CPUs without AMX / AVX512-BF16 a bf16 matmul is slower than an fp32 one
    # (2.1-3.1x at M=16, 256-1024 wide, 1 thread, Xeon with AVX-512 but no bf16, 2026-12-01), and
    # that is where the cpu backend's INT8/INT4 kernels (bf16 activations) beat it; against an
    # fp32 model they only tie at M >= 16. bf16 is also what models are shipped and served in.
    return "bfloat16"


def model_config(name_or_dir: str):
    """The transformers config of a preset or checkpoint directory, without loading weights."""
    transformers = _transformers()
    if name_or_dir in PRESETS:
        class_name, fields, _ = PRESETS[name_or_dir]
        return getattr(transformers, class_name)(**fields)
    if (Path(name_or_dir) / "config.json").is_file():
        return transformers.AutoConfig.from_pretrained(name_or_dir, local_files_only=True)
    raise ValueError(
        f"invalid model {name_or_dir!r}: not a preset ({', '.join(PRESETS)}) "
        "nor a directory holding a transformers checkpoint (config.json + *.safetensors)"
    )


def default_preset(device: str) -> str:
    return DEFAULT_PRESETS.get(torch.device(device).type, "dense")


def load_model(
    name_or_dir: str | None = None,
    dtype: str | None = None,
    device: str | None = None,
    progress=None,
    trained: bool = True,
    quantize_on_load: dict | None = None,
) -> LoadedModel:
    """A preset by name (trained on `LANGUAGE`, or loaded from the cache of an earlier training;
    `trained=False`: seeded random weights, enough for a plan) or a local checkpoint directory ->
    LoadedModel. A pre-quantized checkpoint (any `qp.from_pretrained` reads), or a full-precision one with
    `quantize_on_load` (`qp.from_pretrained`'s format options), loads quantized: the LoadedModel's
    `model` is then its dequantized twin. `progress(message)` hears about a training."""
    device = device or default_device()
    name_or_dir = name_or_dir or default_preset(device)
    dtype = dtype or default_dtype(device)
    if dtype not in DTYPES:
        raise ValueError(f"invalid dtype {dtype!r}; valid: {', '.join(sorted(DTYPES))}")
    transformers = _transformers()
    config, language = model_config(name_or_dir), None
    if name_or_dir not in PRESETS and (quantize_on_load or checkpoint_layout(name_or_dir) is not None):
        return _load_quantized(name_or_dir, dtype, device, quantize_on_load or {}, config)
    if quantize_on_load:
        raise ValueError(f"quantize on load needs a checkpoint directory; {name_or_dir!r} is a preset")
    if name_or_dir in PRESETS:
        model = trained_preset(name_or_dir, progress) if trained else _build(name_or_dir)
        name, language = name_or_dir, LANGUAGE
        description = f"{PRESETS[name_or_dir][2]}, " + (
            "trained on a synthetic language" if trained else "random weights"
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            name_or_dir, local_files_only=True, dtype=DTYPES[dtype]
        )
        name, description = str(name_or_dir), f"{type(model).__name__} from {name_or_dir}"
    model = _ready(model.to(device=device, dtype=DTYPES[dtype]))
    return LoadedModel(model, name, f"{description}; {dtype} on {device}", config.vocab_size, language)


def _ready(model: torch.nn.Module) -> torch.nn.Module:
    if model._can_set_experts_implementation():  # an MoE model (dense ones refuse the setting)
        model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    model.config.use_cache = False  # generation re-runs the whole sequence: see measure.greedy_generate
    return model.eval()


def checkpoint_layout(directory: str):
    """The quantization a checkpoint directory declares (None: a full-precision checkpoint)."""
    from .checkpoints import detect

    return detect(directory)


def _load_quantized(directory: str, dtype: str, device: str, formats: dict, config) -> LoadedModel:
    """A checkpoint loaded quantized (its own formats, or `formats` applied as it loads) and its
    dequantized twin as the unquantized side: a comparison then measures the kernels and the
    activations' quantization; for a checkpoint quantized on load, not the weights' own error."""
    from .checkpoints import dequantized, describe, from_pretrained

    def load() -> torch.nn.Module:
        return from_pretrained(directory, dtype=DTYPES[dtype], device=device, **formats)

    facts = describe(directory)[0] if not formats else f"{directory}: quantized as it loads"
    twin = _ready(dequantized(load()))
    description = f"{type(twin).__name__} ({facts}), against its dequantized self; {dtype} on {device}"
    return LoadedModel(twin, directory, description, config.vocab_size, None, load)


def trained_preset(name: str, progress=None) -> torch.nn.Module:
    """The preset's fp32 model trained on `LANGUAGE` per `TRAINING`, from the cache when an earlier
    run trained it with the same recipe, torch and transformers."""
    transformers = _transformers()
    class_name, fields, _ = PRESETS[name]
    recipe = repr((class_name, sorted(fields.items()), LANGUAGE, sorted(TRAINING.items())))
    versions = f"{torch.__version__} {transformers.__version__}"
    path = _cache_folder() / f"{name}-{hashlib.sha256((recipe + versions).encode()).hexdigest()[:16]}.pt"
    model = _build(name)
    if path.is_file():
        model.load_state_dict(torch.load(path, weights_only=True))
        return model
    start = time.perf_counter()
    if progress:
        progress(f"training the {name} preset on its synthetic language (once; cached in {path.parent})")
    _train(model)
    logger.info("trained the %s preset in %.1f s", name, time.perf_counter() - start)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".pt")  # then renamed: readers never see half a file
    os.close(fd)
    try:
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return model


def _build(name: str) -> torch.nn.Module:
    transformers = _transformers()
    class_name, fields, _ = PRESETS[name]
    torch.manual_seed(TRAINING["seed"])
    return transformers.AutoModelForCausalLM.from_config(getattr(transformers, class_name)(**fields))


def _train(model: torch.nn.Module) -> None:
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(TRAINING["seed"])
    optimizer = torch.optim.Adam(model.parameters(), lr=TRAINING["lr"])
    model.train()
    with _one_thread():
        for _ in range(TRAINING["steps"]):
            text = LANGUAGE.sample(vocab, TRAINING["batch"], TRAINING["length"] + 1, generator)
            logits = model(text[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), text[:, 1:].reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()


@contextlib.contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _cache_folder() -> Path:
    from .kernels.cpu_avx2 import _cache_folder as quantpass_cache  # ~/.cache/quantpass, or a private temp dir

    folder = quantpass_cache() / "presets"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _transformers():
    try:
        return importlib.import_module("transformers")
    except ImportError:
        raise ValueError(
            "the built-in models need transformers: pip install 'transformers>=5' (or pip install -e '.[dev]')"
        ) from None
