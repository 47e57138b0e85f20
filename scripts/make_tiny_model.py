#!/usr/bin/env python3
"""Generate a tiny Llama checkpoint with seeded random weights for CPU vLLM tests.

Usage: ``scripts/make_tiny_model.py OUT_DIR [--seed N] [--layers N] [--kv-heads N] ...``

The directory gets ``config.json``, ``generation_config.json``, ``model.safetensors`` and a small
``kvpush_tiny_model.json`` manifest recording the generator parameters. No tokenizer is written: serve
the model with ``--skip-tokenizer-init`` and token-id prompts.

Why random weights instead of ``--load-format dummy``: vLLM's dummy weights are tiny and uniform, so greedy
output degenerates into a two-token loop that does not change even when the KV cache is corrupted. Seeded
normal weights give diverse greedy output that depends on every cached key/value, which is what the P/D
token-exactness tests need (see the shared design notes, vllm_cpu.md section 2).

The script is idempotent: if OUT_DIR already holds a model generated from identical parameters it does
nothing. Files are written to temporary names and renamed, so an interrupted run never leaves a directory
that looks complete.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MANIFEST_NAME = "kvpush_tiny_model.json"
WEIGHTS_NAME = "model.safetensors"
MANIFEST_VERSION = 1


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Everything that determines the generated checkpoint, bit for bit."""

    seed: int = 1234
    layers: int = 2
    hidden: int = 128
    intermediate: int = 256
    heads: int = 4
    kv_heads: int = 4
    vocab: int = 1024
    max_positions: int = 4096
    weight_std: float = 0.2
    embed_std: float = 1.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def validate(self) -> None:
        if min(self.layers, self.hidden, self.intermediate, self.heads, self.kv_heads, self.vocab) <= 0:
            raise ValueError("all sizes must be positive")
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} must be divisible by --heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"--heads {self.heads} must be divisible by --kv-heads {self.kv_heads}")
        if self.kv_heads % 2:
            # Heterogeneous-TP tests (P TP=1 vs D TP=2 and back) need the KV heads to split evenly.
            raise ValueError(f"--kv-heads {self.kv_heads} must be divisible by 2")
        if self.vocab < 8:
            raise ValueError("--vocab must be at least 8 (token ids 0-2 are special)")

    def hf_config(self) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "vocab_size": self.vocab,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        }

    def generation_config(self) -> dict[str, Any]:
        return {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}

    def manifest(self) -> dict[str, Any]:
        return {"version": MANIFEST_VERSION, "spec": asdict(self)}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def is_up_to_date(out_dir: Path, spec: TinyLlamaSpec) -> bool:
    """True when ``out_dir`` already holds the checkpoint that ``spec`` would generate."""
    return (
        (out_dir / WEIGHTS_NAME).is_file()
        and _read_json(out_dir / "config.json") == spec.hf_config()
        and _read_json(out_dir / "generation_config.json") == spec.generation_config()
        and _read_json(out_dir / MANIFEST_NAME) == spec.manifest()
    )


def build_weights(spec: TinyLlamaSpec) -> dict[str, Any]:
    """Seeded Llama weights in bfloat16, named as Hugging Face ``LlamaForCausalLM`` expects."""
    import torch

    gen = torch.Generator().manual_seed(spec.seed)

    def normal(*shape: int, std: float = spec.weight_std) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    def ones() -> torch.Tensor:
        return torch.ones(spec.hidden, dtype=torch.bfloat16)

    h, inter, hd = spec.hidden, spec.intermediate, spec.head_dim
    q_out, kv_out = spec.heads * hd, spec.kv_heads * hd
    weights: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": normal(spec.vocab, h, std=spec.embed_std),
        "model.norm.weight": ones(),
        "lm_head.weight": normal(spec.vocab, h),
    }
    for layer in range(spec.layers):
        prefix = f"model.layers.{layer}."
        weights[prefix + "input_layernorm.weight"] = ones()
        weights[prefix + "post_attention_layernorm.weight"] = ones()
        shapes: list[tuple[str, tuple[int, int]]] = [
            ("self_attn.q_proj", (q_out, h)),
            ("self_attn.k_proj", (kv_out, h)),
            ("self_attn.v_proj", (kv_out, h)),
            ("self_attn.o_proj", (h, q_out)),
            ("mlp.gate_proj", (inter, h)),
            ("mlp.up_proj", (inter, h)),
            ("mlp.down_proj", (h, inter)),
        ]
        for name, shape in shapes:
            weights[f"{prefix}{name}.weight"] = normal(*shape)
    return weights


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def generate(out_dir: Path, spec: TinyLlamaSpec, force: bool = False) -> bool:
    """Write the checkpoint; returns False when an identical one was already present."""
    spec.validate()
    if not force and is_up_to_date(out_dir, spec):
        return False
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    # Remove the manifest first: until it is rewritten last, the directory never looks up to date.
    (out_dir / MANIFEST_NAME).unlink(missing_ok=True)
    tmp_weights = out_dir / (WEIGHTS_NAME + ".tmp")
    save_file(build_weights(spec), str(tmp_weights), metadata={"format": "pt"})
    tmp_weights.chmod(0o644)  # safetensors creates the file owner-only
    os.replace(tmp_weights, out_dir / WEIGHTS_NAME)
    _write_json_atomic(out_dir / "config.json", spec.hf_config())
    _write_json_atomic(out_dir / "generation_config.json", spec.generation_config())
    _write_json_atomic(out_dir / MANIFEST_NAME, spec.manifest())
    return True


def parse_args(argv: list[str] | None = None) -> tuple[Path, TinyLlamaSpec, bool]:
    defaults = TinyLlamaSpec()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("out_dir", type=Path, help="output directory (created if missing)")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--layers", type=int, default=defaults.layers)
    p.add_argument("--hidden", type=int, default=defaults.hidden)
    p.add_argument("--intermediate", type=int, default=defaults.intermediate)
    p.add_argument("--heads", type=int, default=defaults.heads, help="attention (query) heads")
    p.add_argument("--kv-heads", type=int, default=defaults.kv_heads, help="KV heads; must be even")
    p.add_argument("--vocab", type=int, default=defaults.vocab)
    p.add_argument("--max-positions", type=int, default=defaults.max_positions)
    p.add_argument("--force", action="store_true", help="regenerate even if up to date")
    a = p.parse_args(argv)
    spec = TinyLlamaSpec(
        seed=a.seed,
        layers=a.layers,
        hidden=a.hidden,
        intermediate=a.intermediate,
        heads=a.heads,
        kv_heads=a.kv_heads,
        vocab=a.vocab,
        max_positions=a.max_positions,
    )
    return a.out_dir, spec, a.force


def main(argv: list[str] | None = None) -> int:
    out_dir, spec, force = parse_args(argv)
    try:
        written = generate(out_dir, spec, force=force)
    except ValueError as exc:
        sys.stderr.write(f"make_tiny_model: {exc}\n")
        return 2
    sys.stdout.write(f"{'wrote' if written else 'up to date'}: {out_dir}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
