"""No import cycle anywhere in the project's own modules (tests aside), counting the imports
made inside functions too: ``make lint``'s contracts keep the layers and each package's
siblings acyclic; this checks the whole tree, module by module. And a family's knowledge stays
in its room: no other module names a family."""

from __future__ import annotations

import re
from pathlib import Path

import grimp

PACKAGES = ("keys", "config", "cachesvc", "supervision", "uploads", "encoders", "workers",
            "admission", "api", "cli", "training", "docsgen", "bench")


def test_no_module_imports_what_imports_it() -> None:
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True)
    cycles = [(importer, imported) for importer in sorted(graph.modules)
              for imported in sorted(graph.find_modules_directly_imported_by(importer))
              if graph.chain_exists(importer=imported, imported=importer)]
    assert not cycles, f"each of these imports is part of a cycle: {cycles}"
    assert len(graph.modules) > 100  # the whole tree, not a package that failed to load


# The built-in families and their parts, as code and prose name them ("Wan2.1", "qwen_image",
# "QwenImagePipeline", "UMT5EncoderModel", "UniPC"), and not words that start alike ("want").
FAMILY_NAMES = re.compile(r"\b(Wan|wan|Qwen|qwen|UMT5|umt5|UniPC|unipc)(?![a-z])")


def test_no_module_outside_the_families_names_a_family() -> None:
    root = Path(__file__).parent.parent
    named = {f"{path.relative_to(root)}:{n}": line.strip()
             for package in PACKAGES for path in sorted((root / package).rglob("*.py"))
             if "families" not in path.relative_to(root).parts[:2]
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if FAMILY_NAMES.search(line)}
    assert not named, f"a family's name outside workers/families/: {named}"
