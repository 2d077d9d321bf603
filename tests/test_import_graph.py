"""No import cycle anywhere in the project's own modules (tests aside), counting the imports
made inside functions too: ``make lint``'s contracts keep the layers and each package's
siblings acyclic; this checks the whole tree, module by module."""

from __future__ import annotations

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
