"""Load the shared regression cases (``shared/cases/*.toml``) and build their models and inputs.

A case file names a model type, an auto class and config overrides, how to make its sample
inputs (and optionally a second input shape), which backends must handle it, and what must hold
afterwards (see the ``README.md`` next to the cases). This module turns one file into a
:class:`Case` whose :meth:`Case.build_model`, :meth:`Case.sample_inputs` and
:meth:`Case.second_inputs` give a seeded random-weight model and deterministic inputs.

Input specifications understood in ``[inputs]`` / ``[second_inputs]``:

* ``{ shape = [...], dtype = "int64", high = N }``: integers drawn uniformly from ``[low, N)``
  (``low`` defaults to 0, as the schema says);
* ``{ shape = [...], dtype = "float32" }``: standard normal values of that floating dtype;
* ``{ ones = [...] }``: int64 ones;
* ``{ rows = [[...], ...] }``: an int64 tensor of exactly those rows;
* ``{ rows_from_padding = true }``: int64 ``input_ids != pad_token_id`` (needs ``input_ids``);
* a plain string entry (``note = "..."``) is a comment, not an input;
* a spec that only carries a ``note``, or a section that is only a note, is free text: it is
  built by a hand-written builder registered for that case (C04, C12).

Random values come from a ``torch.Generator`` seeded with 0 for ``[inputs]`` and 1 for
``[second_inputs]``, consumed in file order, so every call gives the same tensors.
"""

from __future__ import annotations

import copy
import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, PreTrainedModel

__all__ = [
    "CASES_DIR_ENV",
    "Case",
    "find_cases_dir",
    "list_cases",
    "load_case",
    "tiny_model_from_case",
]

#: Environment variable naming the cases directory; it wins over the search next to the repo.
CASES_DIR_ENV = "HFEXPORT_CASES_DIR"

_SAMPLE_SEED = 0
_SECOND_SEED = 1

_DTYPES: dict[str, torch.dtype] = {
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

Inputs = dict[str, torch.Tensor]
# (case, section name, model config, generator) -> inputs of that section
_NoteBuilder = Callable[["Case", str, Any, torch.Generator], Inputs]


def find_cases_dir() -> Path:
    """Locate the shared cases directory.

    Looks first at the ``HFEXPORT_CASES_DIR`` environment variable, then walks up from the
    current directory and from this file's location, returning the first ``<ancestor>/shared/cases``
    that exists. With the repository at ``/work/main`` that is ``/work/shared/cases``, the
    ``shared`` directory next to the repository.

    Returns:
        The directory holding the ``*.toml`` case files.

    Raises:
        FileNotFoundError: ``HFEXPORT_CASES_DIR`` names a missing directory, or no
            ``shared/cases`` directory was found.
    """
    env = os.environ.get(CASES_DIR_ENV)
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"{CASES_DIR_ENV}={env!r} is not a directory")
        return path
    starts = [Path.cwd().resolve(), Path(__file__).resolve().parent]
    for start in starts:
        for ancestor in (start, *start.parents):
            candidate = ancestor / "shared" / "cases"
            if candidate.is_dir():
                return candidate
    raise FileNotFoundError(
        f"no shared/cases directory found above {', '.join(map(str, starts))}; "
        f"set {CASES_DIR_ENV} to the directory holding the case files"
    )


@dataclass
class Case:
    """One shared regression case, as read from its TOML file.

    Attributes:
        name: file stem, e.g. ``"C09-left-padding"``.
        pattern: the kind of fault the case stands for.
        model_type: ``transformers`` model type to build.
        auto_class: name of the ``transformers`` auto class building the model.
        backends: exporters that must handle the case (``"dynamo"``, ``"onnx"``, ``"executorch"``).
        dynamic: whether the case is exported with dynamic shapes.
        attn_implementation: attention implementation to build with; ``None`` = library default.
        config: overrides for ``AutoConfig.for_model``.
        expect: what must hold (``output``, ``atol``, ``note``, ...).
        inputs_spec: the raw ``[inputs]`` table.
        second_inputs_spec: the raw ``[second_inputs]`` table, ``None`` when absent.
        path: the file the case was read from.
    """

    name: str
    pattern: str
    model_type: str
    auto_class: str
    backends: list[str]
    dynamic: bool
    attn_implementation: str | None
    config: dict[str, Any]
    expect: dict[str, Any]
    inputs_spec: dict[str, Any] = field(default_factory=dict)
    second_inputs_spec: dict[str, Any] | None = None
    path: Path | None = None

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> Case:
        """Read a case file.

        Raises:
            FileNotFoundError: the file does not exist.
            ValueError: a required key (``model_type``, ``auto_class``, ``inputs``) is missing.
        """
        path = Path(path)
        with path.open("rb") as f:
            data = tomllib.load(f)
        missing = [key for key in ("model_type", "auto_class", "inputs") if key not in data]
        if missing:
            raise ValueError(f"case {path} lacks required key(s): {', '.join(missing)}")
        return cls(
            name=path.stem,
            pattern=data.get("pattern", ""),
            model_type=data["model_type"],
            auto_class=data["auto_class"],
            backends=list(data.get("backends", [])),
            dynamic=bool(data.get("dynamic", False)),
            attn_implementation=data.get("attn_implementation"),
            config=dict(data.get("config", {})),
            expect=dict(data.get("expect", {})),
            inputs_spec=dict(data["inputs"]),
            second_inputs_spec=dict(data["second_inputs"]) if "second_inputs" in data else None,
            path=path,
        )

    def build_config(self) -> transformers.PretrainedConfig:
        """Return ``AutoConfig.for_model(model_type, **config)`` (the case's dict is not mutated)."""
        return AutoConfig.for_model(self.model_type, **copy.deepcopy(self.config))

    def build_model(self) -> PreTrainedModel:
        """Build the case's model: seeded with ``torch.manual_seed(0)``, random weights, eval mode.

        Returns:
            ``getattr(transformers, auto_class).from_config(config, attn_implementation=...)``
            in eval mode (float32, CPU); the attention implementation is only passed when the
            case names one.

        Raises:
            ValueError: ``auto_class`` is not a ``transformers`` attribute.
        """
        auto_cls = getattr(transformers, self.auto_class, None)
        if auto_cls is None:
            raise ValueError(f"case {self.name}: transformers has no {self.auto_class!r}")
        config = self.build_config()
        kwargs: dict[str, Any] = {}
        if self.attn_implementation is not None:
            kwargs["attn_implementation"] = self.attn_implementation
        torch.manual_seed(0)
        return auto_cls.from_config(config, **kwargs).eval()

    def sample_inputs(self, model: PreTrainedModel | None = None) -> Inputs:
        """Build the ``[inputs]`` forward kwargs.

        Args:
            model: the case's model; only its config is read (special ids, vocab, vision sizes).
                ``None`` builds the config from the case.

        Returns:
            A dict of CPU tensors (dtypes per spec: int64 ids and masks, float32 features).

        Raises:
            ValueError: a spec the loader does not understand.
            NotImplementedError: a free-text spec with no builder registered for this case.
        """
        return self._make(self.inputs_spec, "inputs", model, _SAMPLE_SEED)

    def second_inputs(self, model: PreTrainedModel | None = None) -> Inputs | None:
        """Build the ``[second_inputs]`` forward kwargs, or return ``None`` when the case has none.

        Same arguments, return types and errors as :meth:`sample_inputs`.
        """
        if self.second_inputs_spec is None:
            return None
        return self._make(self.second_inputs_spec, "second_inputs", model, _SECOND_SEED)

    def _make(self, spec: dict[str, Any], section: str, model: PreTrainedModel | None, seed: int) -> Inputs:
        config = model.config if model is not None else self.build_config()
        gen = torch.Generator().manual_seed(seed)
        tensor_specs = {k: v for k, v in spec.items() if isinstance(v, dict)}
        needs_builder = not tensor_specs or any(set(v) <= {"note"} for v in tensor_specs.values())
        if needs_builder:
            builder = _NOTE_BUILDERS.get(self.name)
            if builder is None:
                raise NotImplementedError(
                    f"case {self.name} [{section}] is described in free text; register a builder "
                    f"for it in hfexport.testing.cases._NOTE_BUILDERS"
                )
            return builder(self, section, config, gen)
        out: Inputs = {}
        for key, value in tensor_specs.items():
            out[key] = _tensor_from_spec(self.name, key, value, gen, out, config)
        return out


def _tensor_from_spec(
    case_name: str, key: str, spec: dict[str, Any], gen: torch.Generator, done: Inputs, config: Any
) -> torch.Tensor:
    where = f"case {case_name}: input {key!r}"
    if "rows" in spec:
        return torch.tensor(spec["rows"], dtype=_DTYPES[spec.get("dtype", "int64")])
    if "ones" in spec:
        return torch.ones(spec["ones"], dtype=_DTYPES[spec.get("dtype", "int64")])
    if spec.get("rows_from_padding"):
        if "input_ids" not in done:
            raise ValueError(f"{where}: rows_from_padding needs input_ids listed before it")
        return (done["input_ids"] != _pad_id(config)).to(torch.int64)
    if "shape" in spec:
        dtype_name = spec.get("dtype", "int64")
        if dtype_name not in _DTYPES:
            raise ValueError(f"{where}: unknown dtype {dtype_name!r}; known: {', '.join(_DTYPES)}")
        dtype = _DTYPES[dtype_name]
        shape = tuple(spec["shape"])
        if dtype.is_floating_point:
            return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
        if "high" not in spec:
            raise ValueError(f"{where}: integer input needs 'high'")
        return torch.randint(int(spec.get("low", 0)), int(spec["high"]), shape, generator=gen, dtype=dtype)
    raise ValueError(f"{where}: cannot read spec {spec!r}")


def _pad_id(config: Any) -> int:
    pad = getattr(config, "pad_token_id", None)
    if pad is None:
        pad = getattr(config.get_text_config(), "pad_token_id", None)
    if pad is None:
        raise ValueError(f"config of {config.model_type} has no pad_token_id to derive a mask from")
    return int(pad)


def _build_t5_padded(case: Case, section: str, config: Any, gen: torch.Generator) -> Inputs:
    """C12: a right-padded encoder batch, then an unpadded one of another length.

    ``[inputs]``: ``input_ids`` [2, 16], row 0 five real tokens then eleven pad ids, row 1 sixteen
    real tokens (real ids uniform in ``[1, vocab)``), ``attention_mask`` = ids != pad.
    ``[second_inputs]``: ``input_ids`` [1, 9] without padding and an all-ones mask. Declared
    specs (``decoder_input_ids``) follow, drawn from the same generator.
    """
    pad = _pad_id(config)
    vocab = int(config.vocab_size)
    spec = case.inputs_spec if section == "inputs" else case.second_inputs_spec or {}
    if section == "inputs":
        input_ids = torch.randint(1, vocab, (2, 16), generator=gen, dtype=torch.int64)
        input_ids[0, 5:] = pad
    else:
        input_ids = torch.randint(1, vocab, (1, 9), generator=gen, dtype=torch.int64)
    out: Inputs = {"input_ids": input_ids, "attention_mask": (input_ids != pad).to(torch.int64)}
    for key, value in spec.items():
        if key in out or not isinstance(value, dict):
            continue
        out[key] = _tensor_from_spec(case.name, key, value, gen, out, config)
    return out


def _build_qwen2vl_grid(case: Case, section: str, config: Any, gen: torch.Generator) -> Inputs:
    """C04: one image of 4x4 patches inside a 12-token prompt.

    ``pixel_values`` float32 [16, C*T*P*P] (1176 for the case's vision config), ``image_grid_thw``
    [[1, 4, 4]], ``input_ids`` [1, 12] with vision start at 3, four image tokens at 4..7, vision
    end at 8 and other ids uniform in ``[3, 240)``, ``attention_mask`` ones, ``mm_token_type_ids``
    int64, 1 on image tokens (transformers 5.24's Qwen2-VL forward takes it to compute the M-RoPE
    position ids and warns when it is missing with image inputs).
    """
    vision = config.vision_config
    patch_dim = int(vision.in_channels) * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2
    pixel_values = torch.randn(16, patch_dim, generator=gen, dtype=torch.float32)
    input_ids = torch.randint(3, 240, (1, 12), generator=gen, dtype=torch.int64)
    input_ids[0, 3] = config.vision_start_token_id
    input_ids[0, 4:8] = config.image_token_id
    input_ids[0, 8] = config.vision_end_token_id
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values": pixel_values,
        "image_grid_thw": torch.tensor([[1, 4, 4]], dtype=torch.int64),
        "mm_token_type_ids": (input_ids == config.image_token_id).to(torch.int64),
    }


_NOTE_BUILDERS: dict[str, _NoteBuilder] = {
    "C04-qwen2vl-vision-grid": _build_qwen2vl_grid,
    "C12-t5-padded": _build_t5_padded,
}


def _case_files(cases_dir: Path) -> list[Path]:
    return sorted(cases_dir.glob("*.toml"))


def load_case(path_or_name: str | os.PathLike[str], cases_dir: str | os.PathLike[str] | None = None) -> Case:
    """Load one case by file path, by name (``"C09-left-padding"``) or by unique prefix (``"C09"``).

    Args:
        path_or_name: a path to a ``.toml`` file, or a case name looked up in ``cases_dir``.
        cases_dir: where to look names up; ``None`` = :func:`find_cases_dir`.

    Returns:
        The parsed :class:`Case`.

    Raises:
        ValueError: the name matches no case or several (the message lists the cases).
        FileNotFoundError: a path that does not exist, or no cases directory.
    """
    path = Path(path_or_name)
    if path.suffix == ".toml" or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"no case file {path}")
        return Case.from_toml(path)
    name = str(path_or_name)
    files = _case_files(Path(cases_dir) if cases_dir is not None else find_cases_dir())
    exact = [f for f in files if f.stem == name]
    matches = exact or [f for f in files if f.stem.startswith(name + "-")]
    if len(matches) != 1:
        what = "no case" if not matches else "several cases"
        raise ValueError(f"{what} named {name!r}; available: {', '.join(f.stem for f in files)}")
    return Case.from_toml(matches[0])


def list_cases(backend: str | None = None, cases_dir: str | os.PathLike[str] | None = None) -> list[Case]:
    """Load every case, sorted by name.

    Args:
        backend: keep only the cases listing this backend (``"dynamo"``, ``"onnx"``, ``"executorch"``).
        cases_dir: directory to read; ``None`` = :func:`find_cases_dir`.

    Returns:
        The cases, sorted by name.

    Raises:
        FileNotFoundError: no cases directory.
    """
    files = _case_files(Path(cases_dir) if cases_dir is not None else find_cases_dir())
    cases = [Case.from_toml(f) for f in files]
    if backend is not None:
        cases = [c for c in cases if backend in c.backends]
    return cases


def tiny_model_from_case(case: Case | str) -> tuple[PreTrainedModel, Inputs]:
    """Build a case's model and its sample inputs.

    Args:
        case: a :class:`Case`, or a name/path accepted by :func:`load_case`.

    Returns:
        ``(model, sample_inputs)`` as :meth:`Case.build_model` and :meth:`Case.sample_inputs` give.

    Raises:
        The errors of :func:`load_case`, :meth:`Case.build_model` and :meth:`Case.sample_inputs`.
    """
    if not isinstance(case, Case):
        case = load_case(case)
    model = case.build_model()
    return model, case.sample_inputs(model)
