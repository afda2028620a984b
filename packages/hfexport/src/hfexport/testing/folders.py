"""Model folders with tokenizers, built offline: what the runtimes' own loaders read in tests.

The runtimes' loaders (ONNX Runtime GenAI, transformers.js, ExecuTorch's LLM runner, OpenVINO
GenAI) read a tokenizer from the export folder, and no hub is reachable here. These helpers build
one without downloads:

* :func:`offline_tokenizer`: a byte-level BPE tokenizer (the GPT-2 scheme, the one every runtime
  tokenizer supports) trained in-process on a fixed corpus, with ``<pad>``/``<s>``/``</s>`` at
  ids 0/1/2, the ids the tiny presets use;
* :func:`tiny_model_folder`: ``save_pretrained`` of a tiny seeded model plus that tokenizer and a
  generation config (greedy);
* :func:`package_model_folder`: a real checkpoint shipped in a PyPI package (``pkg:`` sources)
  copied into a folder with a ``tokenizer.json`` (e.g. IgLM's BERT-style ``vocab.txt`` becomes a
  WordPiece ``tokenizer.json``). The package's files are copied into ``dest`` (a temporary folder
  of the test); they are never written into the repository.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

__all__ = ["MIN_BYTE_BPE_VOCAB", "offline_tokenizer", "package_model_folder", "tiny_model_folder"]

#: Smallest vocabulary a byte-level BPE can have: 256 byte tokens and the three special tokens.
MIN_BYTE_BPE_VOCAB = 259

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Exported models must compute what the eager "
    "model computes, token for token, on servers, in browsers and on phones. A tokenizer turns "
    "text into ids; the model predicts the next id; greedy decoding picks the most likely one. "
    "Hello world! Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation, too: (a) [b] {c} <d> 'e' \"f\"."
)


def offline_tokenizer(vocab_size: int = 512) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` of at most ``vocab_size`` tokens, built offline.

    Args:
        vocab_size: total tokens including ``<pad>`` (id 0), ``<s>`` (id 1, bos) and ``</s>``
            (id 2, eos); at least :data:`MIN_BYTE_BPE_VOCAB`.

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` (its ``save_pretrained`` writes ``tokenizer.json``
        and ``tokenizer_config.json``). Deterministic: equal sizes give equal tokenizers.

    Raises:
        ValueError: ``vocab_size`` below :data:`MIN_BYTE_BPE_VOCAB`.
    """
    if vocab_size < MIN_BYTE_BPE_VOCAB:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE; allowed: >= {MIN_BYTE_BPE_VOCAB} "
            "(build the tiny model with vocab_size=512, as tiny_model_folder does)"
        )
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token=None
    )
    return fast


def tiny_model_folder(
    model_type: str, dest: str | Path, *, vocab_size: int = 512, seed: int = 0, **overrides: Any
) -> Path:
    """Save a tiny seeded causal LM of ``model_type`` with an offline tokenizer into ``dest``.

    The model comes from :func:`hfexport.testing.tiny_model` (task ``text-generation``) with the
    vocabulary of :func:`offline_tokenizer` ``(vocab_size)`` (at most ``vocab_size`` tokens: the
    model emits no id the tokenizer lacks), bos/eos/pad ids 1/2/0 and ``overrides``; the
    folder holds ``config.json``, weights, ``generation_config.json`` (greedy) and the tokenizer.

    Returns:
        ``Path(dest)``; load it with ``load_model(str(dest))`` or ``from_pretrained``.
    """
    from hfexport.testing.zoo import tiny_model

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = offline_tokenizer(vocab_size)
    model, _ = tiny_model(
        model_type,
        "text-generation",
        seed=seed,
        # every id the model can emit is a token of the tokenizer (runtimes decode each new id)
        vocab_size=len(tokenizer),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **overrides,
    )
    model.generation_config.do_sample = False
    model.generation_config.bos_token_id = 1
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return dest


def package_model_folder(spec: str, dest: str | Path) -> Path:
    """Copy a real checkpoint a PyPI package ships (``pkg:`` spec) into ``dest`` with a tokenizer.json.

    Args:
        spec: ``"iglm/IgLM-S"``, ``"rxnmapper"``, ... as after ``pkg:`` (see
            :func:`hfexport.checkpoints.resolve_package_model`).
        dest: folder to create (a test's temporary folder; never inside the repository: IgLM's
            licence is non-commercial).

    Returns:
        ``Path(dest)`` holding ``config.json``, the weights and tokenizer files. A folder without a
        ``tokenizer.json`` whose ``vocab.txt`` lies in it or one folder up (IgLM) gets a WordPiece
        ``tokenizer.json`` built from that vocabulary (``[CLS]`` as bos, ``[SEP]`` as eos, ``[PAD]``
        as pad), and ``config.json``'s bos/eos/pad ids are set to those tokens when the checkpoint's
        own lie outside its vocabulary (IgLM's 50256 in a 33-token vocabulary).

    Raises:
        FileNotFoundError: the package or folder is missing.
    """
    from hfexport.checkpoints import resolve_package_model

    src = resolve_package_model(spec)
    dest = Path(dest)
    shutil.copytree(src, dest, dirs_exist_ok=True)
    if (dest / "tokenizer.json").exists():
        return dest
    vocab = next((p for p in (src / "vocab.txt", src.parent / "vocab.txt") if p.exists()), None)
    if vocab is None:
        return dest
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = vocab.read_text(encoding="utf-8").splitlines()
    ids = {t: i for i, t in enumerate(tokens) if t}
    tok = Tokenizer(models.WordPiece(vocab=ids, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split("", "isolated")]
    )
    tok.decoder = decoders.WordPiece()
    # bracketed vocabulary entries ([CLS], [HUMAN], [HEAVY] ...) are whole tokens, not characters
    tok.add_special_tokens([t for t in ids if t.startswith("[") and t.endswith("]")])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="[CLS]", eos_token="[SEP]", pad_token="[PAD]", unk_token="[UNK]"
    )
    fast.save_pretrained(dest)
    config_path = dest / "config.json"
    config = json.loads(config_path.read_text())
    vocab_size = config.get("vocab_size", len(ids))
    for key, token in (("bos_token_id", "[CLS]"), ("eos_token_id", "[SEP]"), ("pad_token_id", "[PAD]")):
        value = config.get(key)
        if value is None or not 0 <= int(value) < vocab_size:
            config[key] = ids[token]
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return dest
