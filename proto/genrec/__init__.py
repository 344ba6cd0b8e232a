"""The gRPC contract (genrec.v1, proto/genrec/v1/recommender.proto) and its generated code
(proto/generate.sh); installed as ``genrec.proto``."""
