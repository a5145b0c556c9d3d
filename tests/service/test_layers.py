"""The service's layout, enforced: one framework-free core under thin protocols and transports.

    service/core/       the infer core: admission, readiness, the request type and its limits, batching,
                        ONNX Runtime, model control, metrics, logs; no web framework
    service/protocols/  codecs (bytes <-> tensors, their own error body); the core only
    service/config.py   the settings; the core's limit types only
    service/http/       the only place that knows uvicorn, Starlette and FastAPI
    service/grpc/       the gRPC transport (grpc.aio), beside http/: neither imports the other
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
    "grpc": {"core", "protocols", "config", "grpc"},
    "entry": {"core", "protocols", "config", "http", "grpc", "entry"},
}


def room(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("core", "protocols", "http", "grpc"):
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


@pytest.mark.parametrize("path", [p for p in MODULES if room(name_of(p)) in ("core", "protocols", "config", "grpc")],
                         ids=name_of)
def test_core_and_protocols_know_no_web_framework(path):
    """Nor gRPC's transport: it runs on uvicorn's event loop, and knows nothing else of it."""
    wrong = [f"line {line}: {module}" for line, module in imports(path) if module.split(".")[0] in WEB]
    assert not wrong, f"{name_of(path)} imports a web framework: {wrong}"


@pytest.mark.parametrize("path", MODULES, ids=name_of)
def test_only_the_repository_contract_of_the_exporter(path):
    """service/ never imports torch (its image has none): of export/ it reads the repository only. One
    exception: the `attend` console script (service/cli.py) runs `attend export` through the exporter's
    own entry point, imported in the function that runs it (the service's process never gets there)."""
    allowed = ("export", "export.repository", *(("export.cli",) if name_of(path) == "service.cli" else ()))
    wrong = [f"line {line}: {module}" for line, module in imports(path)
             if module.split(".")[0] in ("torch", "models") or (module.startswith("export") and module not in
                                                                 allowed)]
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
    assert room("service.grpc.server") == "grpc" and "grpc" not in ALLOWED["http"] and "http" not in ALLOWED["grpc"]


# The uvicorn internals the transport touches (service/http/extensions.py lists them): each must exist in
# the installed uvicorn, which pyproject.toml bounds to the versions this suite runs with.
_PROTOCOL_FIELDS = ("cycle", "connections", "tasks", "flow", "pipeline", "url", "headers", "scope", "app", "config",
                    "loop", "transport", "parser")
_CYCLE_FIELDS = ("body", "more_body", "disconnected", "response_started", "response_complete",
                 "waiting_for_100_continue")


def _assigned(cls: type) -> set[str]:
    """The instance fields a class's source assigns (self.x = ..., self.x: T = ..., self.x += ...)."""
    import inspect
    import re

    return set(re.findall(r"self\.(\w+)\s*(?::[^=\n]+)?[+]?=", inspect.getsource(cls)))


def test_the_uvicorn_internals_the_transport_touches_are_there():
    from uvicorn import Config, Server
    from uvicorn.protocols.http import httptools_impl
    from uvicorn.protocols.http.flow_control import FlowControl
    from uvicorn.supervisors import multiprocess

    protocol, cycle = httptools_impl.HttpToolsProtocol, httptools_impl.RequestResponseCycle
    for name in ("connection_made", "data_received", "on_message_begin", "on_headers_complete", "on_body",
                 "on_message_complete", "on_response_complete", "connection_lost", "shutdown"):
        assert callable(getattr(protocol, name)), name
    assert set(_PROTOCOL_FIELDS) <= _assigned(protocol), set(_PROTOCOL_FIELDS) - _assigned(protocol)
    assert set(_CYCLE_FIELDS) <= _assigned(cycle), set(_CYCLE_FIELDS) - _assigned(cycle)
    assert {"read_paused"} <= _assigned(FlowControl) and callable(FlowControl.resume_reading)
    for name in ("startup", "shutdown", "handle_exit"):
        assert callable(getattr(Server, name)), name
    assert {"servers", "server_state", "lifespan", "started", "config"} <= _assigned(Server)
    assert "backlog" in _assigned(Config)
    assert {"processes", "sockets", "should_exit"} <= _assigned(multiprocess.Multiprocess)
    assert callable(multiprocess.Multiprocess.terminate_all) and callable(multiprocess.Multiprocess.handle_hup)
    assert {"config", "_server"} <= _assigned(multiprocess.Process)


def test_the_checks_of_the_contract_can_fail():
    class Probe:
        def __init__(self):
            self.kept: int = 1
            self.added = 2

    assert _assigned(Probe) == {"kept", "added"}
