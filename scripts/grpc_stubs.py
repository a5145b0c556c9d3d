"""The gRPC stubs of service/grpc/proto, generated again from the .proto files vendored beside them
(Triton's grpc_service.proto and model_config.proto, unchanged: the package's docstring names the
upstream commit).

    python scripts/grpc_stubs.py           write *_pb2.py, *_pb2.pyi and grpc_service_pb2_grpc.py
    python scripts/grpc_stubs.py --check   exit 1 where the committed stubs differ from what it would write

It needs grpcio-tools (the dev extra pins it to the locked grpcio: generated code requires a grpcio at
least as new as the tools, and a protobuf runtime of the protoc's major version, no older). protoc
writes `import model_config_pb2` as a top-level module; the stubs live in a package, so those
imports become relative ones. tests/service/test_grpc.py runs the check.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO = ROOT / "service" / "grpc" / "proto"
SOURCES = ("model_config.proto", "grpc_service.proto")
_IMPORT = re.compile(r"^import (\w+_pb2)( as \w+)?$", re.MULTILINE)


def generate(into: Path) -> list[Path]:
    """The stubs of SOURCES, written into `into`; their paths."""
    from grpc_tools import protoc  # a dev dependency: only this script needs it

    include = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto, as protoc's own
    status = protoc.main(["protoc", f"-I{PROTO}", f"-I{include}", f"--python_out={into}", f"--pyi_out={into}",
                          f"--grpc_python_out={into}", *(str(PROTO / s) for s in SOURCES)])
    if status != 0:
        raise SystemExit(f"protoc failed ({status})")
    (into / "model_config_pb2_grpc.py").unlink()  # no service in model_config.proto: nothing in it
    written = sorted(p for p in into.iterdir() if p.suffix in (".py", ".pyi"))
    for path in written:
        text = path.read_text()
        path.write_text(_IMPORT.sub(r"from . import \1\2", text))
    return written


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--check", action="store_true", help="compare with the committed stubs, write nothing")
    check = args.parse_args(argv).check
    with tempfile.TemporaryDirectory() as folder:
        stale = []
        for path in generate(Path(folder)):
            target = PROTO / path.name
            if check:
                if not target.exists() or target.read_text() != path.read_text():
                    stale.append(target.relative_to(ROOT))
            else:
                target.write_text(path.read_text())
                print(f"wrote {target.relative_to(ROOT)}")
    if stale:
        print(f"stale: {', '.join(map(str, stale))}: run python scripts/grpc_stubs.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
