"""The service's layout, enforced: one framework-free core under thin protocols and transports.

    service/core/       the infer core: admission, readiness, the request type and its limits, batching,
                        ONNX Runtime, model control, metrics, logs; no web framework
    service/protocols/  codecs (bytes <-> tensors, their own error body); the core only
    service/config.py   the settings; the core's limit types only
    service/http/       the only place that knows uvicorn, Starlette and FastAPI
    service/*.py        entry points (python -m service, Ray Serve, the ASGI factory)

Read from the source (every import statement, at any depth of a module), not from what happens to be
imported at run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVICE = Path(__file__).resolve().parents[2] / "service"
WEB = ("fastapi", "starlette", "uvicorn")
# What each room may import of the service (itself always).
ALLOWED = {
    "core": {"core"},
    "protocols": {"core"},
    "config": {"core"},
    "http": {"core", "protocols", "config", "http"},
    "entry": {"core", "protocols", "config", "http", "entry"},
}


def room(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("core", "protocols", "http"):
        return parts[1]
    return "config" if parts[1:] == ["config"] else "entry"


def imports(path: Path, package: str | None = None) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, relative ones resolved against its package."""
    package = package or ".".join(path.relative_to(SERVICE.parent).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found.append((node.lineno, base))
            # `from service import x` names a module of the package
            if base == "service":
                found += [(node.lineno, f"service.{alias.name}") for alias in node.names]
    return found


MODULES = sorted(SERVICE.rglob("*.py"))


def name_of(path: Path) -> str:
    return ".".join(path.relative_to(SERVICE.parent).with_suffix("").parts).removesuffix(".__init__")


def test_the_rooms_are_all_there():
    rooms = {room(name_of(p)) for p in MODULES}
    assert rooms == set(ALLOWED)


@pytest.mark.parametrize("path", MODULES, ids=name_of)
def test_nothing_imports_upward(path):
    mine = room(name_of(path))
    wrong = [f"line {line}: {module}" for line, module in imports(path)
             if module.startswith("service.") and room(module) not in ALLOWED[mine] | {mine}]
    assert not wrong, f"{name_of(path)} ({mine}) may import only {sorted(ALLOWED[mine])} of the service: {wrong}"


@pytest.mark.parametrize("path", [p for p in MODULES if room(name_of(p)) in ("core", "protocols", "config")],
                         ids=name_of)
def test_core_and_protocols_know_no_web_framework(path):
    wrong = [f"line {line}: {module}" for line, module in imports(path) if module.split(".")[0] in WEB]
    assert not wrong, f"{name_of(path)} imports a web framework: {wrong}"


@pytest.mark.parametrize("path", MODULES, ids=name_of)
def test_only_the_repository_contract_of_the_exporter(path):
    """service/ never imports torch (its image has none): of export/ it reads the repository only."""
    wrong = [f"line {line}: {module}" for line, module in imports(path)
             if module.split(".")[0] in ("torch", "models") or (module.startswith("export") and module not in
                                                                 ("export", "export.repository"))]
    assert not wrong, f"{name_of(path)}: {wrong}"


def test_the_checks_see_a_violation(tmp_path):
    """The reader finds imports inside functions, relative ones, and `from service import x`."""
    probe = tmp_path / "probe.py"
    probe.write_text("import numpy\n\ndef f():\n    from ..http import app\n    from fastapi import FastAPI\n"
                     "    from service import serve\n")
    found = [module for _, module in imports(probe, "service.core")]
    assert found == ["numpy", "service.http", "fastapi", "service", "service.serve"]
    assert room("service.http") == "http" and "http" not in ALLOWED["core"]
    assert room("service.serve") == "entry" and "entry" not in ALLOWED["protocols"]
