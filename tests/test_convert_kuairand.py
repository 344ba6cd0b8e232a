"""The KuaiRand converter on a tiny inline sample in the release's CSV layout."""

import numpy as np
import pyarrow.parquet as pq
import pytest

from genrec.train.data.convert import KUAIRAND_ACTIONS, convert_kuairand
from genrec.train.data.reader import SequenceReader
from genrec.train.data.samples import RankingDataConfig
from genrec.train.data.schema import DataFormatError
from genrec.train.job import load_job, resolve_embedding, task_masks

HEADER = ("user_id,video_id,date,hourmin,time_ms,is_click,is_like,is_follow,is_comment,is_forward,is_hate,"
          "long_view,play_time_ms,duration_ms,profile_stay_time,comment_stay_time,is_profile_enter,is_rand,tab")


def log_line(user, video, t_ms, click=0, like=0, long_view=0, follow=0):
    return (f"{user},{video},20220410,1200,{t_ms},{click},{like},{follow},0,0,0,{long_view},1000,9000,0,0,0,0,1")


def write_release(root, early, late, users=True):
    d = root / "KuaiRand-Pure" / "data"
    d.mkdir(parents=True)
    (d / "log_standard_4_08_to_4_21_pure.csv").write_text("\n".join([HEADER, *early]) + "\n")
    (d / "log_standard_4_22_to_5_08_pure.csv").write_text("\n".join([HEADER, *late]) + "\n")
    (d / "log_random_4_22_to_5_08_pure.csv").write_text(HEADER + "\n" + log_line(1, 99, 1_650_000_000_500) + "\n")
    if users:
        (d / "user_features_pure.csv").write_text(
            "user_id,user_active_degree,is_lowactive_period,is_live_streamer,is_video_author,follow_user_num,"
            "follow_user_num_range,fans_user_num,fans_user_num_range,friend_user_num,friend_user_num_range,"
            "register_days,register_days_range\n"
            "1,full_active,0,0,1,5,\"(0,10]\",312,\"[100,1k)\",0,0,3624,730+\n"
            "2,high_active,0,0,0,0,0,0,0,3,\"[1,5)\",20,15-30\n")
    return root / "KuaiRand-Pure"


def rows(out):
    return {r["user_id"]: r for r in pq.read_table(out / "interactions.parquet").to_pylist()}


def test_events_in_time_order_with_signals_as_action_bits(tmp_path):
    early = [log_line(1, 10, 1_649_400_000_000, click=1, long_view=1),
             log_line(2, 11, 1_649_400_001_000),
             log_line(1, 12, 1_649_390_000_000, click=1, like=1),  # earlier than the row above it
             log_line(2, 10, 1_649_400_002_000, click=1),
             log_line(3, 10, 1_649_400_000_000)]  # two events only: dropped
    late = [log_line(1, 13, 1_650_700_000_000, follow=1),
            log_line(1, 0, 1_650_700_000_000),  # same time: keeps file order; video id 0 is an id
            log_line(2, 12, 1_650_700_000_000),
            log_line(3, 11, 1_650_700_000_000)]
    info = convert_kuairand(write_release(tmp_path, early, late), tmp_path / "out")
    assert info.action_names == KUAIRAND_ACTIONS and info.extra["dropped_users"] == 1
    assert info.extra["logs"] == ["log_standard_4_08_to_4_21_pure.csv", "log_standard_4_22_to_5_08_pure.csv"]
    assert (info.num_users, info.num_events, info.users_with_timestamps) == (2, 7, 2)
    r = rows(tmp_path / "out")
    assert r[1]["item_ids"] == [12, 10, 13, 0]  # the random-policy log's video 99 is not in
    assert r[1]["timestamps"] == [1_649_390_000, 1_649_400_000, 1_650_700_000, 1_650_700_000]
    bit = {a: 1 << i for i, a in enumerate(KUAIRAND_ACTIONS)}
    assert r[1]["actions"] == [bit["impression"] | bit["click"] | bit["like"],
                               bit["impression"] | bit["click"] | bit["long_view"],
                               bit["impression"] | bit["follow"], bit["impression"]]
    assert r[2]["item_ids"] == [11, 10, 12] and r[2]["actions"][1] == bit["impression"] | bit["click"]
    # profile values become ids 1.. in sorted order; 0 is reserved for a missing value
    assert info.context_features["active_degree"] == 3
    assert (r[1]["ctx_active_degree"], r[2]["ctx_active_degree"]) == ([1], [2])
    assert (r[1]["ctx_register_days"], r[2]["ctx_register_days"]) == ([2], [1])


def test_without_user_features_no_context(tmp_path):
    early = [log_line(1, v, 1_649_400_000_000 + v) for v in range(3)]
    info = convert_kuairand(write_release(tmp_path, early, [], users=False) / "data", tmp_path / "out")
    assert info.context_features == {} and info.num_events == 3


@pytest.mark.parametrize("line,err", [
    (log_line(1, 5, 1_649_400_000_000, click=2), r"_pure.csv:3: is_click is 2, expected 0 or 1"),
    (log_line(1, "x", 1_649_400_000_000), r"_pure.csv: In CSV column #1: CSV conversion error to int64"),
    ("1,5,20220410,1200,,0,0,0,0,0,0,0,1,1,0,0,0,0,1", r"_pure.csv:3: column 'time_ms' is empty"),
])
def test_bad_rows_name_the_file_and_line(tmp_path, line, err):
    early = [log_line(1, 4, 1_649_400_000_000), line, log_line(1, 6, 1_649_400_000_002)]
    with pytest.raises(DataFormatError, match=err):
        convert_kuairand(write_release(tmp_path, early, []), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_folder_without_logs_says_what_to_pass(tmp_path):
    with pytest.raises(DataFormatError, match="no log_standard_.*KuaiRand-Pure 'data' folder"):
        convert_kuairand(tmp_path, tmp_path / "out")


def test_config_reads_the_converted_dataset(tmp_path):
    """configs/ranking_kuairand.toml's tasks and context tables fit what the converter writes,
    and the held-out candidates are labelled from the real signals."""
    rng = np.random.default_rng(0)
    lines = [log_line(u, int(rng.integers(0, 30)), 1_649_400_000_000 + 60_000 * i + u,
                      click=int(rng.random() < 0.4), like=int(rng.random() < 0.1), long_view=int(rng.random() < 0.3))
             for u in (1, 2) for i in range(40)]
    convert_kuairand(write_release(tmp_path, lines, []), tmp_path / "out")
    job = load_job("configs/ranking_kuairand.toml", [f'--data.path="{tmp_path / "out"}"'])
    from genrec.train.data.schema import read_info

    info = read_info(tmp_path / "out")
    emb = resolve_embedding(job.embedding, info)
    masks = task_masks(job, info)
    assert masks["click"] == 1 << KUAIRAND_ACTIONS.index("click")
    rk = RankingDataConfig(enabled=True, num_candidates=4, test_fraction=0.1)
    reader = SequenceReader(tmp_path / "out", "rank_test", embedding=emb, max_seq_len=50, batch_size=8,
                            ranking=rk, tasks=masks, context_features=True)
    batches = list(reader)
    assert batches and sum(int(b.num_targets.sum()) for b in batches) == 8  # the last 10% of 80 events
    assert set(batches[0].context.keys()) == set(info.context_features)
