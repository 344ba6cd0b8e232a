"""Converters from public formats into the interaction-log format (``train.data.schema``).

* ``sequences``: one user a line, ``user item item ...`` in time order (Amazon Beauty,
  ML-1M's ``user_sequences.txt``). No timestamps.
* ``ratings``: MovieLens ``UserID::MovieID::Rating::Timestamp`` (plain or .gz), grouped
  by user and ordered by time; the rating becomes a one-hot action (``rating_1..5``).
* ``movielens``: a MovieLens-1M folder as in ``shared/data/ml-1m``: every user's sequence
  from ``user_sequences.txt``, real timestamps and ratings where ``ratings*.dat*`` has them,
  and the profile from ``users.dat`` as context features.
* ``kuairand``: a KuaiRand-Pure (or -1K) ``data`` folder: the standard-policy feed logs, one
  event per exposed video in time order, its feedback signals (click, like, long_view, ...) as
  action bits, and ``user_features*.csv`` as context features.

Each takes ``layout`` (one ``interactions.parquet``, or a partitioned folder: ``schema.Layout``)
and ``progress`` (a bar of users written).
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from genrec.train.data.schema import MIN_EVENTS, DataFormatError, DatasetInfo, DatasetWriter, Layout

CHUNK = 8192
RATING_ACTIONS = [f"rating_{r}" for r in range(1, 6)]
ML_AGES = {1: 0, 18: 1, 25: 2, 35: 3, 45: 4, 50: 5, 56: 6}
ML_CONTEXT = {"gender": 2, "age": 7, "occupation": 21, "zip3": 1000}


INT64_MAX = 2**63 - 1


def _lines(path: Path, encoding: str = "utf-8") -> Iterator[tuple[int, str]]:
    """(line number, line without its end) of a text file, plain or .gz. Lines are decoded one
    at a time, so a bad byte is reported at its own line, not at the chunk a text stream
    happened to be decoding."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    yield lineno, raw.decode(encoding).rstrip("\r\n")
                except UnicodeDecodeError as e:
                    raise DataFormatError(
                        f"{path}:{lineno}: byte 0x{raw[e.start]:02x} at column {e.start + 1} is not valid "
                        f"{encoding}; convert the file to {encoding} (e.g. iconv -f latin1 -t utf-8)"
                    ) from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise DataFormatError(f"{path}: not a complete gzip file ({e}); download or compress it again") from None


def _ints(tokens: list[str], path: Path, lineno: int, names: Sequence[str]) -> list[int]:
    """The tokens as int64 ids; ``names[i]`` (the last name repeats) says which field is bad."""
    out = []
    for k, t in enumerate(tokens):
        name = names[min(k, len(names) - 1)]
        try:
            v = int(t)
        except ValueError:
            raise DataFormatError(f"{path}:{lineno}: '{t}' is not an integer id ({name}, field {k + 1})") from None
        if not -INT64_MAX - 1 <= v <= INT64_MAX:
            raise DataFormatError(f"{path}:{lineno}: {name} {t} (field {k + 1}) does not fit in int64 "
                                  f"(at most 2^63-1 = {INT64_MAX}); map such ids to smaller integers first")
        out.append(v)
    return out


def read_sequences(path: Path) -> Iterator[tuple[int, list[int]]]:
    """Yields (user, items) from a ``user item item ...`` file; malformed lines raise, and so does
    a user on a second line (one row a user: the reader would read it twice)."""
    first: dict[int, int] = {}
    for lineno, line in _lines(path):
        tokens = line.split()
        if not tokens:
            continue
        ids = _ints(tokens, path, lineno, ("user id", "item id"))
        if len(ids) < 2:
            raise DataFormatError(f"{path}:{lineno}: user {ids[0]} has no items")
        if min(ids[1:]) < 0:
            raise DataFormatError(f"{path}:{lineno}: negative item id")
        if ids[0] in first:
            raise DataFormatError(f"{path}:{lineno}: user {ids[0]} is on line {first[ids[0]]} already; "
                                  "give each user's events on one line")
        first[ids[0]] = lineno
        yield ids[0], ids[1:]


def _dropped(w: DatasetWriter, n: int) -> None:
    """Records users left out for having fewer than MIN_EVENTS events (``extra.dropped_users``)."""
    if n:
        w.info.extra["dropped_users"] = n


def read_ratings(path: Path) -> dict[int, list[tuple[int, int, int]]]:
    """user -> [(timestamp, item, rating)] in file order, from ``u::i::r::t`` lines."""
    users: dict[int, list[tuple[int, int, int]]] = {}
    for lineno, line in _lines(path):
        if not line.strip():
            continue
        parts = line.split("::")
        if len(parts) != 4:
            raise DataFormatError(
                f"{path}:{lineno}: expected UserID::MovieID::Rating::Timestamp, got {line.strip()!r}"
            )
        u, i, r, t = _ints(parts, path, lineno, ("UserID", "MovieID", "Rating", "Timestamp"))
        if not 1 <= r <= 5:
            raise DataFormatError(f"{path}:{lineno}: rating {r} is outside 1..5")
        if i < 0:
            raise DataFormatError(f"{path}:{lineno}: negative MovieID {i}")
        users.setdefault(u, []).append((t, i, r))
    return users


def _no_users(path: Path, expected: str) -> DataFormatError:
    return DataFormatError(f"{path}: no users (the file is empty or blank); expected {expected} lines")


def _flush(writer: DatasetWriter, rows: dict[str, list]) -> None:
    if rows["user_id"]:
        writer.write(rows)
    for v in rows.values():
        v.clear()


def convert_sequences(path: str | Path, out: str | Path, source: str | None = None, *,
                      layout: Layout | None = None, progress: bool = False) -> DatasetInfo:
    path = Path(path)
    rows: dict[str, list] = {"user_id": [], "item_ids": []}
    with DatasetWriter(out, source=source or path.name, layout=layout, progress=progress) as w:
        dropped = 0
        for user, items in read_sequences(path):
            if len(items) < MIN_EVENTS:  # (leave-one-out holds out two: nothing to train on)
                dropped += 1
                continue
            rows["user_id"].append(user)
            rows["item_ids"].append(items)
            if len(rows["user_id"]) >= CHUNK:
                _flush(w, rows)
        _flush(w, rows)
        _dropped(w, dropped)
        if not w.info.num_users:
            raise _no_users(path, "'user item item ...'")
    return w.info


def convert_ratings(path: str | Path, out: str | Path, users_file: str | Path | None = None, *,
                    layout: Layout | None = None, progress: bool = False) -> DatasetInfo:
    path = Path(path)
    ratings = read_ratings(path)
    if not ratings:
        raise _no_users(path, "UserID::MovieID::Rating::Timestamp")
    profiles = read_ml_users(Path(users_file)) if users_file else None
    rows = _empty_rows(profiles is not None)
    with DatasetWriter(out, source=path.name, action_names=RATING_ACTIONS,
                       context_features=ML_CONTEXT if profiles else None, layout=layout, progress=progress,
                       total=len(ratings)) as w:
        short = [u for u in ratings if len(ratings[u]) < MIN_EVENTS]
        _dropped(w, len(short))
        for user in sorted(set(ratings) - set(short)):
            events = sorted(ratings[user], key=lambda e: e[0])  # stable: ties keep file order
            _append_user(rows, user, [e[1] for e in events], [e[0] for e in events],
                         [1 << (e[2] - 1) for e in events], profiles)
            if len(rows["user_id"]) >= CHUNK:
                _flush(w, rows)
        _flush(w, rows)
    return w.info


def read_ml_users(path: Path) -> dict[int, dict[str, int]]:
    """MovieLens users.dat -> user -> {gender, age, occupation, zip3} context ids."""
    out = {}
    for lineno, line in _lines(path, encoding="latin-1"):
        if not line.strip():
            continue
        parts = line.split("::")
        if len(parts) != 5 or parts[1] not in ("F", "M"):
            raise DataFormatError(f"{path}:{lineno}: expected UserID::Gender::Age::Occupation::Zip")
        u, age, occ = _ints([parts[0], parts[2], parts[3]], path, lineno, ("UserID", "Age", "Occupation"))
        if age not in ML_AGES or not 0 <= occ < ML_CONTEXT["occupation"]:
            raise DataFormatError(f"{path}:{lineno}: unknown age {age} or occupation {occ}")
        zip3 = int(parts[4][:3]) if parts[4][:3].isdigit() else 0
        out[u] = {"gender": int(parts[1] == "M"), "age": ML_AGES[age], "occupation": occ, "zip3": zip3}
    return out


def _empty_rows(with_context: bool) -> dict[str, list]:
    rows: dict[str, list] = {"user_id": [], "item_ids": [], "timestamps": [], "actions": []}
    if with_context:
        rows.update({f"ctx_{k}": [] for k in ML_CONTEXT})
    return rows


def _append_user(rows, user, items, times, actions, profiles) -> None:  # noqa: ANN001
    rows["user_id"].append(user)
    rows["item_ids"].append(items)
    rows["timestamps"].append(times)
    rows["actions"].append(actions)
    if profiles is not None:
        prof = profiles.get(user)
        for k in ML_CONTEXT:
            rows[f"ctx_{k}"].append([prof[k]] if prof else None)


def convert_movielens(folder: str | Path, out: str | Path, *, layout: Layout | None = None,
                      progress: bool = False) -> DatasetInfo:
    """ML-1M: all users' sequences, with timestamps and ratings where the ratings file has them."""
    folder = Path(folder)
    seq_path = folder / "user_sequences.txt"
    rating_files = sorted(folder.glob("ratings*.dat*"))
    if not seq_path.exists():
        raise DataFormatError(f"{folder}: no user_sequences.txt")
    ratings = read_ratings(rating_files[0]) if rating_files else {}
    users_path = folder / "users.dat"
    profiles = read_ml_users(users_path) if users_path.exists() else None
    rows = _empty_rows(profiles is not None)
    with DatasetWriter(out, source="ml-1m", action_names=RATING_ACTIONS,
                       context_features=ML_CONTEXT if profiles else None, layout=layout, progress=progress) as w:
        dropped = 0
        for user, items in read_sequences(seq_path):
            if len(items) < MIN_EVENTS:
                dropped += 1
                continue
            times = actions = None
            if user in ratings:
                by_item = {i: (t, r) for t, i, r in ratings[user]}
                missing = [i for i in items if i not in by_item]
                if missing or len(by_item) != len(items):
                    raise DataFormatError(
                        f"{rating_files[0]}: user {user}'s ratings do not match {seq_path.name} "
                        f"(item {missing[0] if missing else '?'} differs)"
                    )
                times = [by_item[i][0] for i in items]
                actions = [1 << (by_item[i][1] - 1) for i in items]
            _append_user(rows, user, items, times, actions, profiles)
            if len(rows["user_id"]) >= CHUNK:
                _flush(w, rows)
        _flush(w, rows)
        _dropped(w, dropped)
        if not w.info.num_users:
            raise _no_users(seq_path, "'user item item ...'")
    return w.info


# KuaiRand (Gao et al., CIKM 2022, CC BY-SA 4.0): Kuaishou feed logs, one row per exposed video
# with its feedback signals. Every row is an impression (bit 0), so every event is a labelled
# ranking candidate and a non-click is a real negative; the signals are the other bits.
KUAIRAND_SIGNALS = {"click": "is_click", "like": "is_like", "follow": "is_follow", "comment": "is_comment",
                    "forward": "is_forward", "hate": "is_hate", "long_view": "long_view",
                    "profile_enter": "is_profile_enter"}
KUAIRAND_ACTIONS = ["impression", *KUAIRAND_SIGNALS]
# context feature -> user_features column; values become ids 1.. in sorted order, 0 = missing
KUAIRAND_CONTEXT = {"active_degree": "user_active_degree", "video_author": "is_video_author",
                    "register_days": "register_days_range", "fans": "fans_user_num_range",
                    "follows": "follow_user_num_range", "friends": "friend_user_num_range"}


def _read_csv(path: Path, types: dict[str, pa.DataType]) -> pa.Table:
    """The ``types`` columns of a CSV with a header line (plain or .gz, by suffix)."""
    opts = pacsv.ConvertOptions(include_columns=list(types), column_types=types)
    try:
        return pacsv.read_csv(path, convert_options=opts)
    except pa.ArrowException as e:
        raise DataFormatError(f"{path}: {' '.join(str(e).split())}; expected a CSV with a header line naming "
                              f"{', '.join(types)} (the KuaiRand release's columns)") from None


def _no_nulls(path: Path, t: pa.Table) -> None:
    for name in t.column_names:
        col = t.column(name)
        if col.null_count:
            row = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            raise DataFormatError(f"{path}:{row + 2}: column '{name}' is empty")  # line 1 is the header


def read_kuairand_logs(paths: Sequence[Path]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(user, video, time_ms, action bitmask) per row of the log files, in file order."""
    types = {c: pa.int64() for c in ("user_id", "video_id", "time_ms", *KUAIRAND_SIGNALS.values())}
    parts = []
    for path in paths:
        t = _read_csv(path, types)
        _no_nulls(path, t)
        acts = np.ones(t.num_rows, np.int64)  # bit 0: impression
        for bit, col in enumerate(KUAIRAND_SIGNALS.values(), 1):
            v = t.column(col).to_numpy()
            bad = np.flatnonzero((v != 0) & (v != 1))
            if bad.size:
                raise DataFormatError(f"{path}:{bad[0] + 2}: {col} is {v[bad[0]]}, expected 0 or 1")
            acts |= v << bit
        video = t.column("video_id").to_numpy()
        if video.size and video.min() < 0:
            raise DataFormatError(f"{path}:{int(np.argmin(video)) + 2}: negative video_id {video.min()}")
        parts.append((t.column("user_id").to_numpy(), video, t.column("time_ms").to_numpy(), acts))
    return tuple(np.concatenate([p[k] for p in parts]) for k in range(4))  # type: ignore[return-value]


def read_kuairand_users(path: Path) -> tuple[dict[int, dict[str, int]], dict[str, int]]:
    """user -> {context feature: id}, and each feature's cardinality (ids 1.. for the values
    seen, in sorted order; 0 for a missing value)."""
    t = _read_csv(path, {"user_id": pa.int64(), **{c: pa.string() for c in KUAIRAND_CONTEXT.values()}})
    _no_nulls(path, t.select(["user_id"]))
    ids, cards = {}, {}
    for name, col in KUAIRAND_CONTEXT.items():
        values = t.column(col).to_pylist()
        vocab = {v: i for i, v in enumerate(sorted({v for v in values if v}), 1)}
        ids[name] = [vocab.get(v, 0) for v in values]
        cards[name] = len(vocab) + 1
    users = t.column("user_id").to_pylist()
    return {u: {n: ids[n][k] for n in KUAIRAND_CONTEXT} for k, u in enumerate(users)}, cards


def convert_kuairand(folder: str | Path, out: str | Path, *, layout: Layout | None = None,
                     progress: bool = False) -> DatasetInfo:
    """KuaiRand: each user's standard-policy exposures in time order (ties keep file order),
    timestamps in seconds, feedback signals as action bits, the profile as context. The
    random-policy log is left out: its exposures come from another policy. Users with fewer
    than MIN_EVENTS exposures are dropped (``extra.dropped_users``)."""
    folder = Path(folder)
    if not any(folder.glob("log_standard_*.csv*")) and (folder / "data").is_dir():
        folder = folder / "data"  # the release unpacks to KuaiRand-Pure/data/
    logs = sorted(folder.glob("log_standard_*.csv*"))
    if not logs:
        raise DataFormatError(f"{folder}: no log_standard_*.csv; pass the KuaiRand-Pure 'data' folder "
                              f"(from KuaiRand-Pure.tar.gz)")
    user, video, time_ms, acts = read_kuairand_logs(logs)
    order = np.lexsort((np.arange(user.size), time_ms, user))
    user, video, time_ms, acts = user[order], video[order], time_ms[order], acts[order]
    users, starts, counts = np.unique(user, return_index=True, return_counts=True)
    user_files = sorted(folder.glob("user_features*.csv*"))
    profiles, cards = read_kuairand_users(user_files[0]) if user_files else (None, {})
    rows: dict[str, list] = {"user_id": [], "item_ids": [], "timestamps": [], "actions": []}
    rows.update({f"ctx_{k}": [] for k in cards})
    dropped = int((counts < MIN_EVENTS).sum())
    with DatasetWriter(out, source="kuairand", action_names=KUAIRAND_ACTIONS, context_features=cards,
                       extra={"logs": [p.name for p in logs], "dropped_users": dropped}, layout=layout,
                       progress=progress, total=users.size - dropped) as w:
        for u, s, n in zip(users.tolist(), starts.tolist(), counts.tolist()):
            if n < MIN_EVENTS:
                continue
            rows["user_id"].append(u)
            rows["item_ids"].append(video[s : s + n])
            rows["timestamps"].append(time_ms[s : s + n] // 1000)
            rows["actions"].append(acts[s : s + n])
            prof = profiles.get(u) if profiles is not None else None
            for k in cards:
                rows[f"ctx_{k}"].append([prof[k]] if prof else None)
            if len(rows["user_id"]) >= CHUNK:
                _flush(w, rows)
        _flush(w, rows)
        if not w.info.num_users:
            raise DataFormatError(f"{folder}: no user has {MIN_EVENTS} or more exposures in {logs[0].name}")
    return w.info
