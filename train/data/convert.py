"""Converters from public formats into the interaction-log format (``train.data.schema``).

* ``sequences``: one user a line, ``user item item ...`` in time order (Amazon Beauty,
  ML-1M's ``user_sequences.txt``). No timestamps.
* ``ratings``: MovieLens ``UserID::MovieID::Rating::Timestamp`` (plain or .gz), grouped
  by user and ordered by time; the rating becomes a one-hot action (``rating_1..5``).
* ``movielens``: a MovieLens-1M folder as in ``shared/data/ml-1m``: every user's sequence
  from ``user_sequences.txt``, real timestamps and ratings where ``ratings*.dat*`` has them,
  and the profile from ``users.dat`` as context features.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from genrec.train.data.schema import DataFormatError, DatasetInfo, DatasetWriter

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
    """Yields (user, items) from a ``user item item ...`` file; malformed lines raise."""
    for lineno, line in _lines(path):
        tokens = line.split()
        if not tokens:
            continue
        ids = _ints(tokens, path, lineno, ("user id", "item id"))
        if len(ids) < 2:
            raise DataFormatError(f"{path}:{lineno}: user {ids[0]} has no items")
        if min(ids[1:]) < 0:
            raise DataFormatError(f"{path}:{lineno}: negative item id")
        yield ids[0], ids[1:]


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


def convert_sequences(path: str | Path, out: str | Path, source: str | None = None) -> DatasetInfo:
    path = Path(path)
    rows: dict[str, list] = {"user_id": [], "item_ids": []}
    with DatasetWriter(out, source=source or path.name) as w:
        for user, items in read_sequences(path):
            rows["user_id"].append(user)
            rows["item_ids"].append(items)
            if len(rows["user_id"]) >= CHUNK:
                _flush(w, rows)
        _flush(w, rows)
        if not w.info.num_users:
            raise _no_users(path, "'user item item ...'")
    return w.info


def convert_ratings(path: str | Path, out: str | Path, users_file: str | Path | None = None) -> DatasetInfo:
    path = Path(path)
    ratings = read_ratings(path)
    if not ratings:
        raise _no_users(path, "UserID::MovieID::Rating::Timestamp")
    profiles = read_ml_users(Path(users_file)) if users_file else None
    rows = _empty_rows(profiles is not None)
    with DatasetWriter(out, source=path.name, action_names=RATING_ACTIONS,
                       context_features=ML_CONTEXT if profiles else None) as w:
        for user in sorted(ratings):
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


def convert_movielens(folder: str | Path, out: str | Path) -> DatasetInfo:
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
                       context_features=ML_CONTEXT if profiles else None) as w:
        for user, items in read_sequences(seq_path):
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
        if not w.info.num_users:
            raise _no_users(seq_path, "'user item item ...'")
    return w.info
