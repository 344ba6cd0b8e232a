"""Building an engine in this process, and readying a process that holds one.

Both the server (an in-process engine) and an engine process (``serve.worker``'s child)
build engines here, so neither imports the other: ``server -> failover -> worker -> factory``
and ``server -> factory`` (tests/test_layering.py checks that ``serve/`` has no import cycle).
"""

from __future__ import annotations

import gc


def make_engine(kind: str, artifact: str, device: str):  # noqa: ANN201 - an engine
    """The engine ``kind`` (torch, naive or sglang) for ``artifact``, in this process. Engines
    are imported lazily: the SGLang one pulls in SGLang, which only that engine needs."""
    if kind == "sglang":
        from genrec.serve.sglang_engine import SGLangEngine

        return SGLangEngine(artifact, device=device)
    from genrec.serve.engine import NaiveTorchEngine, TorchEngine

    return (NaiveTorchEngine if kind == "naive" else TorchEngine)(artifact, device=device)


def quiet_gc() -> None:
    """Moves every object alive now (torch, grpc, the model: hundreds of thousands of objects)
    into the collector's permanent generation. Otherwise a full collection, which Python starts
    now and then as requests allocate, walks them all with the process stalled: a pause far
    past any p99 budget. Called once a process has loaded what it keeps; garbage made later is
    still collected."""
    gc.collect()
    gc.freeze()
