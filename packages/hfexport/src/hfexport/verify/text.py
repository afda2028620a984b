"""Language-model metrics on a fixed text: how much a quantized causal LM loses on real prose.

A quantized causal LM is also scored teacher-forced on a fixed real text shipped with the package
(:func:`quality_text`, the first chapter and the start of the second of *Pride and Prejudice*,
about 1.2k tokens), tokenized with the model's tokenizer and run as prefills of at most
:data:`TEXT_CHUNK_TOKENS` (512) positions, as ``hfexport bench`` runs it (fewer when the model's
position limit or the program's sequence bounds say so; :func:`text_quality`), each chunk scored as
soon as the artifact returns it (:func:`validate_text`):

- ``perplexity_ratio``: the artifact's perplexity on the text over the fp32 eager model's (upper
  bound);
- ``kl_divergence``: the mean over positions of ``KL(eager || artifact)`` of the next-token
  distributions, in nats (upper bound);
- ``top1_agreement_text``: the fraction of all positions whose arg-max token equals the eager
  model's.

When ``top1_agreement_text`` is gated, the per-output ``top1_agreement`` gate of the same export
(over a few sample positions) is recorded but not applied unless ``quality_gates`` names it
(:meth:`hfexport.exporter.HfExporter.text_reference`).

Their default gates (:func:`hfexport.verify.gates.default_text_gates`) are
:data:`~hfexport.verify.gates.TEXT_GATES_8BIT` for 8-bit methods and
:data:`~hfexport.verify.gates.TEXT_GATES_4BIT` for 4-bit ones; ``config.quality_gates`` overrides them by name, and naming
one of them on an unquantized reduced-precision export turns the text metrics on there too.

The default text gates apply only when the eager model has learned something about the text: its
perplexity must be at most :data:`CHANCE_PERPLEXITY_FRACTION` (1/10) of its vocabulary size
(uniform guessing scores exactly the vocabulary size). A model with random weights (the tiny seeded
test models, ``tiny_model_folder``) scores about the vocabulary size; its next-token distributions
are near-uniform, so a 4-bit rounding flips arg-maxes at random and the metrics say nothing about
the quantization. Such an export still gets the metrics measured and reported
(``TextQuality.note`` says why they are not gated), and gates named in ``config.quality_gates`` /
``--gate`` are enforced regardless.

The gate tables and which gates an export is held to are in :mod:`hfexport.verify.gates`
(:data:`~hfexport.verify.gates.TEXT_GATES_8BIT`, :func:`~hfexport.verify.gates.text_gates_for`).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from hfexport.errors import ExportValidationError
from hfexport.tensors import cast_leaf_tensors, duplicate_leaf_tensors
from hfexport.verify.compare import Runner, eager_outputs
from hfexport.verify.gates import TEXT_METRICS, UPPER_BOUND_METRICS

__all__ = [
    "CHANCE_PERPLEXITY_FRACTION",
    "QUALITY_TEXT_FILE",
    "TEXT_CHUNK_TOKENS",
    "UNKNOWN_TOKEN_FRACTION",
    "SpilledLogits",
    "TextQuality",
    "TextReference",
    "format_text_quality",
    "is_causal_lm",
    "model_tokenizer",
    "plain_text_inputs",
    "position_limit",
    "quality_text",
    "text_chunks",
    "text_coverage_problem",
    "text_gate_message",
    "text_gates_in_force",
    "text_quality",
    "text_reference",
    "text_token_ids",
    "validate_text",
]

logger = logging.getLogger(__name__)

_UPPER_BOUND = UPPER_BOUND_METRICS

#: the default text gates apply only when the eager model's perplexity on the quality text is at most
#: this fraction of its vocabulary size (uniform guessing: the vocabulary size; a real checkpoint
#: scores far below, SmolLM2-135M 19.9 of 49152; a random-weight model about the vocabulary size):
#: the model predicts the text at least ln(10) = 2.3 nats per token better than chance
CHANCE_PERPLEXITY_FRACTION = 0.1

#: Largest share of the quality text's tokens that may be the tokenizer's unknown token for the
#: default text gates to apply (:func:`text_coverage_problem`): a tokenizer of another domain (a
#: protein LM's amino-acid vocabulary maps 98% of English prose to ``<unk>``) makes the text a run of
#: one token, which any artifact predicts.
UNKNOWN_TOKEN_FRACTION = 0.1

#: Elements scored at once by :func:`_chunk_scores` and :func:`text_gates_in_force` (float64
#: blocks of 8 MB; a block's scoring holds about three of them at once).
_CHUNK = 1 << 20

#: The longest teacher-forced prefill of the quality text, in positions: the exports' text metrics
#: (:meth:`hfexport.exporter.HfExporter.text_reference`) and ``hfexport bench`` cut the text alike
#: (:func:`text_chunks`), so both report the same numbers for the same artifact; a chunk's logits
#: are ``[1, 512, vocab]`` (100 MB at SmolLM2's 49152 in float32), scored and dropped one chunk
#: at a time (:func:`validate_text`).
TEXT_CHUNK_TOKENS = 512


def text_gates_in_force(reference: Any) -> dict[str, float]:
    """The gates of a :class:`TextReference` that :func:`validate_text` will apply: its default
    gates are dropped when the eager model is at chance on the text (:data:`CHANCE_PERPLEXITY_FRACTION`).

    The eager perplexity is the one :func:`text_reference` recorded
    (``reference.perplexity_eager``); a reference built without it is scored from its stored
    eager logits."""
    ppl, vocab = getattr(reference, "perplexity_eager", None), getattr(reference, "vocab_size", 0)
    if ppl is None:
        nll = count = 0.0
        for ids, logits in zip(reference.chunks, reference.expected, strict=True):
            logits = torch.as_tensor(logits)
            vocab = int(logits.shape[-1])
            chunk_nll, chunk_count = _eager_nll(ids, logits)
            nll += chunk_nll
            count += chunk_count
        ppl = math.exp(nll / max(count, 1))
    at_chance = not ppl <= CHANCE_PERPLEXITY_FRACTION * vocab
    return {k: v for k, v in reference.gates.items() if not (at_chance and k in reference.default_gates)}


def _eager_nll(ids: torch.Tensor, logits: torch.Tensor) -> tuple[float, int]:
    """``(sum of the next-token NLL, positions predicted)`` of int64 ``[batch, length]`` ``ids``
    under float ``[batch, length, vocab]`` ``logits`` (each row's last position predicts nothing);
    float64 in blocks of about :data:`_CHUNK` elements."""
    vocab = int(logits.shape[-1])
    targets = torch.full_like(ids, -1)
    targets[:, :-1] = ids[:, 1:]
    flat, flat_t = logits.reshape(-1, vocab), targets.reshape(-1)
    step = max(1, _CHUNK // vocab)
    nll, count = 0.0, 0
    for start in range(0, flat.shape[0], step):
        t = flat_t[start : start + step]
        has = t >= 0
        if bool(has.any()):
            logp = torch.log_softmax(flat[start : start + step][has].double(), dim=-1)
            nll -= float(logp.gather(-1, t[has].unsqueeze(-1)).sum())
            count += int(has.sum())
    return nll, count


# -- language-model metrics on a fixed text ------------------------------------------------------

#: the text file shipped in ``hfexport/data`` (see :func:`quality_text`)
QUALITY_TEXT_FILE = "quality_text.txt"


def quality_text() -> str:
    """The fixed English text the language-model metrics are measured on.

    Jane Austen, *Pride and Prejudice* (1813), chapter 1 and the start of chapter 2, as in the
    public-domain Project Gutenberg eBook #1342: 1022 words, about 1.2k tokens with a 49k BPE
    vocabulary (SmolLM2), shipped as ``hfexport/data/quality_text.txt``.

    Returns:
        The text (``str``, UTF-8 decoded, paragraphs separated by blank lines).
    """
    from importlib.resources import files

    return files("hfexport").joinpath("data", QUALITY_TEXT_FILE).read_text(encoding="utf-8")


def text_token_ids(tokenizer: Any = None, vocab_size: int | None = None) -> tuple[torch.Tensor, str]:
    """:func:`quality_text` as token ids.

    Args:
        tokenizer: the model's tokenizer (a ``transformers`` tokenizer; special tokens are not
            added); ``None`` maps the text's UTF-8 bytes to ids instead (byte ``b`` -> ``b % vocab_size``),
            for models without a tokenizer (tiny test models): the metrics are then still
            comparable between artifact and eager model, only not perplexities of real text.
        vocab_size: the model's vocabulary size; needed without a tokenizer, and ids at or above
            it are refused.

    Returns:
        ``(ids, source)``: int64 ``[n_tokens]`` and ``"tokenizer"`` or ``"utf-8 bytes"``.

    Raises:
        ValueError: no tokenizer and no ``vocab_size``, a ``vocab_size`` below 2, the text
            tokenizes to fewer than 2 tokens, or an id is outside ``[0, vocab_size)``.
    """
    text = quality_text()
    if tokenizer is not None:
        ids = torch.as_tensor(list(tokenizer(text, add_special_tokens=False)["input_ids"]), dtype=torch.long)
        source = "tokenizer"
    else:
        if vocab_size is None or int(vocab_size) < 2:
            raise ValueError(
                f"text metrics without a tokenizer need the model's vocab_size (>= 2); got {vocab_size!r}"
            )
        ids = torch.as_tensor(list(text.encode("utf-8")), dtype=torch.long) % int(vocab_size)
        source = "utf-8 bytes"
    if ids.numel() < 2:
        raise ValueError(f"the quality text tokenizes to {ids.numel()} token(s); allowed: at least 2")
    if vocab_size is not None and (int(ids.min()) < 0 or int(ids.max()) >= int(vocab_size)):
        raise ValueError(
            f"the tokenizer gives ids in [{int(ids.min())}, {int(ids.max())}], outside the model's vocabulary "
            f"[0, {int(vocab_size)}); allowed: the model's own tokenizer"
        )
    return ids, source


def text_coverage_problem(tokenizer: Any, ids: torch.Tensor) -> str | None:
    """Why the quality text says nothing about a model whose tokenizer gave ``ids``, or ``None``.

    The text is out of the tokenizer's domain when more than :data:`UNKNOWN_TOKEN_FRACTION` of its
    tokens are the tokenizer's unknown token (``tokenizer.unk_token_id``); a tokenizer without one
    (byte-level BPE covers every text) and ``tokenizer=None`` (UTF-8 bytes) always cover it.

    Args:
        tokenizer: the tokenizer :func:`text_token_ids` used, or ``None``.
        ids: int64 ``[n]`` token ids of :func:`quality_text`.

    Returns:
        A sentence naming the unknown token's share, or ``None`` when the text is covered.
    """
    unk = getattr(tokenizer, "unk_token_id", None) if tokenizer is not None else None
    if unk is None or ids.numel() == 0:
        return None
    share = float((ids == int(unk)).double().mean())
    if share <= UNKNOWN_TOKEN_FRACTION:
        return None
    return (
        f"the model's tokenizer maps {share:.0%} of the quality text to its unknown token (more than "
        f"{UNKNOWN_TOKEN_FRACTION:.0%}): the text is outside its domain, so the default text gates do not apply"
    )


def text_chunks(
    ids: torch.Tensor, *, max_length: int, batch: int = 1, exact: bool = False
) -> list[torch.Tensor]:
    """Cut ``ids`` into ``[batch, length]`` chunks run as separate prefills.

    Args:
        ids: int64 ``[n]`` token ids.
        max_length: the longest sequence a prefill may have (model position limit, program bound).
        batch: rows per chunk (a program with a static batch axis needs its sample batch).
        exact: every chunk exactly ``[batch, max_length]`` (a program with a static sequence axis);
            the remainder that does not fill one is dropped.

    Returns:
        int64 tensors ``[batch, length]``; without ``exact``, ``ceil(n / max_length)`` chunks of
        near-equal lengths (at least 2 tokens each) when ``batch`` is 1.

    Raises:
        ValueError: ``max_length`` < 2 or ``batch`` < 1, or fewer tokens than one exact chunk needs.
    """
    if max_length < 2 or batch < 1:
        raise ValueError(f"text chunks need max_length >= 2 and batch >= 1; got {max_length}, {batch}")
    n = int(ids.numel())
    if exact or batch > 1:
        per = batch * max_length
        if n < per:
            raise ValueError(
                f"the quality text has {n} tokens, fewer than one [{batch}, {max_length}] chunk of the "
                "program's static shape needs"
            )
        return [ids[i : i + per].reshape(batch, max_length) for i in range(0, n - per + 1, per)]
    count = math.ceil(n / max_length)
    bounds = [round(i * n / count) for i in range(count + 1)]
    return [ids[a:b].reshape(1, -1) for a, b in itertools.pairwise(bounds) if b - a >= 2]


@dataclass
class TextQuality:
    """Language-model metrics of an artifact against the fp32 eager model on :func:`quality_text`.

    Attributes:
        perplexity_eager / perplexity_artifact: ``exp`` of the mean next-token negative
            log-likelihood over the text (every position but each chunk's last predicts the next token).
        perplexity_ratio: artifact over eager perplexity (1.0: no loss).
        kl_divergence: mean over all positions of ``KL(eager || artifact)`` of the next-token
            distributions, in nats.
        kl_divergence_max: the largest per-position KL.
        top1_agreement_text: fraction of all positions whose arg-max equals the eager model's.
        tokens: positions scored; chunks / chunk_length: how the text was cut (longest chunk).
        tokenizer: ``"tokenizer"`` (the model's) or ``"utf-8 bytes"``.
        vocab_size: the logits' last axis.
        gates / failures / ok: as :class:`OutputQuality` (``"metric = value (gate <= t, missed by m)"``);
            ``gates`` holds the gates applied.
        note: why default gates were not applied (the eager model at chance on the text, see
            :data:`CHANCE_PERPLEXITY_FRACTION`), or ``""``.
    """

    perplexity_eager: float
    perplexity_artifact: float
    perplexity_ratio: float
    kl_divergence: float
    kl_divergence_max: float
    top1_agreement_text: float
    tokens: int
    chunks: int
    chunk_length: int
    tokenizer: str = "tokenizer"
    vocab_size: int = 0
    gates: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    ok: bool = True
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict with ``kind = "text_quality"`` and ``name = "text"``."""
        out = asdict(self)
        out.update(kind="text_quality", name="text")
        for key, value in out.items():
            if isinstance(value, float) and not math.isfinite(value):
                out[key] = str(value)
        return out


def _rows(logits: Any, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of ``[rows, vocab]`` logits: a tensor's slice, or read from a :class:`SpilledLogits`."""
    if isinstance(logits, SpilledLogits):
        return logits.rows(start, stop)
    return logits[start:stop]


def _chunk_scores(expected: Any, actual: torch.Tensor, targets: torch.Tensor) -> tuple[float, ...]:
    """Sums over the rows of ``[rows, vocab]`` logits (``expected`` may be a :class:`SpilledLogits`
    of that shape, read block by block): eager NLL and artifact NLL of ``targets``
    (rows with target -1 skipped), KL(eager || artifact), its max, arg-max agreements; float64 in
    blocks of about :data:`_CHUNK` elements, computed in place (a block's scoring holds its two
    float64 log-probability blocks and one float64 cast at a time)."""
    vocab = expected.shape[-1]
    step = max(1, _CHUNK // vocab)
    nll_e = nll_a = kl_sum = agree = 0.0
    kl_max = 0.0
    for start in range(0, expected.shape[0], step):
        e = torch.log_softmax(_rows(expected, start, start + step).double(), dim=-1)
        a = torch.log_softmax(actual[start : start + step].double(), dim=-1)
        a.nan_to_num_(nan=-math.inf)
        t = targets[start : start + step]
        has = t >= 0
        if bool(has.any()):
            idx = t[has].unsqueeze(-1)
            nll_e -= float(e[has].gather(-1, idx).sum())
            nll_a -= float(a[has].gather(-1, idx).sum())
        agree += float((e.argmax(-1) == a.argmax(-1)).sum())
        # KL terms p * (log p - log q), 0 where p = 0 (0 * -inf would be nan): in place on a and e
        terms = a.neg_().add_(e)
        p = e.exp_()
        terms.mul_(p).masked_fill_(p == 0, 0.0)
        kl = terms.sum(-1)
        kl_sum += float(kl.sum())
        kl_max = max(kl_max, float(kl.max()))
        del e, a, p, terms
    return nll_e, nll_a, kl_sum, kl_max, agree


class _TextScores:
    """Running sums of the text metrics over the chunks scored so far (:func:`text_quality`,
    :func:`validate_text`): each chunk is scored when both logits are at hand and then dropped."""

    def __init__(self) -> None:
        self.nll_e = self.nll_a = self.kl_sum = self.agree = self.kl_max = 0.0
        self.predicted = self.positions = self.chunks = self.chunk_length = 0
        self.vocab_size = 0

    def add(self, index: int, ids: torch.Tensor, exp: Any, got: Any) -> None:
        """Score chunk ``index``: int64 ``ids`` ``[batch, length]``, eager and artifact logits
        ``[batch, length, vocab]``.

        Raises:
            ValueError: the two logits' shapes differ, or do not match ``ids``.
        """
        exp_t = exp if isinstance(exp, SpilledLogits) else torch.as_tensor(exp).detach()
        got_t = torch.as_tensor(got).detach()
        if tuple(exp_t.shape) != tuple(got_t.shape) or tuple(exp_t.shape[:2]) != tuple(ids.shape):
            raise ValueError(
                f"text chunk {index}: artifact logits {tuple(got_t.shape)} vs eager {tuple(exp_t.shape)} "
                f"for tokens {tuple(ids.shape)}; allowed: [batch, length, vocab] logits of every position"
            )
        targets = torch.full_like(ids, -1)
        targets[:, :-1] = ids[:, 1:]
        flat_e = exp_t.flat() if isinstance(exp_t, SpilledLogits) else exp_t.reshape(-1, exp_t.shape[-1])
        scores = _chunk_scores(flat_e, got_t.reshape(-1, got_t.shape[-1]), targets.reshape(-1))
        self.nll_e += scores[0]
        self.nll_a += scores[1]
        self.kl_sum += scores[2]
        self.kl_max = max(self.kl_max, scores[3])
        self.agree += scores[4]
        self.predicted += int((targets >= 0).sum())
        self.positions += int(ids.numel())
        self.chunks += 1
        self.chunk_length = max(self.chunk_length, int(ids.shape[-1]))
        self.vocab_size = int(exp_t.shape[-1])

    def result(
        self,
        *,
        gates: Mapping[str, float] | None,
        tokenizer: str,
        default_gates: Collection[str],
    ) -> TextQuality:
        """The :class:`TextQuality` of the chunks added, with ``gates`` applied (see :func:`text_quality`)."""
        nll_e, nll_a, kl_sum = self.nll_e, self.nll_a, self.kl_sum
        predicted, positions = self.predicted, self.positions
        ppl_e = math.exp(nll_e / max(predicted, 1))
        ppl_a = math.exp(nll_a / max(predicted, 1)) if math.isfinite(nll_a) else math.inf
        result = TextQuality(
            perplexity_eager=ppl_e,
            perplexity_artifact=ppl_a,
            perplexity_ratio=ppl_a / ppl_e if math.isfinite(ppl_a) else math.inf,
            kl_divergence=kl_sum / positions if math.isfinite(kl_sum) else math.inf,
            kl_divergence_max=self.kl_max,
            top1_agreement_text=self.agree / positions,
            tokens=positions,
            chunks=self.chunks,
            chunk_length=self.chunk_length,
            tokenizer=tokenizer,
            vocab_size=self.vocab_size,
        )
        gates = {k: float(v) for k, v in (gates or {}).items() if k in TEXT_METRICS}
        skipped = sorted(set(gates) & set(default_gates))
        chance = CHANCE_PERPLEXITY_FRACTION * result.vocab_size
        if skipped and not ppl_e <= chance:
            result.note = (
                f"default gates of {', '.join(skipped)} not applied: the fp32 eager model is at chance on the "
                f"text (perplexity {ppl_e:.1f}, above {CHANCE_PERPLEXITY_FRACTION:g} x its vocabulary of "
                f"{result.vocab_size}; random weights?), so the metrics measure noise; name them in "
                "quality_gates / --gate to gate them"
            )
            gates = {k: v for k, v in gates.items() if k not in skipped}
        for metric, threshold in gates.items():
            value = float(getattr(result, metric))
            result.gates[metric] = float(threshold)
            upper = metric in _UPPER_BOUND
            missed = not value <= threshold if upper else not value >= threshold
            if missed:
                margin = value - threshold if upper else threshold - value
                result.failures.append(
                    f"{metric} = {value:.4f} (gate {'<=' if upper else '>='} {threshold:g}, missed by {margin:.4f})"
                )
        result.ok = not result.failures
        return result


def text_quality(
    chunks: list[torch.Tensor],
    expected: list[torch.Tensor],
    actual: list[torch.Tensor],
    *,
    gates: Mapping[str, float] | None = None,
    tokenizer: str = "tokenizer",
    default_gates: Collection[str] = (),
) -> TextQuality:
    """Score an artifact's next-token logits against the eager model's on the same text chunks.

    Args:
        chunks: the int64 ``[batch, length]`` token chunks both were run on (:func:`text_chunks`).
        expected: the fp32 eager logits per chunk, ``[batch, length, vocab]`` (any float dtype).
        actual: the artifact's logits per chunk, same shapes (compared in float64, in blocks, so
            no ``[tokens, vocab]`` float64 tensor is ever whole).
        gates: ``{metric: threshold}`` over :data:`TEXT_METRICS` (``perplexity_ratio`` and
            ``kl_divergence`` upper bounds, ``top1_agreement_text`` a lower bound); ``None``: none.
        tokenizer: how the text was tokenized, recorded.
        default_gates: the metrics of ``gates`` that are defaults rather than asked for: they are
            applied only when the eager perplexity is at most :data:`CHANCE_PERPLEXITY_FRACTION` of
            the vocabulary size (else ``note`` says why they were not).

    Returns:
        A :class:`TextQuality`; ``failures`` names each missed metric, its value, the gate and the
        margin it missed by.

    Raises:
        ValueError: the lists differ in length, or an artifact chunk's shape differs from eager's
            (the message names the chunk and both shapes).
    """
    if not (len(chunks) == len(expected) == len(actual)) or not chunks:
        raise ValueError(
            f"text quality needs as many eager and artifact logits as chunks; got {len(chunks)} chunks, "
            f"{len(expected)} eager, {len(actual)} artifact"
        )
    scores = _TextScores()
    for index, (ids, exp, got) in enumerate(zip(chunks, expected, actual, strict=True)):
        scores.add(index, ids, exp, got)
    return scores.result(gates=gates, tokenizer=tokenizer, default_gates=default_gates)


def format_text_quality(result: TextQuality, title: str = "") -> str:
    """Render a :class:`TextQuality` as a few fixed-width lines (one per metric, with its gate)."""
    lines = [title] if title else []
    lines.append(
        f"text: {result.tokens} positions in {result.chunks} chunk(s) of <= {result.chunk_length} "
        f"({result.tokenizer}); perplexity eager {result.perplexity_eager:.3f}, artifact {result.perplexity_artifact:.3f}"
    )
    for metric in TEXT_METRICS:
        value = float(getattr(result, metric))
        gate = result.gates.get(metric)
        relation = "<=" if metric in _UPPER_BOUND else ">="
        gate_text = f"gate {relation} {gate:g}" if gate is not None else "not gated"
        missed = any(f.startswith(f"{metric} ") for f in result.failures)
        lines.append(f"  {metric:<20} {value:>10.4f}  {gate_text:<16} {'NO' if missed else 'yes'}")
    if result.note:
        lines.append(f"  ({result.note})")
    return "\n".join(lines)


def model_tokenizer(model: Any) -> Any:
    """The tokenizer saved next to ``model``'s weights (``model.config._name_or_path`` a folder with
    tokenizer files), or ``None`` (no folder, no tokenizer files, or loading it failed: logged)."""
    import os

    source = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    if not source or not os.path.isdir(source):
        return None
    if not any(os.path.exists(os.path.join(source, n)) for n in ("tokenizer.json", "tokenizer_config.json")):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source, local_files_only=True)
    except Exception as exc:  # a broken tokenizer folder: fall back to bytes, say so
        logger.warning(
            "text metrics: loading the tokenizer of %s failed (%s); using UTF-8 bytes", source, exc
        )
        return None


class SpilledLogits:
    """Float32 logits ``[batch, length, vocab]`` kept in a file instead of memory, read back in
    row blocks (:func:`validate_text` scores a chunk block by block, so only one block of the
    eager logits is in memory at a time).

    Args:
        logits: the float32 logits to write (any shape with the vocabulary last).
        path: the file to write them to (raw little-endian float32, C order).

    Attributes:
        shape: the logits' shape (``torch.Size``); ``flat()`` views them as ``[rows, vocab]``.
    """

    def __init__(self, logits: torch.Tensor, path: str | os.PathLike[str]) -> None:
        array = logits.detach().to(torch.float32).contiguous().numpy()
        self.path = os.fspath(path)
        array.tofile(self.path)
        self.shape = torch.Size(logits.shape)

    def flat(self) -> SpilledLogits:
        """The same file viewed as ``[rows, vocab]``."""
        view = object.__new__(SpilledLogits)
        view.path = self.path
        view.shape = torch.Size([math.prod(self.shape[:-1]), self.shape[-1]])
        return view

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of the ``[rows, vocab]`` view, float32 (a new tensor)."""
        vocab = int(self.shape[-1])
        total = math.prod(self.shape[:-1])
        start, stop = max(0, start), min(stop, total)
        if stop <= start:
            return torch.empty(0, vocab)
        data = np.fromfile(
            self.path, dtype=np.float32, count=(stop - start) * vocab, offset=start * vocab * 4
        )
        return torch.from_numpy(data.reshape(stop - start, vocab))

    def load(self) -> torch.Tensor:
        """All of the logits as one float32 tensor of :attr:`shape`."""
        return torch.from_numpy(np.fromfile(self.path, dtype=np.float32).reshape(tuple(self.shape)))


@dataclass
class TextReference:
    """The eager side of the text metrics: the chunk inputs and the fp32 eager logits on them.

    Attributes:
        chunks: int64 ``[batch, length]`` token chunks (:func:`text_chunks`).
        inputs: the forward kwargs of each chunk (what the artifact is run on).
        expected: the eager logits per chunk, float32 ``[batch, length, vocab]``: tensors, or
            :class:`SpilledLogits` in a temporary folder (``text_reference(spill=True)``; the
            folder is deleted with the reference). :meth:`expected_logits` loads either.
        gates: the text gates (:func:`text_gates_for`).
        tokenizer: ``"tokenizer"`` or ``"utf-8 bytes"``.
        logits_key: the output name of the logits (``"logits"``).
        default_gates: the metrics of ``gates`` that are defaults, not named in ``quality_gates``
            (applied only when the eager model is not at chance, see :func:`text_quality`).
        artifact_dtype: the artifact's compute dtype (``"float16"`` ...): the floating point tensors
            of ``inputs`` (an empty KV cache of a decoder graph) are cast to it before the artifact
            runs, as :func:`hfexport.verify.gates.validate_quality` does; ``None``/``"float32"``:
            unchanged.
        perplexity_eager: the eager model's perplexity on the text, measured by
            :func:`text_reference` (decides :func:`text_gates_in_force`); ``None``: not measured.
        vocab_size: the eager logits' last axis (0: not recorded).
    """

    chunks: list[torch.Tensor]
    inputs: list[dict[str, Any]]
    expected: list[Any]
    gates: dict[str, float]
    tokenizer: str = "tokenizer"
    logits_key: str = "logits"
    default_gates: tuple[str, ...] = ()
    artifact_dtype: str | None = None
    perplexity_eager: float | None = None
    vocab_size: int = 0
    #: the temporary folder of spilled logits (removed when the reference is garbage collected)
    spill_folder: Any = field(default=None, repr=False)

    def expected_logits(self, index: int) -> torch.Tensor:
        """The eager logits of chunk ``index`` as one float32 tensor (a spilled chunk is read whole)."""
        stored = self.expected[index]
        return stored.load() if isinstance(stored, SpilledLogits) else stored


def text_reference(
    model: torch.nn.Module,
    make_inputs: Callable[[torch.Tensor], dict[str, Any]],
    chunks: list[torch.Tensor],
    *,
    gates: Mapping[str, float],
    tokenizer: str = "tokenizer",
    logits_key: str = "logits",
    default_gates: Collection[str] = (),
    artifact_dtype: str | None = None,
    spill: bool = False,
) -> TextReference:
    """Run the eager ``model`` on every text chunk (teacher-forced, one prefill per chunk).

    Args:
        model: the eager reference (float32).
        make_inputs: token chunk ``[batch, length]`` -> forward kwargs for both model and artifact.
        chunks: from :func:`text_chunks`.
        gates: the text gates to apply later.
        tokenizer: how the text was tokenized.
        logits_key: the output leaf path of the logits.
        default_gates: the metrics of ``gates`` that are defaults (:func:`text_default_gates`).
        artifact_dtype: the artifact's compute dtype (``config.dtype``; see :class:`TextReference`).
        spill: write each chunk's eager logits to a temporary folder (:class:`SpilledLogits`) as
            soon as they are computed instead of holding them (``chunks x [batch, length, vocab]``
            float32: 269 MB for SmolLM2's 1370 positions); :func:`validate_text` reads them back
            one row block at a time.

    Returns:
        A :class:`TextReference` (``perplexity_eager`` and ``vocab_size`` recorded).

    Raises:
        ValueError: the model's outputs have no ``logits_key``.
        OSError: the temporary folder cannot be written (``spill``).
    """
    import tempfile

    inputs = [make_inputs(c) for c in chunks]
    folder = tempfile.TemporaryDirectory(prefix="hfexport-text-") if spill else None
    expected: list[Any] = []
    nll = count = 0.0
    vocab = 0
    for index, (ids, kwargs) in enumerate(zip(chunks, inputs, strict=True)):
        out = eager_outputs(model, kwargs)
        if logits_key not in out:
            raise ValueError(
                f"text metrics need the model's {logits_key!r} output; it returned {sorted(out)}"
            )
        logits = out[logits_key].detach().float()
        del out
        vocab = int(logits.shape[-1])
        chunk_nll, chunk_count = _eager_nll(ids, logits)
        nll += chunk_nll
        count += chunk_count
        if folder is not None:
            expected.append(SpilledLogits(logits, os.path.join(folder.name, f"chunk{index}.f32")))
        else:
            expected.append(logits)
        del logits
    return TextReference(
        list(chunks),
        inputs,
        expected,
        dict(gates),
        tokenizer,
        logits_key,
        tuple(sorted(default_gates)),
        artifact_dtype,
        perplexity_eager=math.exp(nll / max(count, 1)),
        vocab_size=vocab,
        spill_folder=folder,
    )


def validate_text(
    reference: TextReference, run: Runner, *, label: str = "text", raise_on_failure: bool = True
) -> TextQuality:
    """Run the artifact on the text chunks of ``reference`` and score it (:func:`text_quality`).

    One chunk at a time: the artifact's logits of a chunk are scored as soon as they are returned
    and dropped before the next chunk runs, against the eager logits held or, spilled
    (:class:`SpilledLogits`), read back one row block at a time: memory holds one chunk's
    ``[batch, length, vocab]`` artifact logits, not the whole text's.

    Args:
        reference: from :func:`text_reference`.
        run: the backend runner (forward kwargs -> ``{output_name: tensor}``).
        label: name of this check in messages.
        raise_on_failure: raise when a text gate is missed.

    Returns:
        The :class:`TextQuality`.

    Raises:
        ExportValidationError: a text gate is missed (the message names the metric, its value, the
            gate, the margin and how to override it), or the artifact returns no logits.
        ValueError: an artifact chunk's logits are not shaped like the eager ones.
    """
    cast = getattr(torch, reference.artifact_dtype) if reference.artifact_dtype else None
    scores = _TextScores()
    for index, (ids, kwargs) in enumerate(zip(reference.chunks, reference.inputs, strict=True)):
        feed = duplicate_leaf_tensors(dict(kwargs))
        if cast is not None and cast != torch.float32:  # the artifact's float inputs (empty caches)
            feed = cast_leaf_tensors(feed, cast)
        out = run(feed)
        del feed
        if reference.logits_key not in out:
            raise ExportValidationError(
                f"the artifact returned no {reference.logits_key!r} output on the quality text; outputs: {sorted(out)}"
            )
        actual = torch.as_tensor(out[reference.logits_key]).detach().float()
        del out  # the artifact's other outputs (a decoder graph's present keys/values)
        scores.add(index, ids, reference.expected[index], actual)  # spilled: read block by block
        del actual
    if not scores.chunks:
        raise ValueError("text quality needs at least one chunk; the reference has none")
    result = scores.result(
        gates=reference.gates, tokenizer=reference.tokenizer, default_gates=reference.default_gates
    )
    table = format_text_quality(result, title=f"quality on the {label} vs fp32 eager")
    logger.info("%s", table)
    if raise_on_failure and not result.ok:
        raise ExportValidationError(text_gate_message(result, table, label=label), [result])
    return result


def text_gate_message(result: TextQuality, table: str, *, label: str = "text") -> str:
    """The message of a missed text gate: each missed metric with its value, gate and margin, the
    table, and the override (``config.quality_gates`` / ``--gate``) that would let it pass."""
    example: dict[str, float] = {}
    for failure in result.failures:
        metric = failure.split(" = ")[0]
        value = float(getattr(result, metric))
        if metric in _UPPER_BOUND:
            example[metric] = math.ceil(value * 1000 + 1) / 1000
        else:
            example[metric] = max(math.floor(value * 100 - 1) / 100, 0.0)
    return (
        f"the artifact misses its text quality gates against the fp32 eager model on the {label} "
        f"(hfexport.quality.quality_text, teacher-forced): {'; '.join(result.failures)}.\n{table}\n"
        f"Relax the missed gate if the loss is acceptable (config.quality_gates={example}, CLI "
        + " ".join(f"--gate {m}={v}" for m, v in example.items())
        + "), or quantize less (quantization.exclude, 8-bit instead of 4-bit)."
    )


#: the inputs a plain causal-LM export may take for the text metrics to build them from token ids
_TEXT_INPUTS = ("input_ids", "attention_mask", "position_ids", "token_type_ids")


def is_causal_lm(model: Any) -> bool:
    """True for a decoder-only ``transformers`` causal LM (``*ForCausalLM``, not encoder-decoder)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    return type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))


def position_limit(model: Any) -> int | None:
    """The model's sequence-length limit from its config (``max_position_embeddings``,
    ``n_positions``, ``max_sequence_length``), or ``None``."""
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def plain_text_inputs(
    model: Any,
    inputs: Mapping[str, Any],
    program_axes: list[Mapping[str, Any]] | None,
    *,
    max_length: int = TEXT_CHUNK_TOKENS,
) -> tuple[Callable[[torch.Tensor], dict[str, Any]], dict[str, Any]] | str:
    """How to feed the quality text to a plain causal-LM export (no cache inputs).

    Args:
        model: the eager model.
        inputs: the export's sample forward kwargs.
        program_axes: ``report.dynamic_axes`` (:func:`hfexport.program_axes.program_input_axes`):
            a dynamic sequence axis bounds the chunk length by its ``max``; an axis absent or static
            fixes it to the sample size.
        max_length: the longest chunk ever used (:data:`TEXT_CHUNK_TOKENS`).

    Returns:
        ``(make_inputs, chunking)``: ``make_inputs`` turns an int64 ``[batch, length]`` chunk into
        forward kwargs shaped like ``inputs`` (mask of ones, positions ``0..length-1``, token types
        0, ``use_cache`` and other non-tensor kwargs kept), ``chunking`` the keyword arguments of
        :func:`text_chunks`; or a string saying why the text cannot be fed (inputs other than
        :data:`_TEXT_INPUTS`, no ``input_ids``).
    """
    if not is_causal_lm(model):
        return f"{type(model).__name__} is not a causal LM"
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return "the sample inputs have no 2-D input_ids"
    others = [
        k
        for k, v in inputs.items()
        if k not in _TEXT_INPUTS and v is not None and not isinstance(v, (bool, int, float, str))
    ]
    if others:
        return (
            f"the sample inputs hold {others} besides token ids (a cache or embeddings): not a plain prefill"
        )
    axes = {(a.get("input"), a.get("axis")): a for a in program_axes or []}
    seq_axis, batch_axis = axes.get(("input_ids", 1)), axes.get(("input_ids", 0))
    limit = position_limit(model) or max_length
    chunking: dict[str, Any]
    if seq_axis is not None and seq_axis.get("status") == "dynamic":
        high = seq_axis.get("max")
        length = min(limit, max_length, int(high) if high is not None else max_length)
        chunking = {"max_length": length, "exact": False}
    else:
        chunking = {"max_length": int(ids.shape[1]), "exact": True}
    dynamic_batch = (
        batch_axis is not None and batch_axis.get("status") == "dynamic" and (batch_axis.get("min") or 1) <= 1
    )
    chunking["batch"] = 1 if dynamic_batch or ids.shape[0] == 1 else int(ids.shape[0])
    if chunking["batch"] > 1:
        chunking["exact"] = True

    def make_inputs(chunk: torch.Tensor) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in inputs.items():
            if key == "input_ids":
                out[key] = chunk.to(value.dtype)
            elif key == "attention_mask" and isinstance(value, torch.Tensor):
                out[key] = torch.ones(chunk.shape, dtype=value.dtype)
            elif key == "position_ids" and isinstance(value, torch.Tensor):
                out[key] = torch.arange(chunk.shape[1], dtype=value.dtype).expand(chunk.shape).clone()
            elif key == "token_type_ids" and isinstance(value, torch.Tensor):
                out[key] = torch.zeros(chunk.shape, dtype=value.dtype)
            else:
                out[key] = value
        return out

    return make_inputs, chunking
