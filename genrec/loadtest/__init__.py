"""The load-test client of genrec.v1.Recommender (``genrec loadtest``): proto + numpy + gRPC.

A client, not part of the server: it imports nothing from ``genrec.serve``, ``genrec.train``
or ``genrec.models`` (tests/test_layering.py), so it runs on any machine that can reach a
server.
"""
