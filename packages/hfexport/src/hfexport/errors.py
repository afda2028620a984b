"""Exception types raised by hfexport.

Every error says what went wrong and what to do next. Most derive from a builtin type as well
(``ValueError``, ``RuntimeError``, ``ImportError``) so callers that catch the builtin keep working.
"""

from __future__ import annotations

__all__ = [
    "MEMORY_OPTIONS",
    "CheckpointError",
    "DataDependentSizeError",
    "ExportMemoryError",
    "ExportStageError",
    "ExportValidationError",
    "GgufConversionError",
    "GgufDependencyError",
    "HfExportError",
    "InsufficientMemoryError",
    "IntegrityError",
    "MissingBackendError",
    "OutputDirectoryError",
    "UnsupportedInputError",
    "UnsupportedModelError",
    "UntrainedWeightsError",
]


class HfExportError(Exception):
    """Base class of every error hfexport raises on purpose."""


class UnsupportedInputError(HfExportError, ValueError):
    """The sample inputs ask for something that is not exported (labels, loss, ...)."""


class UnsupportedModelError(HfExportError, ValueError):
    """The model cannot be exported as configured (e.g. an attention backend with no sdpa path)."""


class UntrainedWeightsError(HfExportError, ValueError):
    """The checkpoint has no trained weights for some parameters of the class the task loads.

    transformers would initialize them at random (e.g. ``--task text-generation`` on an encoder-only
    checkpoint gives a fresh LM head), so the export would compute meaningless outputs. The
    message names the missing parameters, the checkpoint's own architecture and the task that fits it.
    """


class CheckpointError(HfExportError, ValueError):
    """A checkpoint folder's weight files are damaged (a ``.safetensors`` file shorter than its
    header says, or an unreadable header); the message names the file and says to download it again."""


class InsufficientMemoryError(HfExportError, MemoryError):
    """An export would need more memory than the machine has available, found before the weights
    are loaded. The message gives the estimate, what is available and the options that lower it."""


class MissingBackendError(HfExportError, ImportError):
    """A known export format whose backend package is not installed.

    The message carries the ``pip install hfexport-<backend>`` command.
    """


class GgufDependencyError(HfExportError, ImportError):
    """A GGUF checkpoint must be converted, but ``gguf`` or ``accelerate`` is not installed.

    transformers reads GGUF files with both. The message carries the install command
    (``pip install gguf accelerate``, or ``pip install 'hfexport[gguf]'``).
    """


class GgufConversionError(HfExportError, ValueError):
    """A GGUF file cannot be converted into a Hugging Face model folder.

    Raised by :mod:`hfexport.gguf_source` when the file is not a readable GGUF file (truncated,
    corrupt, not GGUF at all) or transformers cannot load what it holds (an architecture it does
    not convert). The message names the file, the reason and what to do.

    Attributes:
        path: the GGUF file (``str``).
    """

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path


class OutputDirectoryError(HfExportError, ValueError):
    """The output folder cannot receive an export, or could not be swapped in.

    Raised by :func:`hfexport.atomic.check_output_dir` (a file, an unwritable parent, a non-empty
    folder that is not a previous export without ``overwrite``) before any model is loaded, and by
    :func:`hfexport.atomic.atomic_output_dir`. The message names the path, the problem and what to
    do (``--overwrite``, another folder, fixing permissions).

    Attributes:
        path: the output folder as the caller gave it (``str``).
    """

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path


class ExportStageError(HfExportError, RuntimeError):
    """An export stage failed.

    Attributes:
        stage: name of the stage that failed (e.g. ``"capture"``, ``"lowering"``).
        component: the model component being exported, when known (e.g. ``"decode"``).
    """

    def __init__(self, message: str, *, stage: str, component: str | None = None) -> None:
        super().__init__(message)
        self.stage = stage
        self.component = component


class DataDependentSizeError(HfExportError, RuntimeError):
    """A backend cannot size a tensor whose size is computed from input values (an unbacked,
    data-dependent symbol ``u0``... of the captured program) that has no finite upper bound of
    the model's own: ExecuTorch plans every buffer at its upper bound. The message names the
    symbols; the cause is chained.

    The generation exporter reads it as a sign that an image tower reads its patch grid as values,
    and exports that tower for one image of one grid (issue 28).

    Attributes:
        symbols: the names of the data-dependent symbols (``["u271"]``).
    """

    def __init__(self, message: str, *, symbols: list[str]) -> None:
        super().__init__(message)
        self.symbols = list(symbols)


class ExportValidationError(HfExportError, AssertionError):
    """The exported artifact does not reproduce eager PyTorch within tolerance.

    Attributes:
        table: the per-output comparison rows (``hfexport.validation.OutputComparison``),
            the failing ones included; ``str(error)`` renders them as a table.
    """

    def __init__(self, message: str, table: list | None = None) -> None:
        super().__init__(message)
        self.table = list(table or [])


class IntegrityError(HfExportError, ValueError):
    """A file of an output folder does not match the SHA-256 its ``checksums.sha256`` records.

    Raised by :func:`hfexport.integrity.verify_checksums` (and so by the loaders and
    ``hfexport generate``) before the file is read: the message names the file, the expected and
    the actual digest, and says to re-export or re-download it. Also raised when a listed file is
    missing or the checksum list is malformed.
    """


#: What to do when an export runs out of memory (the options of the estimate checked before loading).
MEMORY_OPTIONS = (
    "To need less: export in a smaller dtype (--dtype bfloat16 or float16, config dtype=...), skip "
    "validation (--no-validate, validate=False: no eager reference outputs and no runtime copy of the "
    "artifact), close other programs, or export a smaller model. The estimate checked before loading "
    "did not foresee this peak; --ignore-memory-estimate only skips that check, it lowers nothing"
)


class ExportMemoryError(ExportStageError, MemoryError):
    """An export stage ran out of memory (``MemoryError``; a kill by the out-of-memory killer cannot
    be caught, see ``docs/security.md``). The message names the stage and the options that lower
    the peak (:data:`MEMORY_OPTIONS`); ``stage`` and ``component`` as for :class:`ExportStageError`.
    """
