"""Model families. Everything specific to one architecture lives in one module here, behind
``base.Family``; this registry picks the family from the settings or, by default, from the
model folder's ``model_index.json`` ``_class_name``, as SGLang does."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

from workers.families import qwen_image, qwen_image_edit, wan, wan_i2v
from workers.families.base import Family
from workers.queue.served_model import Workflow

FAMILIES: dict[str, Family] = {}
DEFAULT_FAMILY = wan.FAMILY.name  # what a random preset builds when the settings name no family


class UnknownFamilyError(ValueError):
    """A model folder or setting names a family this build does not serve."""


# A family's name is the first part of a model's id (``family/name``) and a metrics label.
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


def register(family: Family) -> Family:
    """Serve ``family`` under its name: how a family defined outside this package (a
    plug-in, which ``model.family`` names as ``package.module:ATTRIBUTE``) joins the built-in
    ones. A name is one family's: registering another under it is an error."""
    if not _NAME.match(family.name):
        raise UnknownFamilyError(f"model family name {family.name!r} must be lower-case "
                                 "letters, digits, '.', '_' or '-'")
    taken = FAMILIES.get(family.name)
    if taken is not None and taken is not family:
        raise UnknownFamilyError(f"model family {family.name!r} is registered already "
                                 f"(serving {taken.pipeline_class})")
    FAMILIES[family.name] = family
    return family


BUILT_IN = tuple(register(f) for f in (wan.FAMILY, wan_i2v.FAMILY, qwen_image.FAMILY,
                                         qwen_image_edit.FAMILY))


def built_in_for(workflow: Workflow) -> Family:
    """The built-in family that serves ``workflow`` (the first, where several do): how a
    benchmark picks the model it measures without naming a family."""
    return next(f for f in BUILT_IN if workflow in f.limits.workflows)


def preset_family(preset: str) -> Family:
    """The family a folder of a built-in preset is built as when the settings name none
    (``shapes``: the trained model's; ``default``: the default family's)."""
    if not any(preset in f.presets for f in BUILT_IN):
        raise UnknownFamilyError(f"no built-in family has a preset {preset!r}")
    return family_named(family_to_build("auto", preset))


def is_built(directory: Path) -> bool:
    return (directory / "model_index.json").exists()


def family_named(name: str) -> Family:
    """A registered family by name, or a plug-in by its import path (``module:ATTRIBUTE``,
    a ``Family``), imported and registered: every process that reads the setting (each
    worker, each rank of a group) imports it alike, so no other module need know it."""
    if ":" in name:
        return register(_plug_in(name))
    try:
        return FAMILIES[name]
    except KeyError:
        raise UnknownFamilyError(f"model family {name!r} is not supported; supported: "
                                 f"{sorted(FAMILIES)}, or a plug-in's module:ATTRIBUTE"
                                 ) from None


def _plug_in(path: str) -> Family:
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute or module_name.startswith("."):
        raise UnknownFamilyError(f"model family {path!r} is not package.module:ATTRIBUTE")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except Exception as exc:  # whatever the plug-in's import raises: one line, not a trace
        raise UnknownFamilyError(f"model family {path!r} names no importable attribute: "
                                 f"{type(exc).__name__}: {exc}") from None
    if not isinstance(found, Family):
        raise UnknownFamilyError(f"model family {path!r} is a {type(found).__name__}, not a "
                                 "workers.families.base.Family")
    return found


def family_of(directory: Path) -> Family:
    """The built-in family whose pipeline class the folder's ``model_index.json`` names."""
    class_name = pipeline_class_of(directory)
    for family in BUILT_IN:
        if family.pipeline_class == class_name:
            return family
    raise UnknownFamilyError(
        f"{directory / 'model_index.json'} names pipeline class {class_name!r}, which no "
        f"family serves; supported: {sorted(f.pipeline_class for f in BUILT_IN)}")


def pipeline_class_of(directory: Path) -> str | None:
    class_name: str | None = json.loads(
        (directory / "model_index.json").read_text()).get("_class_name")
    return class_name


def family_to_build(setting: str, preset: str) -> str:
    """The family a folder still to be built gets: the one the setting names, else the only
    built-in family with that preset (the trained ``shapes`` model is Qwen-Image's), else the
    default. A plug-in is served only where the setting names it."""
    if setting != "auto":
        return setting
    owners = [f.name for f in BUILT_IN if preset in f.presets]
    return owners[0] if len(owners) == 1 else DEFAULT_FAMILY


def resolve(setting: str, directory: Path, preset: str) -> Family:
    """The family to serve: the one the setting names, or (``auto``) the folder's, or the
    preset's family for a folder still to be built. A folder whose pipeline class is not the
    named family's is an error (two families may serve one class: a plug-in beside the
    built-in family whose pipeline it drives)."""
    if setting == "auto":
        return family_of(directory) if is_built(directory) else family_named(
            family_to_build(setting, preset))
    family = family_named(setting)
    held = pipeline_class_of(directory) if is_built(directory) else family.pipeline_class
    if held != family.pipeline_class:
        owner = next((f.name for f in BUILT_IN if f.pipeline_class == held), None)
        what = f"a {owner} model ({held})" if owner else f"a {held} model"
        raise UnknownFamilyError(f"model.family is {setting!r} but {directory} holds {what}, "
                                 f"not the family's {family.pipeline_class}")
    return family
