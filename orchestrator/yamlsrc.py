"""YAML loading that remembers where every value came from.

``load_with_positions`` returns plain Python data plus a map from the path of
each value (a tuple of keys and indices) to its ``(line, column)`` in the file,
so validation errors can say ``FILE:LINE:COL: path.to.field: message``.
``${VAR}`` and ``${VAR:-default}`` in strings expand from the environment;
an unset variable without a default is an error at that position. A plain
(unquoted) ``${VAR}`` alone that expands to ``true``/``false`` is that boolean.

Whatever the file holds, loading ends in data or a :class:`ConfigError` with
positions, never another exception: tags other than YAML's own (``!foo``,
``!!python/...``) are refused, a recursive alias is refused, alias expansion
is bounded (``MAX_VALUES``), and the file must be a regular, UTF-8 file of at
most ``MAX_FILE_BYTES``.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from .configchecks import FieldError

Path_ = tuple[str | int, ...]
MAX_FILE_BYTES = 1 << 20     # a fleet file is a few KB; this bounds what a reload may read
MAX_VALUES = 100_000         # values after alias expansion: a fleet has hundreds; an alias bomb has billions
_INT, _FLOAT, _TIMESTAMP = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:timestamp"
_BOOL = "tag:yaml.org,2002:bool"
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong with a config file."""

    file: str
    line: int
    col: int
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}: {self.path or '<root>'}: {self.message}"


class ConfigError(Exception):
    """A config file is invalid; ``problems`` lists every error found."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


def dotted(path: Path_) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


@dataclasses.dataclass
class Source:
    """Parsed YAML plus positions."""

    file: str
    data: Any
    positions: dict[Path_, tuple[int, int]]
    key_positions: dict[Path_, tuple[int, int]] = dataclasses.field(default_factory=dict)

    def where(self, path: Path_, at_key: bool = False) -> tuple[int, int]:
        """Position of ``path`` (of its key with ``at_key``) or of its nearest ancestor that has one."""
        p = tuple(path)
        if at_key and p in self.key_positions:
            return self.key_positions[p]
        while p:
            if p in self.positions:
                return self.positions[p]
            p = p[:-1]
        return self.positions.get((), (1, 1))

    def problem(self, path: Path_, message: str, at_key: bool = False) -> Problem:
        line, col = self.where(path, at_key)
        return Problem(self.file, line, col, dotted(path), message)


def _expand(value: str, env: Mapping[str, str], path: Path_, problems: list[str]) -> str:
    def sub(m: re.Match[str]) -> str:
        name, default = m.group(1), m.group(2)
        if name in env:
            return env[name]
        if default is not None:
            return default
        problems.append(f"environment variable {name} is not set (use ${{{name}:-default}} for a default)")
        return m.group(0)

    return _VAR.sub(sub, value)


class _Loader(yaml.SafeLoader):
    """YAML 1.1 without its surprises: ``1:30:00`` is the text a SLURM time limit is (1.1 read it as 5400,
    base 60), ``010`` is ten (1.1: eight, octal), ``2024-05-01`` a string (1.1: a date)."""

    yaml_implicit_resolvers = {c: [(tag, rx) for tag, rx in rs if tag not in (_INT, _FLOAT, _TIMESTAMP)]
                               for c, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node).replace("_", "")
    sign, digits = (-1, text[1:]) if text[0] == "-" else (1, text.lstrip("+"))
    return sign * (int(digits, 0) if digits[:2] in ("0x", "0o") else int(digits, 10))


_Loader.add_implicit_resolver(_INT, re.compile(r"^(?:[-+]?[0-9][0-9_]*|0x[0-9a-fA-F_]+|0o[0-7_]+)$"),
                              list("-+0123456789"))
_Loader.add_implicit_resolver(_FLOAT, re.compile(   # (YAML 1.1's floats, as before, but not base 60)
    r"^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?|[-+]?\.(?:inf|Inf|INF)"
    r"|\.(?:nan|NaN|NAN))$"), list("-+.0123456789"))
_Loader.add_constructor(_INT, _construct_int)


MAX_DEPTH = 64   # mappings and lists nested deeper than this are refused (a fleet's own go 6 deep)


def _check_depth(text: str, file: str) -> None:
    """ConfigError at the first collection nested deeper than ``MAX_DEPTH``, an alias counting as deep as what
    its anchor names (the builder expands it) (PyYAML's parser is a state machine: these events come without
    recursion)."""
    open_: list[list] = []        # per open collection: [its anchor, the height of its tallest child]
    heights: dict[str, int] = {}  # anchor -> the height of what it names
    for ev in yaml.parse(text, Loader=_Loader):
        height = None
        if isinstance(ev, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            open_.append([ev.anchor, 0])
        elif isinstance(ev, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            anchor, tallest = open_.pop()
            height = tallest + 1
            if anchor is not None:
                heights[anchor] = height
        elif isinstance(ev, yaml.AliasEvent):
            height = heights.get(ev.anchor, 0)
        if len(open_) + (height or 0) > MAX_DEPTH:
            raise ConfigError([Problem(file, ev.start_mark.line + 1, ev.start_mark.column + 1, "",
                                       f"mappings and lists nested more than {MAX_DEPTH} deep")])
        if height is not None and open_:
            open_[-1][1] = max(open_[-1][1], height)


HIDDEN_BREAKS = {"\u2028": "U+2028 LINE SEPARATOR", "\u2029": "U+2029 PARAGRAPH SEPARATOR", "\x85": "U+0085 NEXT LINE",
                 "\r": "a carriage return not before a line feed (U+000D)"}   # (CRLF is one break for both)
"""Characters YAML 1.1 reads as line breaks that editors, grep and ``wc -l`` do not: each moved every later line
PyYAML reports, and made what a reader sees as a comment's end (``# was 9000<U+2028>host: ...``) live config."""


def _hidden_breaks(text: str, file: str) -> None:
    """ConfigError at each of ``HIDDEN_BREAKS`` in ``text``, at its line and column as ``\\n`` counts them."""
    if (text.isascii() and "\r" not in text) or not (
            found := [m.start() for m in re.finditer("[\u2028\u2029\x85]|\r(?!\n)", text)]):
        return
    raise ConfigError([Problem(file, text.count("\n", 0, i) + 1, i - text.rfind("\n", 0, i), "",
                               f"{HIDDEN_BREAKS[text[i]]}: YAML reads it as a line break, which editors and grep "
                               "do not show (what follows it on this line is read as a line of its own, even after "
                               f"a #); remove it, or write it as \\u{ord(text[i]):04x} in a double-quoted string")
                       for i in found])


def load_with_positions(text: str, file: str = "<string>", env: Mapping[str, str] | None = None) -> Source:
    """Parse ``text``; raise ConfigError on YAML syntax errors, unset variables or line breaks editors do not
    show (``HIDDEN_BREAKS``)."""
    env = os.environ if env is None else env
    _hidden_breaks(text, file)
    try:
        _check_depth(text, file)   # (the composer and the builder below recurse: a RecursionError otherwise)
        root = yaml.compose(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        msg = getattr(exc, "problem", None) or str(exc)
        if "'\\t'" in msg:   # (PyYAML: "found character '\t' that cannot start any token")
            msg += " (a tab: YAML indents with spaces only)"
        raise ConfigError([Problem(file, line, col, "", f"YAML syntax error: {msg}")]) from None
    positions: dict[Path_, tuple[int, int]] = {}
    key_positions: dict[Path_, tuple[int, int]] = {}
    problems: list[Problem] = []
    constructor = _Loader("")
    active: set[int] = set()   # nodes being built: meeting one again is a recursive alias
    count = [0]

    def at(node: yaml.Node) -> tuple[int, int]:
        return node.start_mark.line + 1, node.start_mark.column + 1

    def fail(node: yaml.Node, path: Path_, message: str) -> ConfigError:
        line, col = at(node)
        return ConfigError([Problem(file, line, col, dotted(path), message)])

    def build(node: yaml.Node, path: Path_) -> Any:
        count[0] += 1
        if count[0] > MAX_VALUES:
            raise fail(node, path, f"more than {MAX_VALUES} values (aliases expanding without bound?)")
        if id(node) in active:
            raise fail(node, path, "recursive alias: a value contains itself")
        positions[path] = at(node)
        if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
            if node.tag not in ("tag:yaml.org,2002:map", "tag:yaml.org,2002:seq", "tag:yaml.org,2002:omap"):
                raise fail(node, path, f"unsupported YAML tag {node.tag}")
            active.add(id(node))
            try:
                if isinstance(node, yaml.SequenceNode):
                    return [build(v, (*path, i)) for i, v in enumerate(node.value)]
                out: dict[Any, Any] = {}
                for knode, vnode in node.value:
                    if knode.tag == "tag:yaml.org,2002:merge":
                        raise fail(knode, path, "merge keys (<<) are not supported: `defaults:` holds what every "
                                                "model shares")
                    key = scalar(knode, path)
                    if not isinstance(key, (str, int)):
                        key = str(key)
                    if key in out:
                        line, col = at(knode)
                        problems.append(Problem(file, line, col, dotted((*path, key)), "duplicate key"))
                    child = (*path, key)
                    out[key] = build(vnode, child)
                    key_positions[child] = at(knode)
                return out
            finally:
                active.discard(id(node))
        value = scalar(node, path)
        if isinstance(value, str):
            errs: list[str] = []
            value = _expand(value, env, path, errs)
            if node.style is None and _VAR.fullmatch(node.value) and \
                    constructor.resolve(yaml.ScalarNode, value, (True, False)) == _BOOL:
                # a plain ${VAR} alone reads `true` as the boolean it would be if written there (vllm_args and
                # sbatch_options render a true as a bare flag: the text "true" became `--flag true`)
                value = constructor.construct_yaml_bool(yaml.ScalarNode(_BOOL, value))
            for e in errs:
                line, col = at(node)
                problems.append(Problem(file, line, col, dotted(path), e))
        return value

    def scalar(node: yaml.Node, path: Path_) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            raise fail(node, path, "a key must be a plain value")
        try:
            return constructor.construct_object(node)
        except yaml.YAMLError as exc:
            raise fail(node, path, f"unsupported YAML: {getattr(exc, 'problem', None) or exc}") from None
        except (ValueError, TypeError, OverflowError, IndexError) as exc:   # (a value its tag cannot make)
            raise fail(node, path, f"cannot read {node.value!r}: {exc}") from None

    data = build(root, ()) if root is not None else {}
    if problems:
        raise ConfigError(problems)
    return Source(file, data, positions, key_positions)


def load_file(path: str | Path, env: Mapping[str, str] | None = None) -> Source:
    """Read and parse a config file: a regular file (not a FIFO or a device: reading one could block),
    at most MAX_FILE_BYTES, UTF-8."""
    p = Path(path)

    def problem(message: str, line: int = 1, col: int = 1) -> ConfigError:
        return ConfigError([Problem(str(p), line, col, "", message)])
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise problem(f"cannot read file: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise problem("not a regular file")
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        raise problem(f"larger than {MAX_FILE_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        before = raw[:exc.start]
        line = before.count(b"\n") + 1
        col = exc.start - (before.rfind(b"\n") + 1) + 1
        raise problem(f"not UTF-8: byte 0x{raw[exc.start]:02x}", line, col) from None
    return load_with_positions(text, str(p), env)


UNION_BRANCHES = {"str": "string_", "int": "int_", "float": "float_", "bool": "bool_"}   # pydantic's tag: error


def validation_problems(exc: Any, src: Source, at: tuple = (), words: Mapping[str, str] | None = None,
                        names: Iterable[str] = (), alias: Mapping[tuple, tuple] | None = None) -> list[Problem]:
    """A pydantic ValidationError's errors, each at the line of its field under ``at`` (a model-wide check's
    FieldError names its own field), in an operator's words: a pattern's rule as ``words`` says it (pattern ->
    rule), a YAML boolean or number where text goes, an unknown field's near miss among ``names``.  A value's
    own problem at a path in ``alias`` is said at the path it names (once for all that share it: a model's value
    from ``defaults``); a check across fields stays the model's."""
    found: dict[tuple, tuple[bool, list[str]]] = {}
    names = sorted(set(names))
    meant: set[tuple] = set()   # a required field a near miss misspells: said once, at the near miss
    for err, f in ((e, f) for e in exc.errors() for f in _each((e.get("ctx") or {}).get("error"))):
        loc = at + tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-"))))
        if loc and err["type"].startswith(UNION_BRANCHES.get(loc[-1], "-")):   # (one branch of a union: its value)
            loc = loc[:-1]
        unknown = err["type"] == "extra_forbidden"
        if isinstance(f, FieldError) and f.fields:
            loc = next((loc + x for x in f.fields if loc + x in src.positions), loc + f.fields[0])
        elif alias:
            loc = alias.get(loc, loc)
        near = difflib.get_close_matches(str(loc[-1]), names, 1, 0.75) if unknown and loc else []
        meant.update(loc[:-1] + (n,) for n in near)
        found.setdefault(loc, (unknown or getattr(f, "at_key", False), []))[1].append(
            (f"unknown field (did you mean {near[0]!r}?)" if near else "unknown field") if unknown else
            str(f) if isinstance(f, FieldError) else _said(err, words or {}))
    return [src.problem(loc, _one(msgs), at_key=at_key) for loc, (at_key, msgs) in found.items()
            if not (loc in meant and msgs == ["Field required"])]


def _each(error: Any) -> list:
    """A validator's error as the problems it tells: each of a :class:`FieldErrors`, else itself (or None)."""
    return error.each if isinstance(error, FieldError) else [error]


def _said(err: dict, words: Mapping[str, str]) -> str:
    """One pydantic error (not an unknown field) as an operator reads it."""
    kind, value = err["type"], err.get("input")
    if kind == "string_pattern_mismatch" and (rule := words.get((err.get("ctx") or {}).get("pattern", ""))):
        return f"{value!r} is not allowed: {rule}"
    if kind == "string_type" and isinstance(value, (bool, int, float)):
        what = "a boolean" if isinstance(value, bool) else "a number"
        return f"must be text, and YAML read this value as {what} ({str(value).lower()}): put it in quotes"
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return "must be a mapping (its fields as `key: value` lines below it)"
    return err["msg"].removeprefix("Value error, ")


def _one(messages: list[str]) -> str:
    """A value's problems as one: a union's "Input should be a valid string", "... integer" (one per branch) as
    "Input should be a valid string, integer or list"."""
    head = "Input should be a valid "
    if len(messages) > 1 and all(m.startswith(head) for m in messages):
        kinds = list(dict.fromkeys(m[len(head):].split(",")[0] for m in messages))
        return head + (", ".join(kinds[:-1]) + " or " + kinds[-1] if len(kinds) > 1 else kinds[0])
    return "; ".join(dict.fromkeys(messages))
