"""Regenerate the Python stubs of ``proto/kvstore.proto`` beside it.

python proto/generate.py           write kvstore_pb2.py, kvstore_pb2.pyi, kvstore_pb2_grpc.py
python proto/generate.py --check   exit 1 if the committed stubs differ from fresh ones (CI)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
OUTPUTS = ("kvstore_pb2.py", "kvstore_pb2.pyi", "kvstore_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    args = [
        "protoc",
        f"-I{ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(ROOT / "proto" / "kvstore.proto"),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="fail when the committed stubs are stale")
    args = parser.parse_args()
    if not args.check:
        generate(ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = [
            name
            for name in OUTPUTS
            if (Path(tmp) / "proto" / name).read_text() != (ROOT / "proto" / name).read_text()
        ]
    if stale:
        print(f"stale generated stubs: {', '.join(stale)}; run python proto/generate.py", file=sys.stderr)
        return 1
    print("generated stubs are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
