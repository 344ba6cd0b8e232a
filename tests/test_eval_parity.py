"""Offline evaluation measures what the server returns: the same checkpoint, through
``genrec quantize`` (fp32) and ``genrec serve``'s engine over gRPC, for the same users with the
same histories, gives the same HR@10 and NDCG@10 as ``genrec eval``, on data where a share of
the held-out targets repeat an item of their user's history (which the server, excluding the
history, can never return)."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from genrec.cli import main as genrec
from genrec.loadtest.client import RecommenderClient, user
from genrec.train.cli import evaluate_run
from genrec.train.data.synthetic import SyntheticConfig, generate
from genrec.train.job import load_job
from genrec.train.loop.launch import run_training
from tests.conftest import TINY_TABLES, tiny_job_overrides
from tests.serving_helpers import ThreadedServer


@pytest.fixture(scope="module")
def repeat_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("repeats") / "data"
    generate(SyntheticConfig(num_users=300, num_items=600, num_topics=8, median_len=12, max_len=60, seed=3,
                             chunk_users=128, repeat=0.3), out, progress=False)
    return out


def test_offline_hr_equals_what_the_server_returns_on_data_with_repeats(repeat_data, tmp_path):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY_TABLES)
    run_dir, _ = run_training(load_job(cfg, tiny_job_overrides(repeat_data, tmp_path / "runs")
                                       + ["--train.max_epochs=6"]))
    art = tmp_path / "artifact"
    assert genrec(["quantize", "--checkpoint", str(run_dir), "--out", str(art), "--embeddings", "fp32",
                   "--dense", "fp32", "--no-eval", "--no-progress"]) == 0
    offline, _ = evaluate_run(run_dir, None, "test")

    rows = pq.read_table(repeat_data / "interactions.parquet", columns=["item_ids", "timestamps"]).to_pylist()
    srv = ThreadedServer(art)
    hits, gain, repeats = 0, 0.0, 0
    try:
        client = RecommenderClient(srv.target, timeout_s=30.0)
        for row in rows:  # the test split: the last event held out, every earlier one sent
            items, times = row["item_ids"], row["timestamps"]
            target, history = items[-1], [(i, t, 0) for i, t in zip(items[:-1], times[:-1])]
            repeats += target in items[:-1]
            got = [i.item_id for i in client.retrieve(user(history, request_time=times[-1]), k=10).items]
            if target in got:
                hits += 1
                gain += 1.0 / math.log2(got.index(target) + 2)
    finally:
        srv.stop()
    assert repeats / len(rows) > 0.2  # the data has what this test is about
    assert offline["users"] == len(rows)
    assert hits / len(rows) == pytest.approx(offline["hr@10"], abs=1e-9)
    assert gain / len(rows) == pytest.approx(offline["ndcg@10"], abs=1e-6)


def test_the_history_left_out_is_in_table_rows_as_the_targets_and_the_catalogue(repeat_data):
    """A hashed item table (``oov = "hash"``: ids past its rows fold into them): targets and the
    catalogue are table rows, so the history the evaluator leaves out (and checks repeats
    against) must be too, as the server's is; raw ids past the table matched nothing."""
    import numpy as np

    from genrec.embedding.spec import EmbeddingConfig, TableConfig, prepare_ids
    from genrec.train.data.reader import SequenceReader

    table = TableConfig("item", ("item",), dim=8, num_embeddings=200, oov="hash")  # ids go to 600
    reader = SequenceReader(repeat_data, "test", embedding=EmbeddingConfig(tables=(table,)), max_seq_len=50,
                            batch_size=64)
    rows = pq.read_table(repeat_data / "interactions.parquet", columns=["user_id", "item_ids"]).to_pydict()
    history = {u: items[:-1] for u, items in zip(rows["user_id"], rows["item_ids"])}
    batch = next(iter(reader))
    seen = np.split(batch.seen_ids.numpy(), np.cumsum(batch.seen_lengths.numpy())[:-1])
    assert int(batch.seen_ids.max()) < 200 and max(max(h) for h in history.values()) > 200
    for u, s in zip(batch.user_ids.tolist(), seen):
        assert s.tolist() == prepare_ids(table, "item", np.array(history[u])).tolist()


def test_a_window_with_a_zero_timestamp_is_read_at_positions_as_the_server_reads_it():
    """A timestamp of 0 is what a request leaves unset: the server reads a window holding one at
    positions (``serve.requests``), so the evaluator's and the trainer's windows do too."""
    import numpy as np

    from genrec.train.data.samples import UserEvents, loo_eval, retrieval_window

    times = np.arange(1, 11, dtype=np.int64) * 1_700_000_000
    ev = UserEvents(7, np.arange(1, 11), times, None)
    assert loo_eval(ev, 9, 5).has_time and retrieval_window(ev, 9, 5, None).has_time
    times[6] = 0
    assert not loo_eval(ev, 9, 5).has_time  # (the window: events 4-8)
    assert not retrieval_window(ev, 9, 5, None).has_time
    assert loo_eval(ev, 6, 3).has_time  # (events 3-5: the zero lies outside)
