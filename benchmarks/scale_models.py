"""Real-size decoder LLM folders for the scale benchmark, built offline (no hub).

Each model is the public ``config.json`` of a published checkpoint (SmolLM2-135M, Qwen3-0.6B,
Qwen2.5-1.5B) with seeded random weights, saved in bfloat16 as the real ones are published, with
the offline tokenizer of :func:`hfexport.testing.folders.offline_tokenizer` (it only produces ids
below 512; the model keeps its real vocabulary, so the embedding and LM head have their real
size). The folder is what the user's checkpoint would look like to an exporter: ``config.json``
(``"dtype": "bfloat16"``, ``architectures`` set, tied embeddings), ``model.safetensors``,
``generation_config.json`` (greedy) and the tokenizer files.

Built with little memory: the model is constructed on the ``meta`` device, given uninitialised
bfloat16 storage (``to_empty``), filled in place (normal(0, 0.02) from one seeded generator, norm
weights 1.0), its rotary ``inv_freq`` buffers recomputed and its embeddings re-tied, then saved:
one bfloat16 copy of the weights (2 bytes per parameter) is all the builder holds.

Folders are cached under ``.bench/models/<name>`` (gitignored) and reused while the key in their
``bench_model.json`` (a hash of everything that decides the weights: config values, classes,
seed, dtype, tokenizer size, builder version) matches; anything else is rebuilt.

``python benchmarks/scale_models.py NAME [ROOT]`` builds (or finds) one folder and prints
``bench_model.json``; the benchmark runs it in a child process so its own process never holds
the weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODELS_DIR = ROOT / ".bench" / "models"

#: the stamp a built folder carries: key, parameter count, spec (read without importing torch)
STAMP = "bench_model.json"
SEED = 0
INIT_STD = 0.02
DTYPE = "bfloat16"
TOKENIZER_VOCAB = 512
#: bump when the way weights are produced changes (invalidates every cached folder)
BUILDER_VERSION = 1


@dataclass(frozen=True)
class ModelSpec:
    """A decoder LLM to build: the transformers classes by name and the config values.

    Attributes:
        name: folder name under the models root (``"qwen3-0.6b"``).
        config_class: a ``transformers`` config class name (``"Qwen3Config"``).
        model_class: the causal-LM class name (``"Qwen3ForCausalLM"``), written to ``architectures``.
        config: config values (public ``config.json`` values); ``tie_word_embeddings``,
            ``architectures``, the offline tokenizer's bos/eos/pad ids (1/2/0) and ``dtype`` are
            added by :func:`make_config`.
        published_parameters: the parameter count the published checkpoint states, or ``None``.
    """

    name: str
    config_class: str
    model_class: str
    config: dict[str, Any] = field(default_factory=dict)
    published_parameters: int | None = None


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "smollm2-135m",
            "LlamaConfig",
            "LlamaForCausalLM",
            dict(
                hidden_size=576,
                intermediate_size=1536,
                num_hidden_layers=30,
                num_attention_heads=9,
                num_key_value_heads=3,
                vocab_size=49152,
                rope_theta=100000.0,
                max_position_embeddings=8192,
                rms_norm_eps=1e-5,
            ),
            published_parameters=134_515_008,
        ),
        ModelSpec(
            "qwen3-0.6b",
            "Qwen3Config",
            "Qwen3ForCausalLM",
            dict(
                hidden_size=1024,
                intermediate_size=3072,
                num_hidden_layers=28,
                num_attention_heads=16,
                num_key_value_heads=8,
                head_dim=128,
                vocab_size=151936,
                rope_theta=1000000.0,
                max_position_embeddings=40960,
                rms_norm_eps=1e-6,
            ),
            published_parameters=596_049_920,
        ),
        ModelSpec(
            "qwen2.5-1.5b",
            "Qwen2Config",
            "Qwen2ForCausalLM",
            dict(
                hidden_size=1536,
                intermediate_size=8960,
                num_hidden_layers=28,
                num_attention_heads=12,
                num_key_value_heads=2,
                vocab_size=151936,
                rope_theta=1000000.0,
                max_position_embeddings=32768,
                rms_norm_eps=1e-6,
            ),
            published_parameters=1_543_714_304,
        ),
    )
}


def model_key(spec: ModelSpec, *, seed: int = SEED) -> str:
    """A 16-hex-digit hash of everything that decides a built folder's files.

    Args:
        spec: the model.
        seed: the weight seed.

    Returns:
        The key stored in the folder's ``bench_model.json``; equal keys mean the same weights.
    """
    decided = {
        "config_class": spec.config_class,
        "model_class": spec.model_class,
        "config": spec.config,
        "seed": seed,
        "init_std": INIT_STD,
        "dtype": DTYPE,
        "tokenizer_vocab": TOKENIZER_VOCAB,
        "builder_version": BUILDER_VERSION,
    }
    return hashlib.sha256(json.dumps(decided, sort_keys=True).encode()).hexdigest()[:16]


def make_config(spec: ModelSpec) -> Any:
    """The ``transformers`` config of ``spec``: its values, tied embeddings, ``architectures``, the
    offline tokenizer's special ids (pad 0, bos 1, eos 2) and ``dtype`` bfloat16.

    Raises:
        AttributeError: ``spec.config_class`` is not a ``transformers`` class.
    """
    import transformers

    config_cls = getattr(transformers, spec.config_class)
    return config_cls(
        **spec.config,
        tie_word_embeddings=True,
        architectures=[spec.model_class],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        dtype=DTYPE,
    )


def _meta_model(spec: ModelSpec) -> Any:
    import torch
    import transformers

    model_cls = getattr(transformers, spec.model_class)
    with torch.device("meta"):
        return model_cls(make_config(spec))


def count_parameters(spec: ModelSpec) -> int:
    """Parameters of ``spec``'s model (tied embeddings counted once), on the ``meta`` device: no
    memory is allocated for the weights."""
    return sum(p.numel() for p in _meta_model(spec).parameters())


def _reset_rotary(model: Any) -> int:
    """Recompute every rotary embedding's ``inv_freq`` (and ``original_inv_freq``) buffer in float32,
    as the module's ``__init__`` does; ``to_empty`` left them uninitialised. Returns how many."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    done = 0
    for module in model.modules():
        if not hasattr(module, "inv_freq") or not hasattr(module, "rope_type"):
            continue
        if module.rope_type == "default":
            init = module.compute_default_rope_parameters
        else:
            init = ROPE_INIT_FUNCTIONS[module.rope_type]
        inv_freq, scaling = init(module.config)
        module.inv_freq = inv_freq
        if hasattr(module, "original_inv_freq"):
            module.original_inv_freq = inv_freq.clone()
        module.attention_scaling = scaling
        done += 1
    return done


def build_model_folder(spec: ModelSpec, dest: str | os.PathLike[str], *, seed: int = SEED) -> Path:
    """Build ``spec``'s model with seeded random bfloat16 weights and save it with a tokenizer.

    Args:
        spec: the model (config values and classes).
        dest: the folder to write (created; files already there are overwritten).
        seed: seed of the one ``torch.Generator`` that fills every weight, in ``named_parameters``
            order.

    Returns:
        ``Path(dest)`` holding ``config.json``, ``model.safetensors`` (bfloat16),
        ``generation_config.json`` (greedy), the tokenizer files and ``bench_model.json``
        (``{"name", "key", "parameters", "dtype", "spec"}``), written last.

    Raises:
        RuntimeError: the model has no rotary embedding to recompute, or the tied embeddings are
            not tied after saving (the builder would write a wrong checkpoint).
    """
    import torch

    from hfexport.testing.folders import offline_tokenizer

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    model = _meta_model(spec)
    model.to(getattr(torch, DTYPE))
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives every module its own tensor; tie the LM head back
    generator = torch.Generator().manual_seed(seed)
    norm_modules = {id(m) for m in model.modules() if "Norm" in type(m).__name__}
    with torch.no_grad():
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                if id(module) in norm_modules:
                    param.fill_(1.0 if name == "weight" else 0.0)
                else:
                    param.normal_(0.0, INIT_STD, generator=generator)
    if _reset_rotary(model) == 0:
        raise RuntimeError(
            f"{spec.model_class} has no rotary embedding with inv_freq; the builder expects one"
        )
    output = model.get_output_embeddings()
    if output is None or output.weight is not model.get_input_embeddings().weight:
        raise RuntimeError(f"{spec.name}: the LM head is not tied to the input embeddings")
    parameters = sum(p.numel() for p in model.parameters())
    model.generation_config.do_sample = False
    model.generation_config.pad_token_id = 0
    model.generation_config.bos_token_id = 1
    model.generation_config.eos_token_id = 2
    model.save_pretrained(dest)
    del model
    offline_tokenizer(TOKENIZER_VOCAB).save_pretrained(dest)
    stamp = {
        "name": spec.name,
        "key": model_key(spec, seed=seed),
        "parameters": parameters,
        "dtype": DTYPE,
        "seed": seed,
        "spec": {"config_class": spec.config_class, "model_class": spec.model_class, "config": spec.config},
    }
    (dest / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    return dest


def read_stamp(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ``bench_model.json`` of a built folder, or ``None`` when it is missing or unreadable."""
    try:
        return json.loads((Path(folder) / STAMP).read_text())
    except (OSError, ValueError):
        return None


def cached_folder(spec: ModelSpec, root: str | os.PathLike[str] = MODELS_DIR) -> Path | None:
    """``root/<name>`` when it holds a complete build of ``spec`` (its stamp's key matches), else ``None``."""
    folder = Path(root) / spec.name
    stamp = read_stamp(folder)
    return folder if stamp is not None and stamp.get("key") == model_key(spec) else None


def ensure_model_folder(spec: ModelSpec, root: str | os.PathLike[str] = MODELS_DIR) -> Path:
    """The cached folder of ``spec`` under ``root``, built first when missing or stale.

    A build goes to a staging folder beside the target and is renamed in when complete, so an
    interrupted build never leaves a folder that looks finished.

    Returns:
        ``root/<spec.name>``.
    """
    found = cached_folder(spec, root)
    if found is not None:
        return found
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    target = root / spec.name
    staging = root / f".{spec.name}.building-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    build_model_folder(spec, staging)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    return target


def main(argv: list[str] | None = None) -> int:
    """``scale_models.py NAME [ROOT]``: ensure the folder, print its stamp as one JSON line."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in MODELS:
        print(f"usage: scale_models.py NAME [ROOT]; NAME one of {', '.join(MODELS)}", file=sys.stderr)
        return 2
    folder = ensure_model_folder(MODELS[args[0]], Path(args[1]) if len(args) > 1 else MODELS_DIR)
    print(json.dumps({"path": str(folder), **(read_stamp(folder) or {})}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
