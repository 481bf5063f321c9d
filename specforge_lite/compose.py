"""A run's settings composed: conf/ through Hydra into config.py's dataclasses, the draft's as its method's
settings class (draft=<name> chooses it; methods/<name>/settings.py holds it). Used by train.py, and by whatever
composes or reads a run's config (tests, evaluation, adaptation, the offline store)."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any, Callable

from .config import (CONF_DIR, RUN_LENGTH, SAVED_CONFIG_FIX, TRACKER_KINDS, Choice, Config, choices,
                     model_as_given, read_config_node, with_recipe)
from .methods import DEFAULT, METHODS, draft_method
from .targets.families import FAMILIES

# Settings whose values are the names of a registry that a plug-in extends (a family added in targets/families/),
# or a name or a list of names (tracker.kind, which OmegaConf cannot type as a Choice): checked against the names
# as they are when composed.
REGISTRIES: dict[str, Callable[[], typing.Iterable[str]]] = {"model.family": lambda: FAMILIES,
                                                             "tracker.kind": lambda: TRACKER_KINDS}


def register_configs() -> None:
    """The schema Hydra checks conf/ against, and the draft group: each registered method's settings class is
    the option ``draft=<name>`` (no YAML: its defaults are the class's)."""
    from hydra.core.config_store import ConfigStore

    from omegaconf import OmegaConf

    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for name, method in METHODS.items():
        cs.store(group="draft", name=name, node=method.settings(method=name))
    OmegaConf.register_new_resolver(TOKEN_BUDGET, recipe_token_budget, replace=True)


# A recipe's token budget per micro-batch: the scale recipe's ``trainer.micro_batch_tokens: ${token_budget:8192}``.
# A value the user gives replaces it (and is checked as given: settings.py).
TOKEN_BUDGET = "token_budget"


def recipe_token_budget(tokens: Any, *, _root_: Any) -> int | None:
    """``tokens``, or data.max_length where that is longer (a whole conversation fits a micro-batch); null where
    the run's rows cannot pack (``unpacked_reason``) or data.packing=true sizes micro-batches by
    trainer.micro_batch_size instead."""
    d = _root_.data
    if d.packing or unpacked_reason(_root_.model.family, str(d.source), _root_.draft.method):
        return None
    return max(int(tokens), int(d.max_length))


def unpacked_reason(family: str, source: str, method: str) -> str | None:
    """Why a run of a ``family`` target on data.source ``source`` training a ``method`` draft keeps one
    conversation per row, or None where several can share one (data.packing, trainer.micro_batch_tokens). An
    unknown family or method is refused elsewhere (None here)."""
    if source == "offline":
        return "a hidden-state store (data.source=offline) is read one sample per row"
    if family in FAMILIES and not FAMILIES[family].supports_packing:
        return (f"the {family} family cannot keep packed conversations apart (recurrent layers or model-computed "
                "positions)")
    if method in METHODS and not METHODS[method].packs_rows:
        return f"a {method} draft trains on rows of one conversation"
    return None


# Settings that are mappings of the user's own keys (eval.prompt_files.<set>=PATH): Hydra adds a key to them only
# with ``+`` (or ``++``, which also replaces one a recipe set), which the docs and the messages never write.
OPEN_MAPPINGS = ("eval.prompt_files.",)


def hydra_overrides(overrides: list[str]) -> list[str]:
    """The overrides as Hydra takes them: ``draft.method=<name>`` read as ``draft=<name>`` (the method is its
    settings group; naming two methods is refused), a key of an ``OPEN_MAPPINGS`` setting given as ``++``."""
    named = {o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] in ("draft", "draft.method")}
    if len(named) > 1:
        raise ValueError(f"draft={' and draft='.join(sorted(named))}: choose one method (draft=<name>)")
    return [f"draft={o.split('=', 1)[1]}" if o.startswith("draft.method=") else
            f"++{o}" if o.startswith(OPEN_MAPPINGS) and "=" in o else o for o in overrides]


# Settings read only when another setting says so, as (the key or a key prefix, whether this run reads it, what it
# needs). Most have a default, so only the command line tells a value given from that default: one given where it is
# not read is refused (``unread_given``), never dropped. (Those without a default are refused by value: settings.py.)
READ_WHEN: tuple[tuple[str, Callable[[Config], bool], str], ...] = (
    ("target.server_timeout", lambda c: c.target.backend == "vllm", "target.backend=vllm"),
    ("target.server_retries", lambda c: c.target.backend == "vllm", "target.backend=vllm"),
    ("trainer.deepspeed.", lambda c: c.trainer.deepspeed.enabled, "trainer.deepspeed.enabled=true (trainer=zero2, "
                                                                   "zero3, ...)"),
    ("trainer.muon_", lambda c: c.trainer.optimizer == "muon", "trainer.optimizer=muon"),
    ("draft.mask_token_id", lambda c: METHODS[c.draft.method].has_mask_slots(c.draft),
     "a draft with mask slots (draft.parallel_drafting=true, or a block draft)"),
    ("eval.tree_", lambda c: c.eval.drafting == "tree", "eval.drafting=tree"),
    ("data.generation.", lambda c: c.data.regenerate, "data.regenerate=true"),
    ("data.self_generated.", lambda c: c.data.regenerate and any(m.source == "self_generated" for m in c.data.mix),
     "a self_generated source in data.mix, with data.regenerate=true"),
)
NOT_READ_WHEN_EXEMPT = ("trainer.deepspeed.enabled",)


def given_setting(override: str) -> tuple[str, str] | None:
    """(key, value) of the setting an override gives a value, or None (a deletion ``~key``, an option)."""
    key, given, value = override.lstrip("+").partition("=")
    return (key, value) if given and not override.startswith(("~", "-")) else None


def as_given(config: Config, overrides: list[str]) -> Config:
    """``config`` composed from ``overrides``, with the settings they give recorded (``Config.command_line``); one
    given where this run would not read it is refused (``unread_given``)."""
    problems = unread_given(config, overrides)
    if problems:
        raise ValueError("; ".join(problems))
    config.command_line = frozenset(given[0] for given in map(given_setting, overrides) if given)
    return config


def unread_given(config: Config, overrides: list[str]) -> list[str]:
    """Each override of ``READ_WHEN`` that this run would not read, in one line with what it needs."""
    problems = []
    for key, value in filter(None, map(given_setting, overrides)):
        if key in NOT_READ_WHEN_EXEMPT:
            continue
        for prefix, read, needs in READ_WHEN:
            if (key == prefix or (prefix.endswith((".", "_")) and key.startswith(prefix))) and not read(config):
                problems.append(f"{key}={value} is read only with {needs}: set that, or drop {key}")
                break
    return problems


# OmegaConf's detail lines under its message (the key again, the classes): the key and value lead the one line
DETAIL_LINES = ("full_key:", "reference_type=", "object_type=")


def composition_error(e: Exception) -> str:
    """Hydra's or OmegaConf's refusal of an override, as one line led by the override (or the unknown key)."""
    from omegaconf.errors import ConfigKeyError

    if isinstance(e, ConfigKeyError) and getattr(e, "full_key", None):
        return f"{e.full_key}: no such setting (python train.py --help lists every key)"
    lines = [line.strip() for part in (e, e.__cause__) if part is not None for line in str(part).splitlines()]
    lines = [line for line in lines if line and not line.startswith(DETAIL_LINES)]
    merging = re.fullmatch(r"Error merging override (\S+)", lines[0]) if lines else None
    if merging:
        return f"{merging.group(1)}: {' '.join(lines[1:])}"
    quoted = re.search(r"'([^'=]+=[^']*)'", lines[0]) if lines else None
    return f"{quoted.group(1)}: {' '.join(lines)}" if quoted else " ".join(lines) or type(e).__name__


def draft_setting_problems(overrides: list[str]) -> list[str]:
    """Each ``draft.<key>=`` override that the chosen method's settings do not have (or an unknown method), as
    one line with the fix: what Hydra would otherwise refuse in several lines, proposing ``+draft.<key>``."""
    chosen = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == "draft"), DEFAULT)
    if "," in chosen:  # (a sweep over methods: each job's own composition checks it)
        return []
    try:
        settings = draft_method(chosen).settings
    except ValueError as e:
        return [str(e)]
    own = {f.name for f in dataclasses.fields(settings)}
    problems = []
    for override in overrides:
        key = override.split("=", 1)[0]
        if key.startswith("draft.") and key.split(".")[1] not in own:
            problems.append(f"draft={chosen} does not take {key}: it is not one of its settings "
                            f"({', '.join(sorted(own - {'method'}))}); leave it out, or choose a method that has it")
    return problems


def override_problems(overrides: list[str]) -> list[str]:
    """What Hydra would refuse of the command line's overrides, or compose without refusing, each said in one line
    (``draft_setting_problems``, ``choice_problems``, ``kind_problems``, ``given_problems``)."""
    return draft_setting_problems(overrides) + choice_problems(overrides) + kind_problems(overrides) + \
        given_problems(overrides)


def given_problems(overrides: list[str]) -> list[str]:
    """Settings given on the command line that the run would not read, where only the command line tells a value
    given from a recipe's: both lengths of a run (config.py ``RUN_LENGTH``), and a draft vocabulary for a method
    that keeps the whole target vocabulary (the scale recipe sets one for every method)."""
    given = dict(o.lstrip("+").split("=", 1) for o in overrides if "=" in o and not o.startswith(("-", "~")))
    problems = []
    if all(given.get(key, "null") != "null" for key in RUN_LENGTH):  # (epochs=null: ``with_run_length``'s own)
        problems.append(f"{RUN_LENGTH[0]}={given[RUN_LENGTH[0]]} and {RUN_LENGTH[1]}={given[RUN_LENGTH[1]]}: a run's "
                        "length is one of them; drop the other")
    method = METHODS.get(given.get("draft", DEFAULT))
    if method is not None and method.whole_vocabulary and "draft.draft_vocab_size" in given:
        problems.append(f"draft={method.name} drafts over the target's whole vocabulary whatever "
                        f"draft.draft_vocab_size says: drop draft.draft_vocab_size={given['draft.draft_vocab_size']}")
    return problems


def choice_problems(overrides: list[str]) -> list[str]:
    """Each override giving a closed choice (a ``Choice`` field of config.py or a method's settings, a registry's
    names: ``REGISTRIES``) a value it does not have, as "key=value: not one of a, b": Hydra's own refusal spans
    lines, and ``--cfg job`` would print a registry's unknown name as a valid setting. Each value of a sweep
    (``key=a,b``) is checked; Hydra's other sweep forms and interpolations are left to the composition."""
    draft = chosen_settings(overrides)
    problems = []
    for key, one in given_values(overrides):
        allowed = allowed_values(key, draft)
        if allowed is not None and one not in allowed[0]:
            problems.append(not_one_of(key, one, allowed[1]))
    return problems


def chosen_settings(overrides: list[str]) -> type | None:
    """The settings class of the method the overrides choose (None: a sweep over methods, each job's own)."""
    chosen = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == "draft"), DEFAULT)
    return METHODS[chosen].settings if chosen in METHODS else None


def given_values(overrides: list[str]) -> list[tuple[str, str]]:
    """(key, value) of each value the overrides give, each of a sweep's (``key=a,b``); Hydra's other sweep forms and
    interpolations are left to the composition."""
    found = []
    for key, value in filter(None, map(given_setting, overrides)):
        if not any(c in value for c in "([{$"):
            found += [(key, one.strip().strip("'\"")) for one in value.split(",")]
    return found


KIND_WORDS = {bool: "true or false", int: "an integer", float: "a number"}  # (each kind, as a refusal names it)


def kind_problems(overrides: list[str]) -> list[str]:
    """Each override giving a number or a bool setting a value of another kind ("key=value: not an integer"):
    Hydra's own refusal spans six lines."""
    draft = chosen_settings(overrides)
    problems = []
    for key, one in given_values(overrides):
        kind, optional = setting_type(key, draft) or (None, False)
        if kind in KIND_WORDS and not (optional and one == "null") and not is_kind(kind, one):
            problems.append(f"{key}={one}: not {KIND_WORDS[kind]}")
    return problems


def is_kind(kind: type, value: str) -> bool:
    """Whether ``value`` reads as a ``kind`` (bool, int or float): OmegaConf's own node for that kind takes it."""
    from omegaconf import BooleanNode, FloatNode, IntegerNode
    from omegaconf.errors import ValidationError

    try:
        {bool: BooleanNode, int: IntegerNode, float: FloatNode}[kind](value)
        return True
    except ValidationError:
        return False


def not_one_of(key: str, value: Any, offered: list[str]) -> str:
    return f"{key}={value}: not one of {', '.join(offered)}"


def allowed_values(key: str, draft: type | None) -> tuple[set[str], list[str]] | None:
    """The values a setting may be given (an earlier version's names included) and those it offers, for a closed
    choice; None for any other setting. ``draft``: the chosen method's settings class (None: unknown)."""
    if key in REGISTRIES:
        names = sorted(REGISTRIES[key]())
        return set(names), names
    kind, optional = setting_type(key, draft) or (None, False)
    if not (isinstance(kind, type) and issubclass(kind, Choice)):
        return None
    null = ["null"] if optional else []
    return {*kind.__members__, *null}, [*choices(kind), *null]


def setting_type(key: str, draft: type | None) -> tuple[Any, bool] | None:
    """(the type, whether null is allowed) of the setting ``key`` names in config.py (``draft``: the chosen
    method's settings class); None for a key that names no setting."""
    kind: Any = Config
    for part in key.split("."):
        if kind is Config and part == "draft":
            kind = draft
            continue
        if not (dataclasses.is_dataclass(kind) and part in {f.name for f in dataclasses.fields(kind)}):
            return None
        kind = typing.get_type_hints(kind)[part]
    optional = type(None) in typing.get_args(kind)
    return (next((k for k in typing.get_args(kind) if k is not type(None)), kind) if optional else kind), optional


def registry_problems(config: Config) -> list[str]:
    """Each ``REGISTRIES`` setting of a composed config (a preset's, a saved run's) that names no registered
    entry, as "key=value: not one of a, b"."""
    problems = []
    for key in REGISTRIES:
        value: Any = config
        for part in key.split("."):
            value = getattr(value, part)
        accepted, offered = allowed_values(key, None)  # type: ignore[misc]
        problems += [not_one_of(key, one, offered) for one in (value if isinstance(value, list) else [value])
                     if one not in accepted]
    return problems


def to_config(cfg: Any) -> Config:
    """An OmegaConf node (from Hydra or a saved run's config.yaml) as the typed dataclass tree. A run saved
    before each method had its own settings holds every method's: those of the others at their defaults are
    dropped; one set otherwise is refused (the file is not what its method says), and so is a registry's name
    that names nothing registered (``registry_problems``)."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import ConfigKeyError

    tree = OmegaConf.to_container(cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg), resolve=True)
    method = draft_method((tree.get("draft") or {}).get("method") or DEFAULT)
    if "draft" in tree:
        tree["draft"] = method_settings(method.settings, tree["draft"])
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config(draft=method.settings())), tree)
    except ConfigKeyError as e:  # (a key Hydra added, +foo=1: the typed tree has no such setting)
        raise ValueError(composition_error(e)) from None
    config: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    config.model = model_as_given(config.model)  # (a path the user gave is that target, never the preset's package)
    problems = registry_problems(config)
    if problems:
        raise ValueError("; ".join(problems))
    return config


def read_config_file(path: Path) -> Config:
    """A saved configuration file as the typed tree (config.py ``read_config_node``); a setting that does not
    exist, a value it cannot take, or a method's settings that are not its method's are refused in one line naming
    the file and the setting."""
    from omegaconf.errors import OmegaConfBaseException

    from .errors import UserError

    node = read_config_node(path)
    try:
        return to_config(node)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise UserError(f"{path}: {key + ': ' if key else ''}{str(e).splitlines()[0]}; {SAVED_CONFIG_FIX}") from None
    except ValueError as e:  # (draft_method: no such method; method_settings: another method's settings)
        raise UserError(f"{path}: {e}") from None


def method_settings(settings: type, saved: dict) -> dict:
    """The saved draft settings that ``settings`` has (an earlier version's read in its names: ``saved``);
    another method's at that method's default (or a default it had before: its ``former_defaults``) dropped."""
    saved = settings.saved(saved)
    own = {f.name for f in dataclasses.fields(settings)}
    defaults = {f.name: f.default for m in METHODS.values() for f in dataclasses.fields(m.settings)
                if f.name not in own}
    former = {key: values for m in METHODS.values() for key, values in m.settings.former_defaults.items()}
    foreign = {key: value for key, value in saved.items() if key not in own and (
        key not in defaults or (defaults[key] != value and value not in former.get(key, ())))}
    if foreign:
        raise ValueError(f"the saved draft settings {foreign} are not settings of a {saved.get('method', DEFAULT)} "
                         "draft: give the config.yaml of a run this version can read, or write its draft settings "
                         "again")
    return {key: value for key, value in saved.items() if key in own}


def load_config(overrides: list[str] | None = None, config_name: str = "config") -> Config:
    """Compose the Hydra config from Python (tests, eval, export) exactly as train.py would (the recipe the
    target calls for included: ``with_recipe``)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    overrides = hydra_overrides(with_recipe(list(overrides or [])))
    problems = override_problems(overrides)
    if problems:
        raise ValueError("; ".join(problems))
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            cfg = compose(config_name=config_name, overrides=overrides)
        except (HydraException, OmegaConfBaseException) as e:
            raise ValueError(composition_error(e)) from None
    return as_given(to_config(cfg), overrides)
