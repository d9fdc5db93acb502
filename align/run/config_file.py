"""``--config FILE``: settings from a TOML, YAML or JSON file, read into the config's nested dict before the flags.

Keys are the flag names, kebab or snake case (``group-size`` / ``group_size``; ``eps-high``; ``adv-scale``).
Sections are optional: a table named after a config section holds that section's fields by field or flag name
(``[loss] eps_high = 0.28``, ``[adv] scale = "none"``, as a saved ``config.json`` nests them), and a table named
after a ``--help`` group holds flags (``[sampling] group-size = 8``). So a run's ``config.json`` loads back through
the same path, and a recipe may read flat or sectioned.

Errors are one line naming the file, the key (and its line when found in the text) and the fix: an unknown key
names the nearest valid one (``difflib``), a wrong type names the key and the expected type, a syntax error the
parser's line, a YAML file without PyYAML the extra to install.

TOML: ``tomllib`` (Python 3.11+), the ``tomli`` backport on 3.10 (``pip install 'align[toml]'``). YAML: PyYAML
(``pip install 'align[yaml]'``).
"""

from __future__ import annotations

import difflib
import json
import re
import sys
from pathlib import Path
from typing import Any

SUFFIXES = {".toml": "toml", ".yaml": "yaml", ".yml": "yaml", ".json": "json"}


def read_file(path: str) -> dict:
    """The file's top-level mapping (not yet checked against a config); ``ValueError`` naming the file (and line)."""
    kind = SUFFIXES.get(Path(path).suffix.lower())
    if kind is None:
        raise ValueError(f"--config {path}: unknown file type; use a .toml, .yaml / .yml or .json file")
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(f"--config {path}:{line}: not UTF-8 text (byte {raw[e.start : e.start + 1]!r})") from None
    loaded = _PARSERS[kind](path, text)
    if loaded is None and kind == "yaml":
        loaded = {}
    if not isinstance(loaded, dict):
        raise ValueError(  # noqa: TRY004 -- a bad file, reported as one argparse error
            f"--config {path}: the top level must be a {_TOP[kind]} of settings (flag names to values, as in a saved "
            f"config.json), got a {type(loaded).__name__}"
        )
    return loaded


def _json(path: str, text: str) -> Any:
    def unique(pairs: list[tuple[str, Any]]) -> dict:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                raise ValueError(f"--config {path}: key {key!r} is set twice in one object; keep one")
            seen[key] = value
        return seen

    try:
        return json.loads(text, object_pairs_hook=unique)
    except json.JSONDecodeError as e:
        raise ValueError(f"--config {path}:{e.lineno}: not valid JSON ({e.msg})") from None


def _toml(path: str, text: str) -> Any:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover -- Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ValueError(
                f"--config {path}: reading TOML on Python 3.10 needs the tomli backport: pip install 'align[toml]' "
                "(or use a .json / .yaml file)"
            ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {path}: not valid TOML ({e})") from None  # the message carries line and column


def _yaml(path: str, text: str) -> Any:
    try:
        import yaml
    except ImportError:
        raise ValueError(
            f"--config {path}: reading YAML needs PyYAML: pip install 'align[yaml]' (or use a .toml / .json file)"
        ) from None

    class UniqueKeys(yaml.SafeLoader):  # PyYAML keeps the last of two equal keys silently; a config file may not
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if isinstance(key, str) and key in seen:
                    raise ValueError(
                        f"--config {path}:{key_node.start_mark.line + 1}: key {key!r} is set twice in one mapping; "
                        "keep one"
                    )
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    try:
        return yaml.load(text, Loader=UniqueKeys)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ValueError(f"--config {path}{where}: not valid YAML ({getattr(e, 'problem', None) or e})") from None


_PARSERS = {"json": _json, "toml": _toml, "yaml": _yaml}
_TOP = {"json": "JSON object", "toml": "TOML table", "yaml": "YAML mapping"}


def load(path: str, cls: type, prefixes: dict[str, str]) -> dict:
    """``path`` read into ``cls``'s nested-dict shape (``dataclasses.asdict``), every key known and every value of
    its field's type; ``ValueError`` naming the file, key (and line) otherwise."""
    from align.run.fields import _flags, check_value, hints_of
    from align.run.help import section_of

    data = read_file(path)
    text = Path(path).read_text(encoding="utf-8")
    by_flag = {flag: p for flag, p, _, _ in _flags(cls, prefixes)}
    sections = {p[0] for p in by_flag.values() if len(p) > 1}
    groups = {section_of(p) for p in by_flag.values()}
    fields_in = {s: {p[1]: p for p in by_flag.values() if len(p) > 1 and p[0] == s} for s in sections}
    out: dict = {}

    def fail(key: str, why: str) -> ValueError:
        m = re.search(rf"^[ \t]*[\"']?{re.escape(key)}[\"']?\s*[:=]", text, flags=re.MULTILINE)
        line = f":{text.count(chr(10), 0, m.start()) + 1}" if m else ""
        return ValueError(f"--config {path}{line}: {why}")

    def put(key: str, value: Any, p: tuple[str, ...]) -> None:
        try:
            value = check_value(key, value, hints_of(p, cls))
        except ValueError as e:
            raise fail(key.rpartition(".")[2], str(e)) from None
        node = out
        for q in p[:-1]:
            node = node.setdefault(q, {})
        node[p[-1]] = value

    def unknown(key: str, where: str, valid: list[str]) -> ValueError:
        near = difflib.get_close_matches(key.replace("_", "-"), valid, n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]!r}?" if near else "; python -m align.train --help lists the flags"
        return fail(key, f"unknown key {key!r}{where}{hint}")

    def walk(mapping: dict, section: str | None, dotted: str) -> None:
        for key, value in mapping.items():
            if not isinstance(key, str):
                raise fail(str(key), f"key {key!r} is not a string")
            snake, kebab = key.replace("-", "_"), key.replace("_", "-")
            name = dotted + key
            if section is not None:  # inside [loss] / [adv] ...: a field name, or the section's flag name
                p = fields_in[section].get(snake) or by_flag.get(kebab)
                if p is None or p[0] != section:
                    raise unknown(key, f" in section [{section}]", [k.replace("_", "-") for k in fields_in[section]])
                put(name, value, p)
            elif kebab in by_flag and not (isinstance(value, dict) and snake in sections):
                put(name, value, by_flag[kebab])
            elif snake in sections and isinstance(value, dict):
                walk(value, snake, name + ".")
            elif key in groups and isinstance(value, dict):  # a --help group: flags by name
                walk_flags(value, name + ".")
            else:
                raise unknown(key, "", sorted(by_flag) + sorted(sections | groups))

    def walk_flags(mapping: dict, dotted: str) -> None:
        for key, value in mapping.items():
            p = by_flag.get(str(key).replace("_", "-"))
            if p is None:
                raise unknown(str(key), f" in [{dotted[:-1]}]", sorted(by_flag))
            put(dotted + str(key), value, p)

    walk(data, None, "")
    return out
