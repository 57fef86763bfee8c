"""Memory row: device memory held by a small Llama-style model, unquantized vs compiled with quantpass.

    python bench/memory_check.py [--format fp8_per_channel] [--device cuda]

Builds the model (seeded random weights, bf16 on CUDA), runs one forward unquantized (eager), then
compiles it with quantpass at an 8-bit format and runs one forward, and prints the bytes held after
each (`torch.cuda.memory_allocated` after a garbage collection; on CPU, the bytes of the distinct
tensor storages alive, an approximation so `device_check.sh --dry-run` runs this too) and their ratio.
An 8-bit format should hold about half the quantized layers' bytes once quantpass releases the
original weights; the ratio is printed whatever it is (exit status 0 unless the script itself fails).
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch

# Llama-style, 2 layers: the linear weights dominate (embeddings and head are 17% of the bytes).
CUDA_MODEL = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=2, num_attention_heads=16,
                  num_key_value_heads=4, vocab_size=8192)  # fmt: skip
CPU_MODEL = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024)  # fmt: skip


def held_bytes(device: torch.device) -> int:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated(device)
    storages = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu":  # real tensors only
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def build(device: torch.device):
    import transformers

    fields = CUDA_MODEL if device.type == "cuda" else CPU_MODEL
    config = transformers.LlamaConfig(**fields, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return transformers.AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).eval(), fields


def main(argv=None) -> int:
    import quantpass as qp

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--format", default="fp8_per_channel", help="an 8-bit format name")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    before = held_bytes(device)
    model, fields = build(device)
    ids = torch.randint(0, fields["vocab_size"], (1, 32), device=device)
    with torch.no_grad():
        model(ids)
        unquantized = held_bytes(device) - before
        compiled = torch.compile(model, backend=qp.backend(qp.QuantizationConfig(linear=args.format)))
        compiled(ids)
        quantized = held_bytes(device) - before
    how = "torch.cuda.memory_allocated" if device.type == "cuda" else "live CPU tensor storages (approximate)"
    print(f"memory ({how}, Llama-style {fields['num_hidden_layers']} layers, hidden {fields['hidden_size']}):")
    print(f"memory: unquantized {unquantized / 2**20:.1f} MiB, {args.format} compiled {quantized / 2**20:.1f} MiB, "
          f"ratio {quantized / max(unquantized, 1):.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
