"""The gRPC contract (genrec.v1) and its generated code (proto/generate.sh)."""
