"""The ``@ file.toml`` command line every entry point shares (PRIME-RL's conventions).

    rl @ configs/quickstart.toml @ mine.toml --trainer.optim.lr 1e-6 --no-launch.progress
    rl --trainer @ t.toml --orchestrator @ o.toml --inference @ i.toml --dry-run
    trainer @ outputs/run/configs/trainer.json

Sources, from weakest to strongest: field defaults < environment variables (``PRIME_COMPOSER_``
then the dotted key with ``__`` for dots, e.g. ``PRIME_COMPOSER_TRAINER__OPTIM__LR``) < config
files in command-line order (later files win) < ``--dotted.key value`` flags. A file given after
``--section`` is scoped to that section. A file may pull in others with
``include = ["base.toml"]`` (relative to itself); the including file wins over what it includes.
Keys may be written in kebab-case on the command line; booleans take ``--x`` / ``--no-x``.

Every user mistake becomes a ``ConfigError`` whose message names the source (file, flag or
environment variable), the dotted key, the bad value and the nearest valid key.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import json
import os
import sys
import threading
import tomllib
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, Protocol, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_settings import EnvSettingsSource
from pydantic_settings.exceptions import SettingsError

from prime_composer.config.errors import (
    DAMAGED_INPUT_EXIT_CODE,
    RUN_ERROR_EXIT_CODE,
    ConfigError,
    DamagedInputError,
    RunError,
    did_you_mean,
)
from prime_composer.config.help import render_help
from prime_composer.config.introspect import list_item_model, submodel
from prime_composer.config.sections import plugin_section
from prime_composer.registry import Registry

M = TypeVar("M", bound=BaseModel)

_HELP_FLAGS = ("-h", "--help")
COMMAND_LINE = "command line"
MAX_INCLUDE_DEPTH = 32
"""Deepest chain of ``include`` files (a deeper one is almost surely a generated mistake)."""

NON_CONFIG_VARIABLES = (
    "PRIME_COMPOSER_INFERENCE_API_KEY",
    "PRIME_COMPOSER_CACHE",
    "PRIME_COMPOSER_LOG_LEVEL",
    "PRIME_COMPOSER_VLLM_ADMIN",
)
"""Environment variables with the config prefix that are not config keys (prefixes of names)."""


@dataclass
class Layer:
    """One source of values: a nested dict, and where each dotted leaf came from."""

    values: dict[str, Any] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)

    def set(self, dotted: str, value: Any, origin: str) -> None:
        node = self.values
        *parents, leaf = dotted.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):  # an earlier flag gave the parent a scalar value
                child = node[part] = {}
            node = child
        node[leaf] = value
        self.origins[dotted] = origin


@dataclass
class CliOptions:
    """Flags that steer the entry point itself rather than the config."""

    help: bool = False
    dry_run: bool = False
    notes: list[str] = field(default_factory=list)
    """Lines the translation of another project's key names left for the user (printed to stderr)."""


class RawTranslator(Protocol):
    """Rewrites another project's key names (PRIME-RL's: ``prime_rl/names.py``) into the model's,
    on the merged raw values, before validation, so every key keeps its origin."""

    def flag_target(self, dotted: str) -> str | None:
        """The model's key whose type parses a ``--flag`` spelled the other project's way."""
        ...

    def __call__(
        self, values: dict[str, Any], origins: dict[str, str]
    ) -> tuple[dict[str, Any], dict[str, str], list[str]]:
        """``(values, origins, notes)``; raises ``ConfigError`` for keys that cannot be translated."""
        ...


DIALECTS: Registry[Callable[[type[BaseModel]], RawTranslator]] = Registry(
    "config dialect", {"prime-rl": "prime_composer.prime_rl.names"}
)
"""Other projects' config names by dialect: each maps a model to its ``RawTranslator``. Imported by
name on first use, so the translators (``prime_composer/prime_rl/``) sit above ``config/``."""


def dialect(name: str, model: type[BaseModel]) -> RawTranslator:
    """The translator of dialect ``name`` (``"prime-rl"``) for ``model``."""
    return DIALECTS.get_or_load(name)(model)


def resolve_field(model: type[BaseModel], dotted: str, origin: str) -> Any:
    """The annotation of ``dotted`` inside ``model``; a clear error if any part is unknown."""
    current: type[BaseModel] = model
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        fields = current.model_fields
        plugin = plugin_section(current, part)  # a registered plugin channel's section
        if part not in fields and plugin is None:
            prefix = ".".join(parts[:i])
            candidates = [f"{prefix}.{f}" if prefix else f for f in fields]
            raise ConfigError(
                f"{origin}: unknown key {dotted!r}{did_you_mean('.'.join(parts[: i + 1]), candidates)}; "
                f"see --help for the valid keys"
            )
        annotation = fields[part].annotation if plugin is None else plugin
        if i == len(parts) - 1:
            return annotation
        nested = submodel(annotation)
        if nested is None:
            raise ConfigError(
                f"{origin}: {'.'.join(parts[: i + 1])!r} is a value, not a section, "
                f"so {dotted!r} does not exist"
            )
        current = nested
    raise AssertionError("unreachable")


def _is_bool(annotation: Any) -> bool:
    if annotation is bool:
        return True
    args = typing.get_args(annotation)
    return bool(args) and all(a in (bool, type(None)) for a in args)


def _is_text(annotation: Any) -> bool:
    """Fields whose command-line value is taken verbatim (no TOML parsing)."""
    if annotation in (str, Path):
        return True
    if typing.get_origin(annotation) is typing.Literal:
        return all(isinstance(a, str) for a in typing.get_args(annotation))
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return (
        bool(args)
        and typing.get_origin(annotation) in (typing.Union, types.UnionType)
        and all(_is_text(a) for a in args)
    )


def _parse_cli_value(raw: str, annotation: Any) -> Any:
    """Turn a command-line string into a TOML-typed value where the field is not text."""
    allows_none = type(None) in typing.get_args(annotation)
    if allows_none and raw.lower() in ("none", "null"):
        return None
    if _is_text(annotation):
        return raw
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # let pydantic report the type error with the value as typed


# ----------------------------------------------------------------------------------- file loading


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted leaves; lists and empty tables are leaves (``[ckpt]`` alone is ``{"ckpt": {}}``)."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def _normalize_keys(values: Any) -> Any:
    """kebab-case -> snake_case in every table key, so ``weight-decay`` works in files too."""
    if isinstance(values, dict):
        return {k.replace("-", "_"): _normalize_keys(v) for k, v in values.items()}
    if isinstance(values, list):
        return [_normalize_keys(v) for v in values]
    return values


def load_file(path: Path, *, origin: str, _stack: tuple[Path, ...] = ()) -> Layer:
    """Read a TOML or JSON config file, following ``include``; keys unscoped."""
    path = path.expanduser()
    if not path.is_file():
        hint = "it is a directory" if path.is_dir() else "no such file"
        raise ConfigError(f"{origin}: config file '{path}' cannot be read: {hint}")
    resolved = path.resolve()
    if resolved in _stack:
        chain = " -> ".join(str(p) for p in (*_stack, resolved))
        raise ConfigError(f"{path}: include cycle: {chain}")
    if len(_stack) >= MAX_INCLUDE_DEPTH:
        raise ConfigError(
            f"{path}: included {len(_stack)} files deep (more than {MAX_INCLUDE_DEPTH}); flatten the include chain"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); save the file as UTF-8"
        ) from None
    except OSError as e:
        raise ConfigError(f"{origin}: config file '{path}' cannot be read: {e.strerror or e}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a table of keys")
    data = _normalize_keys(data)

    layer = Layer()
    includes = data.pop("include", [])
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise ConfigError(f"{path}: include = {includes!r}: must be a file path or a list of paths")
    for inc in includes:
        sub = load_file(path.parent / inc, origin=f"{path} (include)", _stack=(*_stack, resolved))
        layer.values = _deep_merge(layer.values, sub.values)
        layer.origins.update(sub.origins)
    layer.values = _deep_merge(layer.values, data)
    layer.origins.update({k: str(path) for k in flatten(data)})
    return layer


def _scoped(layer: Layer, scope: str) -> Layer:
    if not scope:
        return layer
    out = Layer()
    node = out.values
    for part in scope.split("."):
        node = node.setdefault(part, {})
    node.update(layer.values)
    out.origins = {f"{scope}.{k}": v for k, v in layer.origins.items()}
    return out


def env_layer(model: type[BaseModel], prefix: str) -> Layer:
    """Values from ``<prefix><KEY>__<SUB>`` environment variables, read by pydantic-settings.

    Every variable with the prefix must name a key (a typo is an error at any depth, not a
    silently ignored setting), and a section given as JSON must be valid JSON.
    """
    _check_env_names(model, prefix)
    source = EnvSettingsSource(
        model,  # type: ignore[arg-type]  # works on any BaseModel, given the settings explicitly
        env_prefix=prefix,
        env_nested_delimiter="__",
        case_sensitive=False,
    )
    try:
        values = source()
    except SettingsError as e:
        field_name = str(e).split('"')[1] if '"' in str(e) else "?"
        raise ConfigError(
            f"environment variable {prefix}{field_name.upper()}: not valid JSON for the section "
            f"{field_name!r} ({e.__cause__ or e}); give its keys one by one "
            f"({prefix}{field_name.upper()}__<KEY>=...) or fix the JSON"
        ) from None
    origins = {
        dotted: f"environment variable {prefix}{dotted.replace('.', '__').upper()}"
        for dotted in flatten(values)
    }
    _type_env_text(values, model, origins)
    return Layer(values=values, origins=origins)


def _type_env_text(
    values: dict[str, Any], model: type[BaseModel], origins: dict[str, str], prefix: str = ""
) -> None:
    """Variables are text: read each like a command-line value (``"4"`` is 4 for a number field),
    since config files may not quote their numbers."""
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            _type_env_text(value, model, origins, dotted + ".")
        elif isinstance(value, str):
            try:
                annotation = resolve_field(model, dotted, origins.get(dotted, ""))
            except ConfigError:  # inside a free-form table (extra_body = {...}): text stays text
                continue
            values[key] = _parse_cli_value(value, annotation)


def _check_env_names(model: type[BaseModel], prefix: str) -> None:
    for name in os.environ:
        if not name.upper().startswith(prefix.upper()) or name.upper().startswith(NON_CONFIG_VARIABLES):
            continue
        rest = name[len(prefix) :]
        if not rest:
            continue
        dotted = ".".join(part.lower() for part in rest.split("__"))
        resolve_field(model, dotted, f"environment variable {name}")


# ---------------------------------------------------------------------------------- command line


def parse_argv(
    argv: Sequence[str],
    model: type[BaseModel],
    aliases: dict[str, str] | None = None,
    translate: RawTranslator | None = None,
) -> tuple[list[Layer], Layer, CliOptions]:
    """Split ``argv`` into file layers (in order), one layer of flags, and entry-point options.

    A flag spelled the way ``translate`` knows is kept under that spelling (it is translated with
    the files) and parsed with the type of the key it becomes."""
    aliases = aliases or {}

    def typed_as(dotted: str) -> str:
        return (translate.flag_target(dotted) if translate is not None else None) or dotted

    files: list[Layer] = []
    flags = Layer()
    options = CliOptions()
    tokens = list(argv)
    i = 0

    def take_file(scope: str) -> None:
        nonlocal i
        token = tokens[i]
        if token == "@":
            if i + 1 >= len(tokens):
                raise ConfigError(f"{COMMAND_LINE}: '@' must be followed by a config file path")
            path, i = tokens[i + 1], i + 2
        else:
            path, i = token[1:], i + 1
        origin = f"{COMMAND_LINE} (--{scope} @ {path})" if scope else f"{COMMAND_LINE} (@ {path})"
        files.append(_scoped(load_file(Path(path), origin=origin), scope))

    while i < len(tokens):
        token = tokens[i]
        if token in _HELP_FLAGS:
            options.help, i = True, i + 1
        elif token == "--dry-run":
            options.dry_run, i = True, i + 1
        elif token in aliases:
            key, value = aliases[token].split("=", 1)
            flags.set(
                key, _parse_cli_value(value, resolve_field(model, key, token)), f"{COMMAND_LINE} ({token})"
            )
            i += 1
        elif token.startswith("@"):
            take_file("")
        elif token.startswith("--"):
            name, eq, inline = token[2:].partition("=")
            dotted = name.replace("-", "_")
            origin = f"{COMMAND_LINE} ({token})"
            nxt = tokens[i + 1] if i + 1 < len(tokens) else None
            if not eq and nxt is not None and nxt.startswith("@"):
                annotation = resolve_field(model, typed_as(dotted), origin)
                if submodel(annotation) is None:
                    raise ConfigError(
                        f"{origin}: a file can only be given for a section, and {dotted!r} is a value"
                    )
                i += 1
                take_file(dotted)
                continue
            if not eq and dotted.startswith("no_") and _field_exists(model, typed_as(dotted[3:])):
                if not _is_bool(resolve_field(model, typed_as(dotted[3:]), origin)):
                    raise ConfigError(f"{origin}: {dotted[3:]!r} is not a boolean; give it a value instead")
                flags.set(dotted[3:], False, origin)
                i += 1
                continue
            annotation = resolve_field(model, typed_as(dotted), origin)
            if eq:
                raw, i = inline, i + 1
            elif _is_bool(annotation) and (nxt is None or nxt.startswith(("--", "@"))):
                flags.set(dotted, True, origin)
                i += 1
                continue
            elif nxt is None or nxt.startswith("--"):
                raise ConfigError(f"{origin}: missing value for --{name}")
            else:
                raw, i = nxt, i + 2
            flags.set(dotted, _parse_cli_value(raw, annotation), origin)
        else:
            raise ConfigError(
                f"{COMMAND_LINE}: unexpected argument {token!r}; give config files as '@ file.toml' "
                f"and settings as '--dotted.key value'"
            )
    return files, flags, options


def _field_exists(model: type[BaseModel], dotted: str) -> bool:
    try:
        resolve_field(model, dotted, "")
    except ConfigError:
        return False
    return True


# ------------------------------------------------------------------------------------ validation


def origin_of(dotted: str, origins: dict[str, str]) -> str:
    """Where ``dotted`` (or its nearest parent or child) was set; ``defaults`` if nowhere."""
    if dotted in origins:
        return origins[dotted]
    parts = dotted.split(".")
    for n in range(len(parts) - 1, 0, -1):
        if (parent := ".".join(parts[:n])) in origins:
            return origins[parent]
    children = [v for k, v in origins.items() if k.startswith(dotted + ".")]
    return children[0] if children else "defaults"


def _model_at(model: type[BaseModel], loc: Sequence[Any]) -> type[BaseModel] | None:
    current: type[BaseModel] | None = model
    for part in loc:
        if current is None:
            return None
        if isinstance(part, int):
            continue
        info = current.model_fields.get(str(part))
        if info is None:
            return None
        current = submodel(info.annotation) or list_item_model(info.annotation)
    return current


def format_validation_error(error: ValidationError, model: type[BaseModel], origins: dict[str, str]) -> str:
    """One line per problem: source, dotted key, bad value, what is wrong, nearest valid key."""
    lines = []
    for err in error.errors():
        loc = [p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
        dotted = ".".join(str(p) for p in loc)
        origin = origin_of(dotted, origins)
        if err["type"] == "extra_forbidden" and len(loc) == 2 and str(loc[1]) in model.model_fields:
            # e.g. an [orchestrator] table in a file given with --trainer @: read inside trainer.
            lines.append(
                f"{origin}: unknown key {dotted!r}: [{loc[1]}] is a section of the whole config, but this "
                f"file's keys are read inside [{loc[0]}]; give the file with '@ file' (unscoped), or move "
                f"[{loc[1]}] to a file given with '--{loc[1]} @ file'"
            )
        elif err["type"] == "extra_forbidden":
            parent = _model_at(model, loc[:-1])
            prefix = ".".join(str(p) for p in loc[:-1])
            candidates = [f"{prefix}.{f}" if prefix else f for f in (parent.model_fields if parent else [])]
            lines.append(f"{origin}: unknown key {dotted!r}{did_you_mean(dotted, candidates)}")
        elif err["type"] == "missing":
            lines.append(f"{origin}: {dotted} is required but was not set")
        else:
            value = err.get("input")
            message = err["msg"].removeprefix("Value error, ")
            if isinstance(value, dict) and err["type"] == "value_error":
                lines.append(f"{origin}: {message}")  # a check across a section's fields names them
            else:
                shown = "{...}" if isinstance(value, dict) else repr(value)
                lines.append(f"{origin}: {dotted or '<root>'} = {shown}: {message}")
    return "\n".join(lines)


def build_config(
    argv: Sequence[str],
    model: type[M],
    *,
    env_prefix: str,
    aliases: dict[str, str] | None = None,
    finalize: Callable[[M, dict[str, str]], M] | None = None,
    translate: RawTranslator | None = None,
) -> tuple[M, CliOptions]:
    """Parse ``argv`` and the environment into a validated ``model`` instance.

    ``translate`` rewrites foreign key names in the merged values first (its notes land in
    ``CliOptions.notes``); ``finalize`` runs after validation with the per-key origins (e.g. to
    unify shared keys).
    """
    files, flags, options = parse_argv(argv, model, aliases, translate)
    layers = [env_layer(model, env_prefix), *files, flags]
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for layer in layers:
        values = _deep_merge(values, layer.values)
        origins.update(layer.origins)
    if translate is not None and not options.help:
        values, origins, options.notes = translate(values, origins)
    if options.help:
        return model.model_construct(), options
    try:
        config = model.model_validate(values)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, model, origins)) from None
    if finalize is not None:
        config = finalize(config, origins)
    return config, options


def run_entry_point(
    model: type[M],
    main: Callable[[M], int | None],
    *,
    prog: str,
    env_prefix: str,
    argv: Sequence[str] | None = None,
    aliases: dict[str, str] | None = None,
    finalize: Callable[[M, dict[str, str]], M] | None = None,
    describe: str = "",
    translate: RawTranslator | None = None,
    check: Callable[[M], None] | None = None,
) -> int:
    """The whole life of a console script: parse, ``--help``/``--dry-run``, run, exit code;
    ``check`` (raising ``ConfigError``) runs before ``--dry-run`` prints the config."""

    argv = sys.argv[1:] if argv is None else argv
    try:
        config, options = build_config(
            argv, model, env_prefix=env_prefix, aliases=aliases, finalize=finalize, translate=translate
        )
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    for note in options.notes:
        print(f"{prog}: note: {note}", file=sys.stderr)
    if options.help:
        print(render_help(model, prog=prog, describe=describe, env_prefix=env_prefix, aliases=aliases))
        return 0
    if options.dry_run:
        try:
            if check is not None:
                check(config)
        except ConfigError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 2
        try:
            print(json.dumps(config.model_dump(mode="json"), indent=2), flush=True)
        except BrokenPipeError:  # `rl ... --dry-run | head`: the reader has what it wanted
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115  (so the interpreter's flush at exit is quiet)
        return 0
    try:
        return main(config) or 0
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return RUN_ERROR_EXIT_CODE
    except DamagedInputError as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return DAMAGED_INPUT_EXIT_CODE


def exit_process(code: int) -> NoReturn:
    """End a process whose console script returned ``code``, without the interpreter's teardown.

    After the script's last line CPython still frees every module and object one by one: 1-3 s for
    a process holding torch, transformers and verifiers on an idle core, 10-17 s on busy ones
    (docs/experiments.md, 2026-12-03), paid by every launch on its critical path. Everything a
    normal exit guarantees is done first, in the interpreter's order: threading's exit hooks and
    the join of non-daemon threads (``threading._shutdown``, what finalization itself calls:
    thread pools need its hooks to stop), the ``atexit`` handlers (logging's shutdown among
    them), then every open file's buffer is flushed; only then ``os._exit``. For a console
    script's ``main()`` only: in-process callers (tests) take ``run_entry_point``'s code.
    """
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for obj in gc.get_objects():
        # type(), not isinstance: a dead weak proxy among the objects raises on __class__.
        if issubclass(type(obj), io.IOBase):
            # A closed pipe, a detached buffer: nothing left to keep.
            with contextlib.suppress(Exception):
                if not obj.closed and obj.writable():
                    obj.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
