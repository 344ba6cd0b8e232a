"""quant/pages.py: large served tables copied onto memory advised for transparent huge pages."""

import re
from pathlib import Path

import pytest
import torch

from genrec.quant.embeddings import ServedRows
from genrec.quant.pages import on_huge_pages

pytestmark = pytest.mark.unit

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping(addr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``addr``."""
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text()):
        lo, hi = (int(x, 16) for x in block.split()[0].split("-"))
        if lo <= addr < hi:
            return dict(line.split(":", 1) for line in block.splitlines()[1:] if ":" in line)
    raise AssertionError(f"no mapping holds {addr:#x}")


def _thp_offered() -> bool:
    return THP.exists() and re.search(r"\[(always|madvise)\]", THP.read_text()) is not None


def test_copy_keeps_values_and_small_tensors_stay() -> None:
    t = torch.arange(3 * 1000, dtype=torch.int64).view(1000, 3)
    assert on_huge_pages(t) is t  # under the size worth a mapping of its own
    h = on_huge_pages(t, min_bytes=0)
    assert h is not t and h.dtype == t.dtype and h.shape == t.shape and torch.equal(h, t)
    assert h.data_ptr() % (2 << 20) == 0  # starts on a huge page


@pytest.mark.skipif(not _thp_offered(), reason="transparent huge pages are off on this machine")
def test_served_rows_live_on_a_mapping_advised_for_huge_pages() -> None:
    """A table past the threshold (1M int8 rows of 64 + scale/bias: 68 MB) is held on a private
    mapping the kernel may back with huge pages (smaps THPeligible; a shared anonymous mapping
    would be shmem, which another setting governs, and torch's own allocation is not advised)."""
    parts = {"codes": torch.randint(0, 255, (1_000_000, 64), dtype=torch.uint8),
             "scale_bias": torch.randint(0, 255, (1_000_000, 4), dtype=torch.uint8)}
    rows = ServedRows(parts, "int8", 64)
    assert _mapping(rows.packed.data_ptr()).get("THPeligible", "").strip() == "1"
    assert torch.equal(rows.packed[:, :64], parts["codes"])
    small = ServedRows({k: v[:1000] for k, v in parts.items()}, "int8", 64)
    assert torch.equal(small.packed[:, 64:], parts["scale_bias"][:1000])
