#!/usr/bin/env bash
# Regenerates the Python gRPC code from the .proto files with grpcio-tools. The output is
# committed (a plain install needs no code generation); tests/test_serving.py checks that it
# is what this script produces. The repository root is the include path, so the modules
# import as proto.genrec.v1.* while the wire names stay genrec.v1.*.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. proto/genrec/v1/recommender.proto
