"""Datasets that outgrow one file: an ``interactions/`` folder of Parquet files (Hive date
partitions, hashed parts), written by synth and the converters, read by unit (file, row group),
split across ranks by unit, resumed exactly, and a damaged file named."""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from genrec.embedding.spec import EmbeddingConfig, TableConfig
from genrec.train.data import schema
from genrec.train.data.convert import convert_sequences
from genrec.train.data.files import InteractionFiles
from genrec.train.data.reader import SequenceReader
from genrec.train.data.schema import NO_DATE, DataFormatError, Layout, read_info, splitmix64
from genrec.train.data.synthetic import SyntheticConfig, generate
from tests.test_data import damage_page

CFG = SyntheticConfig(num_users=1000, num_items=600, num_topics=8, median_len=12, max_len=60, seed=3, chunk_users=128)
LAYOUT = Layout(files=3, partition="date")


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """The same synthetic users as one file and as date partitions x 3 parts, with row groups
    of 8 users (so files hold several units) and at most 256 rows waiting in the writer."""
    mp = pytest.MonkeyPatch()
    mp.setattr(schema, "ROW_GROUP_SIZE", 8)
    mp.setattr(schema, "MAX_WAITING_ROWS", 256)
    root = tmp_path_factory.mktemp("layouts")
    try:
        generate(CFG, root / "single", progress=False)
        generate(CFG, root / "part", progress=False, layout=LAYOUT)
    finally:
        mp.undo()
    return root / "single", root / "part"


def emb(size):
    return EmbeddingConfig(tables=(TableConfig("item", ("item",), dim=8, num_embeddings=size),))


def reader(data, split="train", **kw):
    kw = {"max_seq_len": 16, "batch_size": 8, "seed": 5, **kw}
    return SequenceReader(data, split, embedding=emb(read_info(data).item_table_size), **kw)


def samples(batches):
    """(user, history, targets) of every sample, in order."""
    out = []
    for b in batches:
        off, vals, t = b.seq.offsets().tolist(), b.seq.values().tolist(), b.targets.tolist()
        toff = np.cumsum([0, *([1] * b.batch_size if len(t) == b.batch_size else np.diff(off))]).tolist()
        for i, u in enumerate(b.user_ids.tolist()):
            out.append((u, tuple(vals[off[i]:off[i + 1]]), tuple(t[toff[i]:toff[i + 1]])))
    return out


def test_partitioned_output_puts_each_user_in_one_file_under_its_last_day(both):
    single, part = both
    log = InteractionFiles(part)
    assert log.partitioned and len(log.paths) > 16 and len(log.units) > len(log.paths)  # files of several units
    assert log.paths == sorted(log.paths) and all(p.name.startswith("part-") for p in log.paths)
    assert all(u.rows <= 8 for u in log.units)
    users = []
    for path in log.paths:
        rows = pq.read_table(path).to_pylist()
        day, part_no = path.parent.name.removeprefix("date="), int(path.stem.removeprefix("part-"))
        for r in rows:
            assert str(np.datetime64(r["timestamps"][-1] // 86400, "D")) == day
            assert int(splitmix64(np.array([r["user_id"]]))[0] % 3) == part_no
        users += [r["user_id"] for r in rows]
    assert sorted(users) == list(range(1, CFG.num_users + 1))  # every user exactly once
    assert read_info(part).format_version == 2 and read_info(single).format_version == 1
    assert {k: v for k, v in read_info(part).__dict__.items() if k != "format_version"} == \
           {k: v for k, v in read_info(single).__dict__.items() if k != "format_version"}


@pytest.mark.parametrize("split", ["train", "valid", "test"])
def test_partitioned_and_single_file_readers_give_the_same_samples(both, split):
    single, part = both
    one, many = samples(reader(single, split)), samples(reader(part, split))
    assert Counter(one) == Counter(many) and len(many) == CFG.num_users
    assert samples(reader(part, split)) == many  # the plan is a function of the files and seed
    r = reader(part, split)
    r.set_epoch(1)
    assert split != "train" or samples(r) != many


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_read_their_own_units_get_equal_batches_and_cover_the_data(both, world):
    _, part = both
    seen, read, counts = [], [], set()
    for rank in range(world):
        r = reader(part, rank=rank, world_size=world)
        mine: list[int] = []
        real = r.log.read_unit
        r.log.read_unit = lambda u, cols, real=real, mine=mine: mine.append(u) or real(u, cols)
        got = samples(r)
        counts.add((len(got), len(r)))
        seen.append({s[0] for s in got})
        read.append(set(mine))
    n = CFG.num_users
    assert counts == {(n // world, len(reader(part, rank=0, world_size=world)))}  # equal steps on every rank
    assert sum(map(len, seen)) == len(set().union(*seen)) == n // world * world  # disjoint; the tail of < world cut
    units = InteractionFiles(part).units
    unread = set(range(len(units))) - set().union(*read)
    assert sum(units[u].rows for u in unread) <= n % world  # only a unit of the cut tail goes unread
    # a rank reads its own share of the rows (one file: every row), sharing at most the unit
    # at each cut with a neighbour
    assert sum(map(len, read)) <= len(units) + 2 * (world - 1)
    assert all(sum(units[u].rows for u in mine) <= n // world + 2 * 8 for mine in read)


@pytest.mark.parametrize("batch_size,sort_window", [(8, 16), (4, 1), (64, 2)])
def test_an_epoch_decodes_each_unit_once(both, batch_size, sort_window):
    """A sort window's batches draw from each of its units in turn, and a window of small
    files spans several units: all of them stay decoded until the window is done."""
    _, part = both
    r = reader(part, batch_size=batch_size, sort_window=sort_window)
    r.set_epoch(2)
    reads: list[int] = []
    real = r.log.read_unit
    r.log.read_unit = lambda u, cols: reads.append(u) or real(u, cols)
    assert sum(b.batch_size for b in r) == CFG.num_users
    assert sorted(reads) == list(range(len(r.log.units)))


def test_partitioned_eval_ranks_cover_every_user_once(both):
    _, part = both
    got = [s[0] for rank in range(3) for s in samples(reader(part, "test", rank=rank, world_size=3))]
    assert sorted(got) == list(range(1, CFG.num_users + 1))


@pytest.mark.parametrize("world,rank", [(1, 0), (2, 1)])
def test_partitioned_resume_continues_at_the_exact_sample(both, world, rank):
    _, part = both
    full = reader(part, rank=rank, world_size=world)
    full.set_epoch(1)
    want = samples(full)
    r = reader(part, rank=rank, world_size=world)
    r.set_epoch(1)
    it = iter(r)
    head = samples([next(it) for _ in range(5)])
    state = json.loads(json.dumps(r.state_dict()))  # as a checkpoint stores it
    del r, it  # the "kill": a new reader knows only the state
    again = reader(part, rank=rank, world_size=world)
    again.load_state_dict(state)
    assert head + samples(again) == want


def test_a_damaged_or_mismatched_file_is_named(both, tmp_path):
    import shutil

    _, part = both
    data = tmp_path / "d"
    shutil.copytree(part, data)
    paths = InteractionFiles(data).paths
    victim = next(p for p in paths[len(paths) // 2:] if pq.ParquetFile(p).metadata.num_row_groups > 1)
    good = victim.read_bytes()
    damage_page(victim, group=1)
    first = pq.ParquetFile(victim).metadata.row_group(0).num_rows
    rows = pq.ParquetFile(victim).metadata.row_group(1).num_rows
    with pytest.raises(DataFormatError, match=rf"{victim} \(row group 1, rows {first}-{first + rows - 1}\): "
                                              "cannot be read as Parquet"):
        samples(reader(data, shuffle=False))
    victim.write_bytes(good[:-100])  # truncated: the footer is gone
    with pytest.raises(DataFormatError, match=rf"{victim} \(footer\): cannot be read"):
        reader(data)
    pq.write_table(pq.read_table(paths[0]).drop_columns(["oracle_click"]), victim)  # another writer's file
    with pytest.raises(DataFormatError, match=rf"{victim}: no column 'oracle_click', which {paths[0]} has"):
        reader(data)
    victim.write_text("not parquet")
    from genrec.train.data.verify import verify_dataset

    with pytest.raises(DataFormatError, match=rf"{victim} \(footer\): cannot be read"):
        verify_dataset(data)
    (data / "interactions.parquet").write_bytes(good)
    with pytest.raises(DataFormatError, match="both interactions.parquet and interactions/"):
        reader(data)


def test_converters_write_parts_and_verify_counts_every_file(tmp_path, capfd):
    from genrec.train.data.verify import verify_dataset

    src = tmp_path / "seq.txt"
    src.write_text("".join(f"{u} " + " ".join(str(i) for i in range(u % 7 + 1, u % 7 + 6)) + "\n" for u in range(1, 61)))
    info = convert_sequences(src, tmp_path / "d", layout=Layout(files=4), progress=True)
    assert "seq.txt users: " in capfd.readouterr().err  # the progress bar of 'genrec data convert'
    names = sorted(p.relative_to(tmp_path / "d").as_posix() for p in (tmp_path / "d").rglob("*.parquet"))
    assert names == ["interactions/part-00000.parquet", "interactions/part-00001.parquet",
                     "interactions/part-00002.parquet", "interactions/part-00003.parquet", "items.parquet"]
    report = verify_dataset(tmp_path / "d")
    assert (report.files, report.users, report.events) == (6, 60, info.num_events) == (6, 60, 300)
    # no timestamps: every user under Hive's null partition
    convert_sequences(src, tmp_path / "n", layout=Layout(partition="date"))
    assert [p.parent.name for p in InteractionFiles(tmp_path / "n").paths] == [f"date={NO_DATE}"]
    with pytest.raises(ValueError, match="--files must be at least 1"):
        Layout(files=0)


def test_a_partitioned_dataset_replaces_a_single_file_one(tmp_path):
    src = tmp_path / "seq.txt"
    src.write_text("1 5 6 7\n2 8 5 9\n")
    convert_sequences(src, tmp_path / "d")
    convert_sequences(src, tmp_path / "d", layout=Layout(files=2))
    assert not (tmp_path / "d" / "interactions.parquet").exists()
    assert Path(tmp_path / "d" / "interactions").is_dir() and InteractionFiles(tmp_path / "d").num_rows == 2
