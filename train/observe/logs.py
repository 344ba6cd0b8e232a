"""A job's log file: what a training job or an evaluation says also lands in its run directory.

Messages go through the ``genrec.train`` logger. On the console they print as before (only the
message, through ``tqdm.write`` so a progress bar stays whole; under torchrun only rank 0's,
except diagnoses, which every rank prints). While :func:`run_log` is open they are also
appended to ``RUN/<name>.log`` (rank 0) or ``RUN/<name>.rank<r>.log`` with the time, rank,
level and logger, together with Python warnings: a library's to the file alone (so it does not
break up the console's output), genrec's own (addressed to the user, e.g. a checkpoint read on
fewer ranks than wrote it) to the file and, as always, stderr; and, when the job dies, the exception and its
traceback: a job that failed overnight says why in its run directory. A resumed or restarted
job appends to the same file.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TypeVar

from tqdm import tqdm

log = logging.getLogger("genrec.train")

T = TypeVar("T")


class _Console(logging.Handler):
    """Prints a record's message through tqdm; quiet on ranks other than 0 unless the record
    asks for every rank (``extra={"all_ranks": True}``); ``extra={"file_only": True}``: the
    log file alone."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.rank = 0

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "file_only", False) or (self.rank != 0 and not getattr(record, "all_ranks", False)):
            return
        try:
            tqdm.write(record.getMessage())
        except Exception:  # noqa: BLE001 - logging's own contract: a broken handler never raises
            self.handleError(record)


_console = _Console()
log.addHandler(_console)
log.setLevel(logging.INFO)
log.propagate = False  # the console handler prints it; no second copy from a root handler

FORMAT = "%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"
# the folder holding genrec's packages (the repository in an editable install, else
# site-packages/genrec) and the package folders in it: a warning issued from these is ours
_ROOT = Path(__file__).resolve().parents[2]
_PACKAGES = ("genrec", "train", "serve", "models", "embedding", "quant", "kernels", "benchmarks", "configs")


def ours(filename: str) -> bool:
    """Whether ``filename`` is a module of genrec (not of a library it calls)."""
    path = Path(filename).resolve()
    return path.parent == _ROOT or any(path.is_relative_to(_ROOT / d) for d in _PACKAGES)


def log_file(run_dir: Path, rank: int, name: str = "train") -> Path:
    return Path(run_dir) / (f"{name}.log" if rank == 0 else f"{name}.rank{rank}.log")


@contextlib.contextmanager
def run_log(run_dir: Path, rank: int = 0, name: str = "train") -> Iterator[Path]:
    """Appends the ``genrec.train`` logger's records and Python warnings to the run's log file
    while open; an exception leaving the block is written there with its traceback first."""
    path = log_file(run_dir, rank, name)
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter(FORMAT.format(rank=rank)))
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001, ANN202 - warnings' hook
        text = warnings.formatwarning(message, category, filename, lineno, line).rstrip()
        handler.handle(log.makeRecord("py.warnings", logging.WARNING, filename, lineno, text, None, None))
        if ours(filename):  # genrec's own warnings are for the user: stderr too, as Python prints them
            sys.stderr.write(text + "\n")

    before = _console.rank
    _console.rank = rank
    log.addHandler(handler)
    warnings.showwarning = show
    try:
        yield path
    except BaseException as e:
        # to the file only (the console shows the traceback as it always did)
        handler.handle(log.makeRecord(log.name, logging.ERROR, __file__, 0, f"job failed: {type(e).__name__}: {e}",
                                      None, (type(e), e, e.__traceback__)))
        raise
    finally:
        warnings.showwarning = shown
        log.removeHandler(handler)
        handler.close()
        _console.rank = before


def progress(items: Iterable[T], desc: str, enabled: bool = True) -> Iterable[T]:
    """``items`` with a transient progress bar (its length, when it has one, as the total);
    ``enabled`` false: the items themselves."""
    return tqdm(items, desc=desc, unit="batch", leave=False, dynamic_ncols=True) if enabled else items
