"""Converters, the synthetic generator and the streaming reader."""

import gzip
import json
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from genrec.embedding.spec import EmbeddingConfig, IdOutOfRange, TableConfig, hash_ids
from genrec.train.data.convert import convert_movielens, convert_ratings, convert_sequences
from genrec.train.data.reader import SequenceReader, holds_valid
from genrec.train.data.schema import DataFormatError, Layout, read_info
from genrec.train.data.synthetic import SyntheticConfig, SyntheticWorld, generate
from genrec.train.eval.ranking_metrics import auc


def rows(path):
    return pq.read_table(path / "interactions.parquet").to_pylist()


def emb(size, oov="error"):
    return EmbeddingConfig(tables=(TableConfig("item", ("item",), dim=8, num_embeddings=size, oov=oov),))


def test_sequences_converter(tmp_path):
    src = tmp_path / "seq.txt"
    src.write_text("1 5 6 7\n2 8 5 9 10\n")
    info = convert_sequences(src, tmp_path / "out")
    assert (info.num_users, info.num_events, info.num_items, info.item_id_max) == (2, 7, 6, 10)
    r = rows(tmp_path / "out")
    assert r[1]["item_ids"] == [8, 5, 9, 10] and r[1]["timestamps"] is None
    items = pq.read_table(tmp_path / "out" / "items.parquet").to_pydict()
    assert items["item_id"] == [5, 6, 7, 8, 9, 10] and items["count"][0] == 2


@pytest.mark.parametrize("text,err", [("1 5 x 7\n", "seq.txt:1: 'x'"), ("1 5 6\n3\n", "seq.txt:2: user 3 has no items")])
def test_malformed_sequence_line_names_file_and_line(tmp_path, text, err):
    src = tmp_path / "seq.txt"
    src.write_text(text)
    with pytest.raises(DataFormatError, match=err):
        convert_sequences(src, tmp_path / "out")


def test_ratings_converter_orders_by_time_and_encodes_ratings(tmp_path):
    src = tmp_path / "ratings.dat.gz"
    with gzip.open(src, "wt") as f:
        f.write("1::20::5::300\n1::10::3::100\n2::10::4::50\n1::30::1::200\n")
    convert_ratings(src, tmp_path / "out")
    r = rows(tmp_path / "out")
    assert r[0]["item_ids"] == [10, 30, 20] and r[0]["timestamps"] == [100, 200, 300]
    assert r[0]["actions"] == [1 << 2, 1 << 0, 1 << 4]
    assert read_info(tmp_path / "out").action_names[4] == "rating_5"


def test_malformed_rating_line_names_file_and_line(tmp_path):
    src = tmp_path / "ratings.dat"
    src.write_text("1::20::5::300\n1::10::3\n")
    with pytest.raises(DataFormatError, match=r"ratings.dat:2: expected UserID::MovieID"):
        convert_ratings(src, tmp_path / "out")


def test_movielens_folder_merges_sequences_ratings_and_profiles(tmp_path):
    d = tmp_path / "ml"
    d.mkdir()
    (d / "user_sequences.txt").write_text("1 10 30 20\n2 40 10 30\n")
    with gzip.open(d / "ratings_users1-1.dat.gz", "wt") as f:
        f.write("1::10::4::100\n1::20::2::300\n1::30::5::200\n")
    (d / "users.dat").write_text("1::F::18::4::12345\n2::M::56::20::ab\n")
    info = convert_movielens(d, tmp_path / "out")
    assert info.users_with_timestamps == 1 and info.context_features["age"] == 7
    r = rows(tmp_path / "out")
    assert r[0]["timestamps"] == [100, 200, 300] and r[0]["actions"] == [8, 16, 2]
    assert r[1]["timestamps"] is None and r[1]["ctx_age"] == [6] and r[1]["ctx_zip3"] == [0]
    assert r[0]["ctx_gender"] == [0] and r[0]["ctx_zip3"] == [123]


def test_synthetic_is_deterministic_and_has_its_declared_structure(tmp_path):
    cfg = SyntheticConfig(num_users=50, num_items=400, num_topics=4, median_len=10, seed=7)
    generate(cfg, tmp_path / "a", progress=False)
    generate(cfg, tmp_path / "b", progress=False)
    a, b = rows(tmp_path / "a"), rows(tmp_path / "b")
    assert a == b
    info = read_info(tmp_path / "a")
    assert info.action_names == ["impression", "click", "conversion"]
    for r in a:
        n = len(r["item_ids"])
        assert cfg.min_len <= n <= cfg.max_len
        assert all(1 <= i <= cfg.num_items for i in r["item_ids"])
        assert r["timestamps"] == sorted(r["timestamps"])
        assert all(x & 1 for x in r["actions"])  # every event is an impression
        assert all(((x >> 2) & 1) <= ((x >> 1) & 1) for x in r["actions"])  # conversions follow clicks
    # sessions stay on a topic (topic_stay = 0.75; 4 topics: 1/4 by chance), and the seed matters
    world = SyntheticWorld(cfg)
    topics = [world.item_topic(np.array(r["item_ids"])) for r in a]
    stay = np.mean(np.concatenate([t[1:] == t[:-1] for t in topics]))
    assert 0.6 < stay < 1, stay
    # clicks are drawn from the stored oracle probabilities: as many as they predict, and
    # ranked by them (the oracle AUC the ranking benchmark quotes as the ceiling)
    clicks = np.array([(x >> 1) & 1 for r in a for x in r["actions"]])
    oracle = np.array([p for r in a for p in r["oracle_click"]])
    assert abs(clicks.sum() - oracle.sum()) < 4 * np.sqrt((oracle * (1 - oracle)).sum())
    assert auc(oracle, clicks) > 0.6
    generate(replace(cfg, seed=8), tmp_path / "c", progress=False)
    assert rows(tmp_path / "c") != a


def test_synthetic_repeat_consumption_is_a_knob_and_off_leaves_the_rows_as_they_were():
    import numpy as np

    from genrec.train.data.synthetic import _users_chunk, first_order

    def sequences(make=first_order, **kw):  # noqa: ANN001, ANN003, ANN202
        cfg = make(**{"num_users": 400, "num_items": 20000, "num_topics": 8, "median_len": 30, "seed": 5, **kw})
        return _users_chunk(SyntheticWorld(cfg), np.random.default_rng(cfg.seed), 1, cfg.num_users)[0]["item_ids"]

    def again(seqs, window=20):  # noqa: ANN001, ANN202 - share of events among the user's last `window` items
        hits = [s[t] in s[max(0, t - window):t] for s in seqs for t in range(1, len(s))]
        return float(np.mean(hits))

    off = sequences()
    assert all((a == b).all() for a, b in zip(off, sequences(repeat=0.0, repeat_window=5)))
    on = sequences(repeat=0.4)
    assert again(on) - again(off) > 0.3  # about 0.4 of events come back (some were repeats anyway)
    # the session process (the default): a repeat is one of the items before the last
    off, on = sequences(SyntheticConfig, repeat=0.0), sequences(SyntheticConfig, repeat=0.4)
    assert again(on) - again(off) > 0.25  # 0.4 of the events that open no session (3 in 4)
    # ... not the last one (that again only where the last was itself a copy or a popular draw)
    assert np.mean([s[t] == s[t - 1] for s in on for t in range(1, len(s))]) < 0.05
    with pytest.raises(ValueError, match="repeat"):
        SyntheticWorld(SyntheticConfig(repeat=1.0))
    with pytest.raises(ValueError, match="detour"):
        SyntheticWorld(SyntheticConfig(repeat=0.5, detour=0.5))


def _next_item_rules(cfg: SyntheticConfig) -> dict[str, float]:
    """Share of events (from the third on) that are the successor (same topic, next rank) of the
    last item (``last``: what a first-order model can know), or instead of the item before it
    that was its topic's latest (``history``: what only the history names); ``*_after_gap``:
    the same over events more than 3 hours after the one before."""
    from genrec.train.data.synthetic import _users_chunk

    world = SyntheticWorld(cfg)
    cols = _users_chunk(world, np.random.default_rng(cfg.seed), 1, cfg.num_users)[0]
    hits = {"last": [], "history": [], "gap": []}
    for items, times in zip(cols["item_ids"], cols["timestamps"]):
        topic, rank = world.item_topic(items), world.item_rank(items)
        latest: dict[int, int] = {}  # topic -> rank of its latest item before the last event
        for t in range(2, len(items)):
            latest[int(topic[t - 2])] = int(rank[t - 2])
            last = topic[t] == topic[t - 1] and rank[t] == (rank[t - 1] + 1) % world.per_topic
            named = latest.get(int(topic[t]), -2) + 1 == rank[t]
            hits["last"].append(last)
            hits["history"].append(named and not last)
            hits["gap"].append(times[t] - times[t - 1] > 3 * 3600)
    h = {k: np.array(v) for k, v in hits.items()}
    return {"last": h["last"].mean(), "history": h["history"].mean(), "gap_share": h["gap"].mean(),
            "last_after_gap": h["last"][h["gap"]].mean(), "history_after_gap": h["history"][h["gap"]].mean()}


def test_synthetic_default_history_names_the_next_item_where_the_last_item_cannot():
    """The default's detours, repeats and sessions make the item after some earlier one (its
    topic's latest: a series resumed) the next item, where the first-order process almost
    never does; after a session's long gap that rule beats the last item's successor. A
    statistic of generated rows: the data, not a model, is what this holds."""
    from genrec.train.data.synthetic import first_order

    new, old = _next_item_rules(SyntheticConfig(num_users=500, seed=4)), _next_item_rules(first_order(num_users=500, seed=4))
    assert old["history"] < 0.03 and new["history"] > 0.12, (old, new)  # measured 0.011 and 0.207
    assert new["last"] > 0.25  # the first-order signal stays: the sequence model must match it too
    assert new["gap_share"] > 0.08 and new["history_after_gap"] > new["last_after_gap"] + 0.1, new
    assert old["history_after_gap"] < 0.03


def test_synthetic_first_order_rows_are_pinned():
    """The first-order generator's rows (the default until 2026-12-05), bit for bit (a checksum
    taken before the long-history mode existed): an opt-in knob must not move any existing
    dataset, and ``first_order()`` still writes what the old default wrote."""
    import hashlib

    from genrec.train.data.synthetic import _users_chunk, first_order

    cfg = first_order(num_users=300, num_items=5000, num_topics=8, median_len=30, seed=3)
    cols = _users_chunk(SyntheticWorld(cfg), np.random.default_rng(cfg.seed), 1, cfg.num_users)[0]
    h = hashlib.sha256()
    for k in ("item_ids", "timestamps", "actions", "oracle_click"):
        for a in cols[k]:
            h.update(np.ascontiguousarray(a).tobytes())
    for k in ("ctx_segment", "ctx_device", "ctx_region"):
        h.update(repr(cols[k]).encode())
    assert h.hexdigest() == "e570d4311461463da0508bbe570bc5fc9ffbf685cb5c7c6872a266bbaf9d0607"


def test_synthetic_long_histories_carry_signal_a_recent_window_cannot_see(tmp_path):
    """long_len: every user has that many events; in the recent era some events (``resumed``)
    resume a past-era interest at the item after its last one: the full history names that
    item, the last 512 events almost never hold its topic."""
    from genrec.train.data.synthetic import _users_chunk, chunk_users, first_order

    cfg = first_order(num_users=40, seed=2, long_len=6000, long_recent=0.3, long_quiet=600, long_return=0.004)
    world = SyntheticWorld(cfg)
    cols = _users_chunk(world, np.random.default_rng(cfg.seed), 1, cfg.num_users)[0]
    assert {len(s) for s in cols["item_ids"]} == {6000}
    named = in_window = 0
    for items, resumed in zip(cols["item_ids"], cols["resumed"]):
        topic, rank = world.item_topic(items), world.item_rank(items)
        for t in np.flatnonzero(resumed):
            assert t >= 4200 + 600  # the recent era, after its quiet start
            j = np.flatnonzero(topic[:t] == topic[t])[-1]  # the topic's last event before it
            named += rank[t] == (rank[j] + 1) % world.per_topic
            in_window += j >= t - 512
    n = int(sum(r.sum() for r in cols["resumed"]))
    assert n >= 40 and named == n  # ~2-4 per user; each the item after its topic's last one
    assert in_window == 0  # the topic last seen in the past era, before the recent window
    assert chunk_users(cfg) == 2**22 // 6000 and chunk_users(SyntheticConfig()) == SyntheticConfig().chunk_users
    generate(replace(cfg, num_users=3, long_len=700), tmp_path / "long", progress=False)
    assert {len(r["resumed"]) for r in rows(tmp_path / "long")} == {700}
    with pytest.raises(ValueError, match="long_len"):
        SyntheticWorld(SyntheticConfig(long_len=100, long_recent=1.0))
    # the sessions process's topic_stay = 1 keeps a user on one topic for ever: nothing to resume
    with pytest.raises(ValueError, match="topic_stay"):
        SyntheticWorld(SyntheticConfig(long_len=8192))


def test_synthetic_long_command_in_the_docstring_resumes_past_interests():
    """The module docstring's ``genrec data synth --long_len=...`` line, parsed as the CLI
    parses it, draws users with several topics and ``resumed`` events."""
    import re

    from genrec.config import load_config
    from genrec.train.data import synthetic
    from genrec.train.data.synthetic import _users_chunk

    doc = " ".join(synthetic.__doc__.split())
    line = re.search(r"``genrec data synth (--long_len=[^`]*)``", doc).group(1)
    cfg = replace(load_config(SyntheticConfig, None, line.split()), num_users=8, long_len=3000, long_quiet=300,
                  long_return=0.02)
    world = SyntheticWorld(cfg)
    cols = _users_chunk(world, np.random.default_rng(0), 1, cfg.num_users)[0]
    assert sum(int(r.sum()) for r in cols["resumed"]) >= 8
    assert min(len(np.unique(world.item_topic(i))) for i in cols["item_ids"]) > 1


def test_synthetic_zipf_probs_are_what_zipf_rank_draws():
    for cfg in (SyntheticConfig(), SyntheticConfig(zipf=1.0, num_items=4096)):
        world = SyntheticWorld(cfg)
        drawn = np.bincount(world.zipf_rank(np.random.default_rng(0), 400_000), minlength=world.per_topic) / 400_000
        probs = world.zipf_probs()
        assert probs.shape == (world.per_topic,) and abs(probs.sum() - 1) < 1e-12
        assert np.abs(drawn - probs).max() < 3e-3


def test_synthetic_id_bijection_scales_to_1e8_items():
    world = SyntheticWorld(SyntheticConfig(num_items=100_000_000, num_topics=1000))
    rng = np.random.default_rng(0)
    topics, ranks = rng.integers(0, 1000, 10_000), world.zipf_rank(rng, 10_000)
    ids = world.item_id(topics, ranks)
    assert ids.min() >= 1 and ids.max() <= 100_000_000
    assert (world.item_topic(ids) == topics).all()
    assert np.unique(ids).size == np.unique(topics * world.per_topic + ranks).size


def all_user_ids(reader):
    return [int(u) for b in reader for u in b.user_ids]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_reader_shards_cover_every_sample_exactly_once(tiny_synth, world):
    e = emb(read_info(tiny_synth).item_table_size)
    seen = []
    for rank in range(world):
        r = SequenceReader(tiny_synth, "valid", embedding=e, max_seq_len=16, batch_size=7,
                           rank=rank, world_size=world, shuffle=True, even=False, sort_window=2)
        got = all_user_ids(r)
        assert len(got) == len(set(got))
        seen += got
    assert sorted(seen) == sorted(pq.read_table(tiny_synth / "interactions.parquet").column("user_id").to_pylist())


def test_reader_even_mode_gives_every_rank_the_same_number_of_batches(tiny_synth):
    """Even mode (training's): every rank the same samples count, none shared, at most
    world - 1 users left out; ``len`` says how many batches come."""
    e = emb(read_info(tiny_synth).item_table_size)
    users, batches = [], set()
    for r in range(7):
        reader = SequenceReader(tiny_synth, "train", embedding=e, max_seq_len=16, batch_size=16, rank=r, world_size=7)
        mine = [b.user_ids.tolist() for b in reader]
        assert len(mine) == len(reader) > 0
        batches.add(len(mine))
        users.append([u for b in mine for u in b])
    n = pq.read_metadata(tiny_synth / "interactions.parquet").num_rows
    assert n % 7 and len(batches) == 1
    assert {len(u) for u in users} == {n // 7}
    everyone = [u for mine in users for u in mine]
    assert len(set(everyone)) == len(everyone) == n // 7 * 7


def test_reader_order_is_seeded_by_epoch_and_resume_continues_at_the_exact_sample(tiny_synth):
    e = emb(read_info(tiny_synth).item_table_size)

    def reader():
        return SequenceReader(tiny_synth, "train", embedding=e, max_seq_len=16, batch_size=8, seed=5)

    r = reader()
    epoch0 = all_user_ids(r)
    r.set_epoch(1)
    epoch1 = all_user_ids(r)
    assert sorted(epoch0) == sorted(epoch1) and epoch0 != epoch1
    r2 = reader()
    r2.set_epoch(1)
    it = iter(r2)
    first = [int(u) for _ in range(3) for u in next(it).user_ids]
    state = json.loads(json.dumps(r2.state_dict()))
    r3 = reader()
    r3.load_state_dict(state)
    assert first + all_user_ids(r3) == epoch1


def test_leave_one_out_splits(tmp_path):
    src = tmp_path / "seq.txt"
    src.write_text("1 " + " ".join(str(i) for i in range(1, 11)) + "\n")
    convert_sequences(src, tmp_path / "d")
    e = emb(11)
    kw = dict(embedding=e, max_seq_len=4, batch_size=4)
    tr = next(iter(SequenceReader(tmp_path / "d", "train", train_window="last", **kw)))
    assert tr.seq.values().tolist() == [4, 5, 6, 7] and tr.targets.tolist() == [5, 6, 7, 8]
    va = next(iter(SequenceReader(tmp_path / "d", "valid", **kw)))
    assert va.seq.values().tolist() == [5, 6, 7, 8] and va.targets.tolist() == [9]
    assert va.seen_ids.tolist() == list(range(1, 9))
    te = next(iter(SequenceReader(tmp_path / "d", "test", **kw)))
    assert te.seq.values().tolist() == [6, 7, 8, 9] and te.targets.tolist() == [10]
    assert te.has_time.tolist() == [False]


def test_valid_users_share_holds_out_a_fixed_user_subset_and_trains_the_rest_through_events_minus_one(tmp_path):
    src = tmp_path / "seq.txt"
    src.write_text("".join(f"{u} " + " ".join(str(i) for i in range(1, 11)) + "\n" for u in range(1, 401)))
    convert_sequences(src, tmp_path / "d")
    kw = dict(embedding=emb(11), max_seq_len=4, batch_size=1000)
    held = [holds_valid(u, 0.25) for u in range(1, 401)]
    assert 70 < sum(held) < 130  # about a quarter, the same users every time
    va = next(iter(SequenceReader(tmp_path / "d", "valid", valid_users=0.25, **kw)))
    assert sorted(va.user_ids.tolist()) == [u for u, h in zip(range(1, 401), held) if h]
    tr = next(iter(SequenceReader(tmp_path / "d", "train", train_window="last", shuffle=False,
                                  sort_window=0, valid_users=0.25, **kw)))
    last = tr.targets.view(400, 4)[:, -1].tolist()
    assert tr.user_ids.tolist() == list(range(1, 401))
    assert last == [8 if h else 9 for h in held]  # held-out users stop before their validation target 9
    assert 10 not in tr.seq.values().tolist() + tr.targets.tolist()  # the test target never enters training
    te = next(iter(SequenceReader(tmp_path / "d", "test", valid_users=0.0, **kw)))
    assert te.targets.tolist() == [10] * 400
    assert all(holds_valid(u, 1.0) for u in range(1, 401)) and not any(holds_valid(u, 0.0) for u in range(1, 401))
    with pytest.raises(ValueError, match="valid_users"):
        SequenceReader(tmp_path / "d", "valid", valid_users=1.5, **kw)


def test_id_outside_the_table_is_an_error_or_hashed(tmp_path):
    src = tmp_path / "seq.txt"
    src.write_text("1 1 2 3\n7 4 99 5 6\n")
    convert_sequences(src, tmp_path / "d")
    with pytest.raises(IdOutOfRange, match="id 99 .* user 7"):
        list(SequenceReader(tmp_path / "d", "train", embedding=emb(50), max_seq_len=8, batch_size=4))
    (b,) = list(SequenceReader(tmp_path / "d", "train", embedding=emb(50, "hash"), max_seq_len=8, batch_size=4))
    # hashing folds only the id outside the table: the batch is the one a table holding 99
    # would get, with 99 replaced by its fold
    (wide,) = list(SequenceReader(tmp_path / "d", "train", embedding=emb(100), max_seq_len=8, batch_size=4))
    fold = int(hash_ids(np.array([99]), 50)[0])
    assert 99 in wide.seq.values().tolist() + wide.targets.tolist()
    for got, want in ((b.seq.values(), wide.seq.values()), (b.targets, wide.targets)):
        assert got.tolist() == [fold if i == 99 else i for i in want.tolist()]


# ----- bad data: named errors, nothing partial left behind (issue 30) ------------------------


def damage_page(data, column="item_ids", group=0, garble=False):
    """Damages the data page of a column chunk of interactions.parquet (or of the Parquet file
    ``data``), as a bad disk block would: flips a bit of its last byte (only a page CRC sees
    it), or with ``garble`` overwrites the whole page, header included (Arrow fails to decode
    it). Returns the file."""
    file = data if data.suffix == ".parquet" else data / "interactions.parquet"
    meta = pq.ParquetFile(file).metadata.row_group(group)
    chunk = next(meta.column(c) for c in range(meta.num_columns) if meta.column(c).path_in_schema.startswith(column))
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    end = start + chunk.total_compressed_size
    raw = bytearray(file.read_bytes())
    if garble:
        raw[chunk.data_page_offset : end] = b"\xab" * (end - chunk.data_page_offset)
    else:
        raw[end - 1] ^= 0x10
    file.write_bytes(bytes(raw))
    return file


def leftovers(folder, keep):
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


@pytest.mark.parametrize("text,err", [
    (b"1 5 6 7\n2 8 5 99999999999999999999\n", r"seq.txt:2: item id 99999999999999999999 \(field 4\) does not fit in int64"),
    (b"1 5 6 7\n2 8 \xff 9\n", r"seq.txt:2: byte 0xff at column 5 is not valid utf-8; convert the file to utf-8"),
    (b"", r"seq.txt: no users \(the file is empty or blank\)"),
    (b"\n  \n", r"seq.txt: no users"),
])
def test_bad_input_is_named_and_leaves_no_output(tmp_path, text, err):
    src = tmp_path / "seq.txt"
    src.write_bytes(text)
    with pytest.raises(DataFormatError, match=err):
        convert_sequences(src, tmp_path / "out")
    assert leftovers(tmp_path, {"seq.txt"}) == []  # no out/, no staging directory


def test_ratings_id_above_int64_and_empty_ratings_are_named(tmp_path):
    src = tmp_path / "ratings.dat"
    src.write_text("1::20::5::300\n1::10::3::18446744073709551616\n")
    with pytest.raises(DataFormatError, match=r"ratings.dat:2: Timestamp 18446744073709551616 \(field 4\)"):
        convert_ratings(src, tmp_path / "out")
    src.write_text("")
    with pytest.raises(DataFormatError, match="ratings.dat: no users"):
        convert_ratings(src, tmp_path / "out")
    assert leftovers(tmp_path, {"ratings.dat"}) == []


def test_a_failed_conversion_keeps_the_earlier_dataset_and_a_good_one_replaces_it(tmp_path):
    src, out = tmp_path / "seq.txt", tmp_path / "out"
    src.write_text("1 5 6 7\n")
    convert_sequences(src, out)
    src.write_text("1 5 6 7 8\n2 x\n")
    with pytest.raises(DataFormatError, match="seq.txt:2"):
        convert_sequences(src, out)
    assert rows(out)[0]["item_ids"] == [5, 6, 7] and read_info(out).num_events == 3
    src.write_text("1 5 6 7 8\n")
    convert_sequences(src, out)
    assert rows(out)[0]["item_ids"] == [5, 6, 7, 8] and leftovers(tmp_path, {"seq.txt", "out"}) == []
    (out / "notes.txt").write_text("mine")  # not a dataset any more: never deleted
    with pytest.raises(DataFormatError, match="notes.txt.*choose a new or empty --out"):
        convert_sequences(src, out)
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("layout", [None, Layout(files=3, partition="date")], ids=["one file", "partitioned"])
def test_interrupted_synth_leaves_nothing(tmp_path, monkeypatch, layout):
    import genrec.train.data.synthetic as synthetic
    from genrec.train.data import schema

    real, calls = synthetic._users_chunk, []

    def chunk_then_interrupt(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(synthetic, "_users_chunk", chunk_then_interrupt)
    monkeypatch.setattr(schema, "ROW_GROUP_SIZE", 4)  # files already written when the interrupt comes
    monkeypatch.setattr(schema, "MAX_WAITING_ROWS", 2)
    cfg = SyntheticConfig(num_users=30, num_items=100, num_topics=4, median_len=6, chunk_users=10)
    with pytest.raises(KeyboardInterrupt):
        generate(cfg, tmp_path / "out", progress=False, layout=layout)
    assert leftovers(tmp_path, set()) == []


def test_reader_names_the_file_and_row_group_of_a_damaged_page(tmp_path):
    src = tmp_path / "seq.txt"
    src.write_text("".join(f"{u} 1 2 3 4 5\n" for u in range(50)))
    convert_sequences(src, tmp_path / "d")
    file = tmp_path / "d" / "interactions.parquet"
    good = file.read_bytes()
    for garble in (False, True):
        file.write_bytes(good)
        if garble:  # a file without page CRCs (written before them) whose page no longer decodes
            pq.write_table(pq.read_table(file), file)
        damage_page(tmp_path / "d", garble=garble)
        reader = SequenceReader(tmp_path / "d", "train", embedding=emb(6), max_seq_len=8, batch_size=8)
        with pytest.raises(DataFormatError, match=rf"{file} \(row group 0, rows 0-49\): cannot be read as Parquet"):
            list(reader)
    file.write_bytes(file.read_bytes()[:-100])  # truncated: the footer is gone
    with pytest.raises(DataFormatError, match=rf"{file} \(footer\): cannot be read.*damaged or truncated"):
        SequenceReader(tmp_path / "d", "train", embedding=emb(6), max_seq_len=8, batch_size=8)


def test_converters_refuse_a_user_on_two_lines_and_drop_users_too_short_to_train(tmp_path):
    """A user on two lines became two rows (read twice); a user of fewer than 3 events passed
    conversion and failed training mid-epoch. The first is refused naming both lines; the
    others are dropped and counted in dataset.json (as the KuaiRand converter does)."""
    src = tmp_path / "seq.txt"
    src.write_text("1 5 6 7\n2 5 6 7\n1 8 9 10\n")
    with pytest.raises(DataFormatError, match=r"seq.txt:3: user 1 is on line 1 already"):
        convert_sequences(src, tmp_path / "d")
    src.write_text("1 5 6 7\n2 5 6\n3 5 6 7 8\n")
    info = convert_sequences(src, tmp_path / "e")
    assert info.num_users == 2 and read_info(tmp_path / "e").extra["dropped_users"] == 1
    ratings = tmp_path / "ratings.dat"
    ratings.write_text("1::5::4::10\n1::6::3::20\n1::7::5::30\n2::5::4::10\n2::6::2::20\n")
    info = convert_ratings(ratings, tmp_path / "r")
    assert info.num_users == 1 and read_info(tmp_path / "r").extra["dropped_users"] == 1


def test_read_info_names_a_broken_manifest(tmp_path):
    src = tmp_path / "seq.txt"
    src.write_text("1 5 6 7\n")
    convert_sequences(src, tmp_path / "d")
    manifest = tmp_path / "d" / "dataset.json"
    raw = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**raw, "num_users": "many"}))
    with pytest.raises(DataFormatError, match="dataset.json: field 'num_users' is 'many'"):
        read_info(tmp_path / "d")
    manifest.write_text(manifest.read_text()[:40])
    with pytest.raises(DataFormatError, match="dataset.json: not valid JSON"):
        read_info(tmp_path / "d")


def write_dataset(out, user_rows, **kw):
    from genrec.train.data.schema import DatasetWriter

    with DatasetWriter(out, source="test", **kw) as w:
        w.write({k: [r.get(k) for r in user_rows] for k in user_rows[0]})


GOOD = {"user_id": 1, "item_ids": [1, 2, 3], "timestamps": [10, 20, 30], "actions": [1, 0, 1]}


@pytest.mark.parametrize("bad,err", [
    ({"item_ids": [1, -4, 3]}, r"row 1 \(user 2, row group 0\): item_ids\[1\] = -4 is not >= 0"),
    ({"item_ids": [1, 2]}, r"row 1 \(user 2, row group 0\): item_ids has 2 events; training needs at least 3"),
    ({"timestamps": [1, 2]}, r"row 1 \(user 2, row group 0\): timestamps has 2 values for 3 item_ids"),
    ({"actions": [1, 4, 0]}, r"row 1 \(user 2, row group 0\): actions\[1\] = 4 is not \[0, 2\)"),
    ({"ctx_device": [9]}, r"row 1 \(user 2, row group 0\): ctx_device\[0\] = 9 is not \[0, 4\)"),
    # out of time order: the reader's time cuts would let held-out events into training inputs
    ({"timestamps": [10, 30, 20]}, r"row 1 \(user 2, row group 0\): timestamps\[2\] = 20 is before timestamps\[1\]"),
    ({"timestamps": [10, 20, 1_700_000_000_000]}, r"row 1 \(user 2, row group 0\): timestamps\[2\] = 1700000000000 "
                                                  r"is not \[0, 4000000000\) \(unix seconds, not milliseconds\)"),
    ({"user_id": 1}, r"user 1 has more than one row"),
])
def test_verify_names_file_row_and_field_of_a_bad_value(tmp_path, bad, err):
    from genrec.train.data.verify import verify_dataset

    user_rows = [{**GOOD, "ctx_device": [0]}, {**GOOD, "user_id": 2, "ctx_device": [3], **bad}]
    write_dataset(tmp_path / "d", user_rows, action_names=["click"], context_features={"device": 4})
    with pytest.raises(DataFormatError, match=f"{tmp_path / 'd' / 'interactions.parquet'}: {err}"):
        verify_dataset(tmp_path / "d")


def test_verify_compares_the_catalogue_with_the_logged_items(tmp_path):
    """items.parquet must list the items the logs hold, with their counts: a catalogue of other
    ids (the same number, the same total) would be evaluated and served against."""
    from genrec.train.data.verify import verify_dataset

    write_dataset(tmp_path / "d", [{**GOOD, "user_id": u, "item_ids": [10 + u, 11 + u, 12 + u]} for u in range(3)],
                  action_names=["click"])
    verify_dataset(tmp_path / "d")
    items = pq.read_table(tmp_path / "d" / "items.parquet")
    shifted = items.set_column(0, "item_id", pa.array(np.asarray(items.column("item_id")) - 1))
    pq.write_table(shifted, tmp_path / "d" / "items.parquet")
    with pytest.raises(DataFormatError, match=r"items.parquet: row 0: item 9 with count 1, but the logs hold item 10"):
        verify_dataset(tmp_path / "d")


def test_verify_reads_every_row_group_and_checks_the_manifest(tmp_path):
    from genrec.train.data.verify import verify_dataset

    src = tmp_path / "seq.txt"
    src.write_text("".join(f"{u} 1 2 3 4\n" for u in range(20)))
    convert_sequences(src, tmp_path / "d")
    r = verify_dataset(tmp_path / "d")
    assert (r.files, r.users, r.events, r.item_id_max) == (3, 20, 80, 4)
    manifest = tmp_path / "d" / "dataset.json"
    good = manifest.read_text()
    manifest.write_text(good.replace('"num_events": 80', '"num_events": 81'))
    with pytest.raises(DataFormatError, match="dataset.json: num_events is 81 but interactions.parquet has 80"):
        verify_dataset(tmp_path / "d")
    manifest.write_text(good)
    file = damage_page(tmp_path / "d", "user_id")  # a column 'inspect' alone never reads
    with pytest.raises(DataFormatError, match=rf"{file} \(row group 0, rows 0-19\): cannot be read as Parquet"):
        verify_dataset(tmp_path / "d")


def test_the_reader_refuses_files_that_hold_other_users_than_the_manifest(tmp_path):
    """A stray copy of a part in interactions/ would be read as more users (each twice); the
    reader compares the rows with dataset.json. A file that is not Parquet beside the parts
    (a README) is no part."""
    import shutil

    src = tmp_path / "seq.txt"
    src.write_text("".join(f"{u} 1 2 3 4\n" for u in range(20)))
    convert_sequences(src, tmp_path / "d", layout=Layout(files=2))
    parts = sorted((tmp_path / "d" / "interactions").rglob("*.parquet"))
    (tmp_path / "d" / "interactions" / "README.txt").write_text("parts of the log\n")
    SequenceReader(tmp_path / "d", "train", embedding=emb(6), max_seq_len=8, batch_size=8)
    shutil.copy(parts[0], parts[0].with_name("part-copy.parquet"))
    with pytest.raises(DataFormatError, match=r"hold \d+ rows but dataset.json says 20 users"):
        SequenceReader(tmp_path / "d", "train", embedding=emb(6), max_seq_len=8, batch_size=8)


def test_baselines_name_a_damaged_dataset_file(tmp_path):
    from genrec.train.eval.baselines import Baseline

    src = tmp_path / "seq.txt"
    src.write_text("".join(f"{u} 1 2 3 4 5\n" for u in range(50)))
    convert_sequences(src, tmp_path / "d")
    damage_page(tmp_path / "d")
    file = tmp_path / "d" / "interactions.parquet"
    with pytest.raises(DataFormatError, match=rf"{file} \(row group 0, rows 0-49\): cannot be read as Parquet"):
        Baseline(tmp_path / "d", "popular")
