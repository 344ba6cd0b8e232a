"""genrec: generative recommendation from interaction logs to a ranking service.

The repository's top-level folders install as this package's subpackages (pyproject.toml's
``package-dir``): ``embedding/`` is ``genrec.embedding``, ``serve/`` is ``genrec.serve``, and so
on; ``proto/genrec/`` is ``genrec.proto``."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("genrec")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
