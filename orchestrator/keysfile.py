"""Client keys files and the checks across the fleet's keys: reading ``gateway.api_keys_file`` (a YAML list of
the items of ``api_keys``, or one plain key per line) with the position of every problem, and the fleet-wide
checks of names, secrets, models and priorities."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from .keys import RESERVED_NAMES, GatewayConfig, KeyItem, KeyPolicy, as_policy
from .yamlsrc import ConfigError, Path_, Problem, Source, dotted, load_file, validation_problems

YAMLISH = re.compile(r"^[ \t]*(- |[A-Za-z_][\w.-]*:([ \t]|$))", re.M)   # a list item or a mapping's key: YAML


def _plain_lines(file: str, text: str) -> Source:
    """The old format: one key per line, blank lines and ``#`` comments skipped."""
    data, positions = [], {}
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#"):
            positions[(len(data),)] = (n, len(line) - len(line.lstrip()) + 1)
            data.append(line.strip())
    return Source(file, data, positions)


def read_keys_file(path: str | Path, env: Mapping[str, str] | None = None) -> list[str | KeyPolicy]:
    """The keys of a keys file.  A file that parses as a YAML list, or is named ``*.yaml``/``*.yml``, is a list
    of items as in ``api_keys``; any other file holds one plain key per line.  Raises ConfigError naming the
    file, line and field (``[2].rpm``) of every problem; ``env`` expands ``${VAR}`` in a YAML file."""
    items, problems = _read_items(path, env)
    if problems:
        raise ConfigError(problems)
    return [k for _, _, k in items]


Entry = tuple[Source, Path_, str | KeyPolicy]
"""A configured key with where it is configured (for the positions of its problems)."""


def _read_items(path: str | Path, env: Mapping[str, str] | None) -> tuple[list[Entry], list[Problem]]:
    yaml_name = str(path).endswith((".yaml", ".yml"))
    text = None   # (read here only for a file that is not YAML)
    try:
        src: Source | None = load_file(path, env)
    except ConfigError as exc:
        if yaml_name or not exc.problems or not exc.problems[0].message.startswith("YAML syntax error") or (
                YAMLISH.search(text := Path(path).read_text(encoding="utf-8"))):   # (a YAML list with a typo:
            raise                                                                  # its error, not its lines)
        src = None
    plain = src is None or not isinstance(src.data, list)
    if plain:
        if yaml_name and src is not None and src.data != {}:   # {}: an empty file
            raise ConfigError([src.problem((), "a keys file must be a YAML list of keys")])
        src = _plain_lines(str(path), text if text is not None else Path(path).read_text(encoding="utf-8"))
    items: list[Entry] = []
    problems: list[Problem] = []
    for i, raw in enumerate(src.data):
        if plain and any(c.isspace() for c in raw):
            problems.append(src.problem((i,), "a key holds no spaces (a YAML list of keys? name the file *.yaml)"))
            continue
        try:
            items.append((src, (i,), _ITEM.validate_python(raw)))
        except ValidationError as exc:
            problems += validation_problems(exc, src, (i,))
    return items, problems


_ITEM: TypeAdapter[str | KeyPolicy] = TypeAdapter(KeyItem)


def check_keys(entries: list[Entry], served: set[str], classes: list[str],
               default_priority: str) -> list[Problem]:
    """Problems of the fleet's keys (each with the Source and path where it is configured): names and secrets
    unique, models among ``served`` (served names and aliases), priorities among ``classes``."""
    problems: list[Problem] = []
    names: dict[str, str] = {}
    digests: dict[str, str] = {}
    for src, path, item in entries:
        key = as_policy(item).resolved(default_priority)
        policy = isinstance(item, KeyPolicy)
        line, _ = src.where(path)
        here = f"{src.file}:{line} {dotted(path)}".rstrip()
        if key.digest in digests:
            at = (*path, "key") if policy else path
            problems.append(src.problem(at, f"the same key (secret) as {digests[key.digest]}"))
        elif key.name in names:
            at = (*path, "name") if policy and item.name is not None else path
            problems.append(src.problem(at, f"name {key.name!r} is already used by {names[key.name]}"))
        if key.name in RESERVED_NAMES:
            at = (*path, "name") if policy and item.name is not None else path
            problems.append(src.problem(at, f"name {key.name!r} is reserved (the gateway's own tenants: "
                                        f"{', '.join(RESERVED_NAMES)})"))
        digests.setdefault(key.digest, here)
        names.setdefault(key.name, here)
        for j, model in enumerate(key.models or []):
            if model not in served:
                problems.append(src.problem((*path, "models", j), f"unknown model {model!r}; served names and "
                                            f"aliases: {', '.join(sorted(served)) or 'none'}"))
        if key.priority not in classes:
            problems.append(src.problem((*path, "priority"), f"{key.priority!r} is not a priority class; one of: "
                                        f"{', '.join(classes)}"))
    return problems


def resolve_keys(gw: GatewayConfig, served: set[str], src: Source, env: Mapping[str, str] | None = None) -> list[Problem]:
    """Read ``gw``'s keys file (relative to ``src``'s directory), check every key, and store the resolved keys
    in ``gw`` (so they travel with it to the gateway worker processes).  Returns the problems found."""
    entries: list[Entry] = [(src, ("gateway", "api_keys", i), k) for i, k in enumerate(gw.api_keys)]
    problems: list[Problem] = []
    items: list[Entry] = []
    if gw.api_keys_file:
        path = Path(src.file).parent / Path(gw.api_keys_file).expanduser()
        try:
            items, problems = _read_items(path, env)
        except ConfigError as exc:
            problems = exc.problems
        except (OSError, UnicodeDecodeError) as exc:
            return [src.problem(("gateway", "api_keys_file"), f"cannot read keys file {path}: {exc}")]
    problems += check_keys(entries + items, served, gw.priority_classes, gw.default_priority)
    if any(p.file != src.file for p in problems):   # the fleet file's line that names the keys file, too
        problems.insert(0, src.problem(("gateway", "api_keys_file"), f"invalid keys file {path}"))
    if not problems:
        gw._file_keys = [k for _, _, k in items]
    return problems
