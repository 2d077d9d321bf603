"""Model families. Everything specific to one architecture lives in one module here, behind
``base.Family``; this registry picks the family from the settings or, by default, from the
model folder's ``model_index.json`` ``_class_name``, as SGLang does."""

from __future__ import annotations

import json
from pathlib import Path

from workers.families import qwen_image, qwen_image_edit, wan, wan_i2v
from workers.families.base import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (wan.FAMILY, wan_i2v.FAMILY,
                                                     qwen_image.FAMILY, qwen_image_edit.FAMILY)}
DEFAULT_FAMILY = wan.FAMILY.name  # what a random preset builds when the settings name no family


class UnknownFamilyError(ValueError):
    """A model folder or setting names a family this build does not serve."""


def is_built(directory: Path) -> bool:
    return (directory / "model_index.json").exists()


def family_named(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise UnknownFamilyError(f"model family {name!r} is not supported; supported: "
                                 f"{sorted(FAMILIES)}") from None


def family_of(directory: Path) -> Family:
    """The family whose pipeline class the folder's ``model_index.json`` names."""
    index = directory / "model_index.json"
    class_name = json.loads(index.read_text()).get("_class_name")
    for family in FAMILIES.values():
        if family.pipeline_class == class_name:
            return family
    raise UnknownFamilyError(
        f"{index} names pipeline class {class_name!r}, which no family serves; supported: "
        f"{sorted(f.pipeline_class for f in FAMILIES.values())}")


def family_to_build(setting: str, preset: str) -> str:
    """The family a folder still to be built gets: the one the setting names, else the only
    family with that preset (the trained ``shapes`` model is Qwen-Image's), else the
    default."""
    if setting != "auto":
        return setting
    owners = [f.name for f in FAMILIES.values() if preset in f.presets]
    return owners[0] if len(owners) == 1 else DEFAULT_FAMILY


def resolve(setting: str, directory: Path, preset: str) -> Family:
    """The family to serve: the one the setting names, or (``auto``) the folder's, or the
    preset's family for a folder still to be built. A folder of another family is an error."""
    if is_built(directory):
        found = family_of(directory)
        if setting not in ("auto", found.name):
            raise UnknownFamilyError(f"model.family is {setting!r} but {directory} holds a "
                                     f"{found.name} model ({found.pipeline_class})")
        return found
    return family_named(family_to_build(setting, preset))
