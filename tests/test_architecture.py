"""The rooms' boundaries, checked on the source: the launcher never imports the worker side."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ddprun"


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def test_launcher_rooms_never_import_the_worker_side():
    launcher_files = [p for p in PACKAGE.rglob("*.py") if "worker" not in p.relative_to(PACKAGE).parts]
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{line}: {name}"
                 for path in launcher_files for line, name in _imported_modules(path)
                 if name == "ddprun.worker" or name.startswith("ddprun.worker.")]
    assert launcher_files and not offenders, "\n".join(offenders)
