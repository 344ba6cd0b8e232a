#!/usr/bin/env bash
# Regenerates the Python gRPC code from the .proto files with grpcio-tools. The output is
# committed (a plain install needs no code generation); tests/test_serving.py checks that it
# is what this script produces. proto/ is the include path, so the file is registered as
# genrec/v1/recommender.proto (wire names genrec.v1.*); proto/genrec installs as the
# genrec.proto package, and the generated imports are rewritten to match.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I proto --python_out=proto --pyi_out=proto --grpc_python_out=proto \
    proto/genrec/v1/recommender.proto
sed -i -e 's/^from genrec\.v1 import /from genrec.proto.v1 import /' proto/genrec/v1/recommender_pb2_grpc.py
sed -i -e "s/'genrec\.v1\.recommender_pb2'/'genrec.proto.v1.recommender_pb2'/" proto/genrec/v1/recommender_pb2.py
