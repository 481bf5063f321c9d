"""The configuration reference page (docs/reference/config.md), generated from the config dataclasses.

    python -m specforge_lite.config_reference          # rewrite the page
    python -m specforge_lite.config_reference --check  # exit 1 when the page differs from the dataclasses

Every key of ``config.Config`` with its type, its default, the value ``python train.py`` runs with (the
composed default: specforge_lite/conf/config.yaml and its groups), the range a number may take
(``config.RANGES``; a method's own: its settings' ``ranges``) and what it does: the comments written at the field
in config.py (the lines right above it and the one beside it), so the page and the code cannot drift apart;
tests/test_docs.py regenerates it and compares. Each draft method's own settings (methods/<name>/settings.py,
chosen with draft=<name>) follow in a section each.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import sys
import tokenize
import typing
from pathlib import Path

from . import config as config_module
from .compose import allowed_values, load_config
from .config import RANGES, Config, DraftSettings, draft_ranges
from .methods import METHODS

PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "config.md"
MISSING = object()


@dataclasses.dataclass
class Key:
    name: str  # dotted, e.g. "draft.num_layers"; "[]" marks the items of a list of sections
    type: str
    default: typing.Any
    composed: typing.Any  # what python train.py runs with (MISSING: the same as the default)
    meaning: str


def field_comments() -> dict[tuple[str, str], str]:
    """(class name, field name) -> its comment, in config.py and every method's settings module."""
    out = {}
    for module in (config_module, *(sys.modules[m.settings.__module__] for m in METHODS.values())):
        out.update(_comments(Path(module.__file__).read_text()))
    return out


def _comments(source: str) -> dict[tuple[str, str], str]:
    """The comment lines right above each field of the classes of ``source`` and the one beside it."""
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    lines = source.splitlines()
    out = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            above, line = [], item.lineno - 1
            while line >= 1 and lines[line - 1].strip().startswith("#"):
                above.insert(0, comments[line])
                line -= 1
            beside = [comments[item.lineno]] if item.lineno in comments else []
            out[(node.name, item.target.id)] = " ".join(above + beside)
    return out


def _section(kind) -> type | None:
    """The dataclass a field holds (directly, Optional, or as the items of a list), else None."""
    if dataclasses.is_dataclass(kind):
        return kind
    for arg in typing.get_args(kind):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _type_name(kind) -> str:
    if isinstance(kind, type) and not typing.get_args(kind):
        return kind.__name__
    return str(kind).replace("typing.", "").replace(f"{config_module.__name__}.", "")


def walk(cls, prefix: str, default, composed, comments) -> list[Key]:
    """The keys of one section; a section held in a field is its own row, then its keys."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name, kind = f"{prefix}{f.name}", hints[f.name]
        value = getattr(default, f.name)
        ran = getattr(composed, f.name)
        meaning = next((comments[c.__name__, f.name] for c in cls.__mro__ if (c.__name__, f.name) in comments), "")
        section = _section(kind)
        if section is None:
            keys.append(Key(name, _type_name(kind), value, MISSING if ran == value else ran, meaning))
            continue
        is_list = typing.get_origin(kind) is list
        if is_list:  # the items' keys, each item as the section's defaults
            keys.append(Key(name, _type_name(kind), value, MISSING if ran == value else "(set)", meaning))
            keys += walk(section, f"{name}[].", section(), section(), comments)
            continue
        shown = "(section)" if value is not None else None
        keys.append(Key(name, _type_name(kind), shown, MISSING if (ran is None) == (value is None) else "(set)",
                        meaning or _doc(section)))
        item = value if value is not None else section()
        keys += walk(section, f"{name}.", item, ran if ran is not None else item, comments)
    return keys


def _doc(cls) -> str:
    return " ".join((cls.__doc__ or "").split()) if cls.__doc__ and not cls.__doc__.startswith(cls.__name__) else ""


def reference_keys() -> list[Key]:
    # (output_dir is a timestamp when train.py runs: shown as such, the page stays the same from run to run)
    return walk(Config, "", Config(), load_config(["output_dir='runs/<timestamp>'"]), field_comments())


def method_keys() -> dict[str, list[Key]]:
    """Each method's own draft settings (those beyond DraftSettings'), by method."""
    shared, comments = {f.name for f in dataclasses.fields(DraftSettings)}, field_comments()
    out = {}
    for name, method in METHODS.items():
        composed = load_config([f"draft={name}", "output_dir='runs/<timestamp>'"]).draft
        keys = walk(method.settings, "draft.", method.settings(), composed, comments)
        out[name] = [k for k in keys if k.name.split(".", 1)[1] not in shared]
    return out


def undocumented() -> list[str]:
    """Keys without a word on what they do (tests/test_docs.py asks for none)."""
    keys = reference_keys() + [k for keys in method_keys().values() for k in keys]
    return [k.name for k in keys if not k.meaning]


def _cell(value) -> str:
    if value is MISSING:
        return "same"
    if value in ("(section)", "(set)"):
        return value
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = str(value).lower()
    else:
        text = str(value)
    return f"`{text}`".replace("|", "\\|")


def render() -> str:
    keys = reference_keys()
    lines = ["# Configuration reference", "",
             "Generated from the config dataclasses (`specforge_lite/config.py`) by "
             "`python -m specforge_lite.config_reference`; tests/test_docs.py regenerates it and fails when it "
             "differs, so it cannot drift. Set any key on the command line: `python train.py draft.ttt_length=5`.",
             "", "*default* is the dataclass default; *train.py* is what `python train.py` runs with, from "
             "specforge_lite/conf/config.yaml and its groups (the embedded default: SmolLM2-135M and the cpu_20min "
             "recipe), where that differs. *allowed* is the range a number is checked against before anything is "
             "built, or the values a choice takes (any other is refused when the settings are composed)."]
    sections = {f.name: f for f in dataclasses.fields(Config)}
    for key in keys:
        if key.name in sections and key.default == "(section)":  # a top-level section: its heading
            lines += ["", f"## {key.name}", ""]
            if key.meaning:
                lines += [key.meaning, ""]
            lines += ["| key | type | default | train.py | allowed | what it does |", "|---|---|---|---|---|---|"]
            continue
        if "." not in key.name:
            lines += ["", f"## {key.name}", "", "| key | type | default | train.py | allowed | what it does |",
                      "|---|---|---|---|---|---|"]
        lines.append(_row(key))
    for name, keys in method_keys().items():
        lines += ["", f"## draft={name}", "", f"The settings of `draft={name}` beside the shared `draft.*` keys above "
                  f"(`{METHODS[name].settings.__module__.replace('.', '/')}.py`).", "",
                  "| key | type | default | train.py | allowed | what it does |", "|---|---|---|---|---|---|"]
        ranges = {**RANGES, **draft_ranges(METHODS[name].settings)}
        lines += [_row(key, ranges, METHODS[name].settings) for key in keys]
    return "\n".join(lines) + "\n"


def _row(key: Key, ranges: dict[str, str] = RANGES, draft: type = DraftSettings) -> str:
    """``draft``: the settings class whose keys the row may name (a method's own section: that method's)."""
    choice = allowed_values(key.name, draft)  # (a closed choice: its values; a registry's: its names)
    allowed = f"`{ranges[key.name]}`" if key.name in ranges else ", ".join(f"`{v}`" for v in choice[1]) if choice \
        else ""
    return (f"| `{key.name}` | {_type_name_cell(key.type)} | {_cell(key.default)} | {_cell(key.composed)} | "
            f"{allowed} | {key.meaning.replace('|', chr(92) + '|')} |")


def _type_name_cell(kind: str) -> str:
    return f"`{kind}`".replace("|", "\\|")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m specforge_lite.config_reference", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare with the page instead of writing it")
    a = p.parse_args(argv)
    text = render()
    if a.check:
        if not PAGE.is_file() or PAGE.read_text() != text:
            sys.exit(f"error: {PAGE} differs from the config dataclasses; regenerate it: "
                     "python -m specforge_lite.config_reference")
        print(f"{PAGE} is up to date")
        return
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text)
    print(f"wrote {PAGE} ({text.count(chr(10))} lines)")


if __name__ == "__main__":
    main()
