"""YAML loading that remembers where every value came from.

``load_with_positions`` returns plain Python data plus a map from the path of
each value (a tuple of keys and indices) to its ``(line, column)`` in the file,
so validation errors can say ``FILE:LINE:COL: path.to.field: message``.
``${VAR}`` and ``${VAR:-default}`` in strings expand from the environment;
an unset variable without a default is an error at that position.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

Path_ = tuple[str | int, ...]
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


def load_with_positions(text: str, file: str = "<string>", env: Mapping[str, str] | None = None) -> Source:
    """Parse ``text``; raise ConfigError on YAML syntax errors or unset variables."""
    env = os.environ if env is None else env
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        msg = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([Problem(file, line, col, "", f"YAML syntax error: {msg}")]) from None
    positions: dict[Path_, tuple[int, int]] = {}
    key_positions: dict[Path_, tuple[int, int]] = {}
    problems: list[Problem] = []
    constructor = yaml.SafeLoader("")

    def build(node: yaml.Node, path: Path_) -> Any:
        positions[path] = (node.start_mark.line + 1, node.start_mark.column + 1)
        if isinstance(node, yaml.MappingNode):
            out: dict[Any, Any] = {}
            for knode, vnode in node.value:
                key = constructor.construct_object(knode)
                if not isinstance(key, (str, int)):
                    key = str(key)
                if key in out:
                    line, col = knode.start_mark.line + 1, knode.start_mark.column + 1
                    problems.append(Problem(file, line, col, dotted((*path, key)), "duplicate key"))
                child = (*path, key)
                out[key] = build(vnode, child)
                key_positions[child] = (knode.start_mark.line + 1, knode.start_mark.column + 1)
            return out
        if isinstance(node, yaml.SequenceNode):
            return [build(v, (*path, i)) for i, v in enumerate(node.value)]
        value = constructor.construct_object(node)
        if isinstance(value, str):
            errs: list[str] = []
            value = _expand(value, env, path, errs)
            for e in errs:
                problems.append(Problem(file, node.start_mark.line + 1, node.start_mark.column + 1, dotted(path), e))
        return value

    data = build(root, ()) if root is not None else {}
    if problems:
        raise ConfigError(problems)
    return Source(file, data, positions, key_positions)


def load_file(path: str | Path, env: Mapping[str, str] | None = None) -> Source:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError([Problem(str(p), 1, 1, "", f"cannot read file: {exc.strerror}")]) from None
    return load_with_positions(text, str(p), env)
