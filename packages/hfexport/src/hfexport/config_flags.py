"""Command-line flags declared on config fields, and the config a set of given flags describes.

A config field declares its ``hfexport export FORMAT`` option in its dataclass metadata::

    @dataclass
    class MyConfig(CaptureConfig):
        export_format: str = "myformat"
        temperature: float = field(
            default=1.0, metadata={CLI: CliFlag("--temperature", help="Softmax temperature.", type=float)}
        )

The CLI builds the options of ``hfexport export myformat`` from :func:`declared_flags` of the
format's config class (so a third-party config gets its flags without any CLI edit) and turns
what the user gave into a config with :func:`config_from_flags`. Nothing here imports torch, typer
or another module of hfexport: the config classes import :class:`CliFlag` from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CLI",
    "MISSING",
    "CliFlag",
    "DeclaredFlag",
    "FlagError",
    "config_from_flags",
    "declared_flags",
    "flag_for_field",
    "is_given",
]

#: The dataclass field-metadata key holding a field's :class:`CliFlag`.
CLI = "cli"


class _Missing:
    """The type of :data:`MISSING`."""

    def __repr__(self) -> str:
        return "MISSING"


#: ``CliFlag.unset`` default: a flag that is not given leaves the field at the config's default.
MISSING: Any = _Missing()

#: Value types a flag may take on the command line (``switch`` flags take none).
FLAG_TYPES = ("str", "int", "float", "Path")


class FlagError(ValueError):
    """A flag the chosen format does not take, a value a flag's parser or the config refuses, or a
    flag that needs another one (``--group-size`` without ``--quantize``).

    Attributes:
        flag: the option the error is reported as (``"--opset"``), or ``None`` when the message
            names the option itself (``"--opset applies to onnx, not dynamo"``) or no option is to
            blame (a config field without a flag).
    """

    def __init__(self, message: str, flag: str | None) -> None:
        super().__init__(message)
        self.flag = flag


@dataclass(frozen=True)
class CliFlag:
    """How a config field appears on ``hfexport export FORMAT``: put one in the field's metadata
    under :data:`CLI`.

    Attributes:
        flag: the option name, ``"--kebab-case"``.
        help: the help text ``--help`` shows.
        type: the value's type on the command line: ``"str"``, ``"int"``, ``"float"`` or ``"Path"``
            (ignored for a ``switch``).
        switch: a flag without a value (``--static``); given, the field is set to ``set_to``.
        set_to: a switch's field value when it is given.
        unset: the field's value when the flag is not given; :data:`MISSING` (the default) leaves
            the config's own default (``--static`` exports dynamic shapes unless given, so
            ``dynamic`` has ``unset=True``).
        choices: the values the flag accepts (a usage error names them otherwise).
        metavar: the value's name in the help (``MODULE``); ``None`` shows its type.
        repeat: the flag may be given several times; the value is the list of them.
        parse: turns the command-line value (a ``str``/``int``/``float``/``pathlib.Path``, or the
            list of a ``repeat`` flag) into the field's value; a ``ValueError`` it raises is a usage
            error of this flag, with the error's message. ``None`` passes the value as it is.
        formats: the export formats that take the flag; ``None``: every format whose config class
            has the field.
        elsewhere: the message when the flag is given for a format that does not take it, with
            ``{format}`` for the chosen one (``"--opset applies to onnx, not {format}"``);
            ``None``: ``"--flag is not an option of the <format> format ..."``.
        elsewhere_hint: report ``elsewhere`` as an error of the flag (``Invalid value for
            --ort-fusions: ...``) rather than as a bare usage error (the default message always is).
        ignore_elsewhere: given for a format that does not take it, the flag is ignored instead
            (``--no-optimize`` for a format without a graph optimizer).
        group: a nested config dataclass the flag's value starts: the field's value becomes
            ``{group_key: value, <fields of the group given by their own flags>}``.
        group_key: the ``group`` field the flag's own value sets.
        group_noun / value_name: for the error when a flag of ``group`` is given without this
            one: ``"--group-size applies to {group_noun}; add {flag} {value_name}"``.
        panel: the help section the flag is listed in; ``None``: ``"<format> options"`` of the
            class that declares the field.

    Raises:
        ValueError: a flag name that is not ``--kebab-case``, an unknown ``type``, or a ``group``
            without ``group_key``.
    """

    flag: str
    help: str
    type: str = "str"
    switch: bool = False
    set_to: Any = True
    unset: Any = MISSING
    choices: tuple[str, ...] = ()
    metavar: str | None = None
    repeat: bool = False
    parse: Callable[[Any], Any] | None = None
    formats: tuple[str, ...] | None = None
    elsewhere: str | None = None
    elsewhere_hint: bool = False
    ignore_elsewhere: bool = False
    group: type | None = None
    group_key: str = ""
    group_noun: str = ""
    value_name: str = "VALUE"
    panel: str | None = None

    def __post_init__(self) -> None:
        body = self.flag[2:]
        if not self.flag.startswith("--") or not body or not all(p.isalnum() for p in body.split("-")):
            raise ValueError(
                f"CliFlag flag={self.flag!r} is invalid; allowed: '--kebab-case' such as '--group-size'"
            )
        if self.type not in FLAG_TYPES:
            raise ValueError(
                f"CliFlag {self.flag} type={self.type!r} is invalid; allowed: {', '.join(FLAG_TYPES)}"
            )
        if self.group is not None and not self.group_key:
            raise ValueError(
                f"CliFlag {self.flag} has a group but no group_key; name the field its value sets"
            )
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.formats is not None:
            object.__setattr__(self, "formats", tuple(self.formats))

    @property
    def param_name(self) -> str:
        """The flag as a Python identifier: ``"--group-size"`` -> ``"group_size"``."""
        return self.flag[2:].replace("-", "_")


@dataclass(frozen=True)
class DeclaredFlag:
    """One flag of a config class, as :func:`declared_flags` finds it.

    Attributes:
        path: the field it sets, dotted for a nested group's field (``"quantization.group_size"``).
        cli: the field's :class:`CliFlag`.
        owner: the config class that declares the field (the base class for an inherited field).
        parent: the :class:`CliFlag` of the group it belongs to (``--quantize``), else ``None``.
    """

    path: str
    cli: CliFlag
    owner: type
    parent: CliFlag | None = None

    @property
    def field_name(self) -> str:
        """The field's own name (the last part of :attr:`path`)."""
        return self.path.rsplit(".", 1)[-1]

    def applies_to(self, config_cls: type, export_format: str) -> bool:
        """Whether ``hfexport export <export_format>`` with ``config_cls`` takes this flag: the
        class has the field (its group's field, for a nested one) and ``cli.formats`` names the
        format (or is ``None``)."""
        top = self.path.split(".", 1)[0]
        if top not in getattr(config_cls, "__dataclass_fields__", {}):
            return False
        formats = self.cli.formats if self.parent is None else self.parent.formats
        return formats is None or export_format in formats


def _declaring_class(cls: type, name: str) -> type:
    for klass in reversed(cls.__mro__):
        if name in getattr(klass, "__dataclass_fields__", {}):
            return klass
    return cls


def declared_flags(config_cls: type) -> list[DeclaredFlag]:
    """Every flag ``config_cls`` declares, in field order (inherited fields first), the fields of a
    ``group`` right after its flag.

    Args:
        config_cls: a config dataclass (an ``ExportConfigMixin`` subclass).

    Returns:
        One :class:`DeclaredFlag` per field whose metadata holds a :class:`CliFlag` under :data:`CLI`.

    Raises:
        ValueError: two fields declare the same flag name (the message names both).
        TypeError: a field's metadata under :data:`CLI` is not a :class:`CliFlag`.
    """
    found: list[DeclaredFlag] = []

    def walk(cls: type, prefix: str, parent: CliFlag | None, owner: type | None) -> None:
        for f in dataclasses.fields(cls):
            cli = f.metadata.get(CLI)
            if cli is None:
                continue
            if not isinstance(cli, CliFlag):
                raise TypeError(
                    f"{cls.__qualname__}.{f.name}: metadata[{CLI!r}] is {type(cli).__name__}; allowed: a "
                    "hfexport.config_flags.CliFlag"
                )
            declared = DeclaredFlag(prefix + f.name, cli, owner or _declaring_class(cls, f.name), parent)
            found.append(declared)
            if cli.group is not None:
                walk(cli.group, f"{prefix}{f.name}.", cli, declared.owner)

    walk(config_cls, "", None, None)
    seen: dict[str, str] = {}
    for d in found:
        if d.cli.flag in seen:
            raise ValueError(
                f"{config_cls.__qualname__}: fields {seen[d.cli.flag]!r} and {d.path!r} both declare "
                f"{d.cli.flag}; give one of them another flag name"
            )
        seen[d.cli.flag] = d.path
    return found


def flag_for_field(flags: Iterable[DeclaredFlag], path: str) -> str | None:
    """The flag that sets the field ``path`` (``"opset_version"``, ``"quantization.group_size"``);
    a group's key field and the group itself (``"quantization.method"``, ``"quantization"``) are
    its group's flag. ``None`` when no flag sets it."""
    for d in flags:
        if d.path == path:
            return d.cli.flag
        if d.cli.group is not None and path == f"{d.path}.{d.cli.group_key}":
            return d.cli.flag
    return None


def is_given(cli: CliFlag, value: Any) -> bool:
    """Whether a flag's command-line ``value`` means the user gave it: a switch that is on, a
    ``repeat`` flag with at least one value, any other flag whose value is not ``None``."""
    if cli.switch:
        return bool(value)
    if cli.repeat:
        return bool(value)
    return value is not None


def _field_value(d: DeclaredFlag, value: Any) -> Any:
    """The field value of a given flag: its ``set_to`` (switch) or its parsed value.

    Raises:
        FlagError: the flag's parser refused the value (reported as the flag's).
    """
    cli = d.cli
    if cli.switch:
        return cli.set_to
    if cli.repeat:
        value = list(value)
    if cli.parse is None:
        return value
    try:
        return cli.parse(value)
    except ValueError as exc:
        raise FlagError(str(exc), cli.flag) from None


def config_from_flags(
    config_cls: Any,
    export_format: str,
    given: Mapping[str, Any],
    known: Sequence[DeclaredFlag] | None = None,
) -> Any:
    """The config of ``config_cls`` the command-line flags describe.

    Args:
        config_cls: the format's config class (``AutoExportConfig.config_class(export_format)``).
        export_format: the chosen format (``export_format`` of the config).
        given: flag name (``"--opset"``) -> command-line value, for every flag the command line
            offered (``None``, ``False`` or an empty list when not given, see :func:`is_given`).
        known: the declarations of the flags in ``given`` (a flag of another format's config may
            be among them, to be refused with its ``elsewhere`` message); ``None``: those of
            ``config_cls``.

    Returns:
        ``config_cls.from_dict({"export_format": export_format, <fields the flags set>})``.

    Raises:
        FlagError: in this order: a given flag the format does not take (its ``elsewhere``
            message, or one naming the format; not when it has ``ignore_elsewhere``); a flag of a group given without the group's flag
            (``--group-size, --per-tensor apply to a quantization; add --quantize METHOD``); a
            value a flag's parser refuses; a value the config refuses (the config's message,
            reported as the flag of the field it names).
        KeyError: ``given`` names a flag ``known`` does not declare (a caller's mistake).
    """
    own = declared_flags(config_cls)
    known = list(known) if known is not None else own
    by_flag = {d.cli.flag: d for d in known}
    for d in own:  # the chosen class's declaration wins over another class's of the same flag
        by_flag[d.cli.flag] = d
    for flag in given:
        if flag not in by_flag:
            raise KeyError(f"{flag} is not a declared flag; declared: {', '.join(sorted(by_flag))}")

    applicable = {d.cli.flag for d in own if d.applies_to(config_cls, export_format)}
    for flag, value in given.items():
        d = by_flag[flag]
        if flag in applicable or not is_given(d.cli, value):
            continue
        if d.cli.ignore_elsewhere:
            continue
        if d.cli.elsewhere is not None:
            message = d.cli.elsewhere.format(format=export_format, flag=flag)
            raise FlagError(message, flag if d.cli.elsewhere_hint else None)
        raise FlagError(
            f"{flag} is not an option of the {export_format} format ({config_cls.__name__} has no field "
            f"{d.path!r}); `hfexport export {export_format} --help` lists its options",
            flag,
        )

    chosen = [d for d in own if d.cli.flag in applicable]
    for group in (d for d in chosen if d.cli.group is not None):
        members = [d for d in chosen if d.parent is group.cli and is_given(d.cli, given.get(d.cli.flag))]
        if members and not is_given(group.cli, given.get(group.cli.flag)):
            used = [d.cli.flag for d in members]
            raise FlagError(
                f"{', '.join(used)} appl{'ies' if len(used) == 1 else 'y'} to {group.cli.group_noun}; "
                f"add {group.cli.flag} {group.cli.value_name}",
                group.cli.flag,
            )

    data: dict[str, Any] = {"export_format": export_format}
    for d in chosen:
        value = given.get(d.cli.flag)
        if is_given(d.cli, value):
            field_value = _field_value(d, value)
        elif d.cli.unset is not MISSING:
            field_value = d.cli.unset
        else:
            continue
        if d.parent is not None:
            group_value = data.get(d.path.split(".", 1)[0])
            if isinstance(group_value, dict):  # else its group's flag was not given: nothing to fill
                group_value[d.field_name] = field_value
        elif d.cli.group is not None:
            data[d.path] = {d.cli.group_key: field_value}
        else:
            data[d.path] = field_value
    try:
        return config_cls.from_dict(data)
    except ValueError as exc:
        field = str(exc).split("=", 1)[0]
        raise FlagError(str(exc), flag_for_field(own, field)) from None
