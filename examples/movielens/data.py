"""MovieLens 100K for the ranking example: read, download, a synthetic stand-in, and splits.

The data set is 100,000 ratings (1 to 5 stars) of 1682 movies by 943 users, published by GroupLens
(https://grouplens.org/datasets/movielens/100k/). Its license forbids redistributing it, so the
example never ships it: it reads a directory you point it at, or a copy it downloaded into a cache,
and when neither is possible it falls back to a synthetic data set of the same shape so the job
always runs.

Files read (the official layout):

    u.data           user id <TAB> item id <TAB> rating <TAB> timestamp   (all 100,000 ratings)
    u.item           item id | title | release date | ... (latin-1)      (optional: movie titles)
    u.user           user id | age | gender | occupation | zip code      (optional)
    u1.base/u1.test  ... u5.base/u5.test: the canonical 80/20 folds      (for --split u1 ... u5)

A malformed file raises ``DataError`` naming the file and the line.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tempfile
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import embcore as ec

URL = "https://files.grouplens.org/datasets/movielens/ml-100k.zip"
DEFAULT_CACHE = Path("~/.cache/embcore/ml-100k").expanduser()
# A copy the team keeps beside the repository checkout (never inside it: the license forbids
# redistribution); $EMBCORE_ML100K points elsewhere.
SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "ml-100k"


def local_copy() -> Path | None:
    """$EMBCORE_ML100K, else the shared copy beside the checkout, when it holds u.data.

    Raises:
        DataError: $EMBCORE_ML100K is set but names no folder holding u.data (a typo must not
            fall back to other data silently).
    """
    named = os.environ.get("EMBCORE_ML100K")
    if named:
        if not (Path(named) / "u.data").is_file():
            raise DataError(f"$EMBCORE_ML100K is {named!r}, which holds no u.data; point it at "
                            f"the MovieLens 100K folder, or unset it")
        return Path(named)
    return SHARED if (SHARED / "u.data").is_file() else None
NUM_USERS, NUM_MOVIES, NUM_RATINGS = 943, 1682, 100_000
SPLITS = ("random", "u1", "u2", "u3", "u4", "u5")

# sha256 of the files in the official archive (its SHA256SUMS). A download is accepted only when
# every one of them matches. (The archive itself has md5 0e33842e24a9c977be4e0107933c0723.)
SHA256 = {
    "README": "4883b8cf340ed0059971b33f56ad3adc88a40792108ebca3d24aafc4c82e8b52",
    "u.data": "06416e597f82b7342361e41163890c81036900f418ad91315590814211dca490",
    "u.genre": "9757e0d3e6b298159a80dd48eaf938114690e911e39af97a76949ef1663610bb",
    "u.info": "5b0a40b2e47a729ee6203063f6dcf8790c2e63f5a18663e6ee318a72c5f3c27b",
    "u.item": "553841ebc7de3a0fd0d6b62a204ea30c1e651aacfb2814c7a6584ac52f2c5701",
    "u.occupation": "cd5fbec9afe345d993a62fc7817df1a4a9079c4feb267b3118763b8fd942137d",
    "u.user": "f120e114da2e8cf314fd28f99417c94ae9ddf1cb6db8ce0e4b5995d40e90e62c",
    "u1.base": "ce253ec86c448b44fb3ba9a30d12dcfc2e9210cbde71efada3730c22e9ac212a",
    "u1.test": "18c6014a4b2c7324f250a63f8904a7b16b2b19f911129e346141507b0cbac950",
    "u2.base": "6c06f0b5df4b256da1a994f3ac66edc8da4d3f09bc9282df6b14d893366d703e",
    "u2.test": "4de658d1e04ed9104629509a2e2528fce833ac8e048280183f1df167632038c3",
    "u3.base": "afdc155c291c6edc41c0407e39d7462eb98d341e064f0b0a12175b80b3c4af5d",
    "u3.test": "0f548b51c78327de4c156461d3e430b7e5579fe2b5681586a59416e48fd35f6d",
    "u4.base": "219f0f4d40dfe9c5141d425f53fa91ee23ed275f14e280bbf1b50117afb064ca",
    "u4.test": "7c02ad0a1e7ab1083c8b9d4b627203a051dd7b5eab46d99fa44de33470de8db9",
    "u5.base": "a9574e59ce961eec2121627760b6e9b0974ce1637b3fe69ac32cb14a4bfab485",
    "u5.test": "351cc52e0d15b6c721466276fc24671d40936899e3d01fadeaf312915b8c5634",
    "ua.base": "67b5bcdb380c29f85d56a012ecd88612ae020f30a6730d117a334ee8203b91f2",
    "ua.test": "d0497e202417720f57a184ec8c66be2d1afa4ff41bb53787c57b28d6bf79bc42",
    "ub.base": "237254d253b6ad7de84f919d041055428646254f34ed8f562703c899430cd881",
    "ub.test": "d54a72d05730d5892062734b2bec73e976f9b713d18c828a18b968d6cce442da",
}


class DataError(ValueError):
    """A data file is missing or malformed; the message names the file (and line)."""


class DownloadError(RuntimeError):
    """The archive could not be fetched, failed its checksums, or could not be unpacked."""


@dataclass(frozen=True)
class Ratings:
    """Rating triples as three aligned tensors (R = number of ratings)."""

    user_id: torch.Tensor  # (R,) int64, MovieLens ids start at 1
    movie_id: torch.Tensor  # (R,) int64
    rating: torch.Tensor  # (R,) float32, 1.0 ... 5.0

    def __len__(self) -> int:
        return self.rating.shape[0]

    def __getitem__(self, index: slice | torch.Tensor) -> Ratings:
        """A subset: ``ratings[:1000]`` or ``ratings[index_tensor]``."""
        return Ratings(self.user_id[index], self.movie_id[index], self.rating[index])


@dataclass(frozen=True)
class MovieLens:
    """The loaded data set: all ratings plus what the optional files add."""

    ratings: Ratings
    num_users: int
    num_movies: int
    source: str  # where it came from, for the log: a directory or "synthetic"
    directory: Path | None = None  # None for the synthetic set
    titles: dict[int, str] = field(default_factory=dict)  # movie id -> title (from u.item)
    users: dict[int, str] = field(default_factory=dict)  # user id -> "age, gender, occupation"

    @property
    def synthetic(self) -> bool:
        return self.directory is None


# --------------------------------------------------------------------------------- reading
def _lines(path: Path) -> list[str]:
    """A file's lines (latin-1: u.item has accented titles), or DataError when it is missing."""
    try:
        return path.read_text(encoding="latin-1").splitlines()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read it: {e}") from None


def _int(text: str, what: str, where: str, lo: int = 1, hi: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise DataError(f"{where}: {what} must be an integer, got {text!r}") from None
    if value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise DataError(f"{where}: {what} must be {bound}, got {value}")
    return value


def read_ratings(path: str | os.PathLike[str]) -> Ratings:
    """Reads ``user id, item id, rating, timestamp`` lines (u.data, u1.base, ...).

    Raises:
        DataError: the file is missing or empty, or a line is malformed (message: ``file:line``).
    """
    path = Path(path)
    users: list[int] = []
    movies: list[int] = []
    ratings: list[int] = []
    for n, line in enumerate(_lines(path), start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        parts = line.split()
        if len(parts) != 4:
            raise DataError(f"{where}: expected 4 tab-separated fields (user id, item id, rating, "
                            f"timestamp), got {len(parts)}: {line[:80]!r}")
        users.append(_int(parts[0], "user id", where))
        movies.append(_int(parts[1], "item id", where))
        ratings.append(_int(parts[2], "rating", where, lo=1, hi=5))
        _int(parts[3], "timestamp", where, lo=0)
    if not ratings:
        raise DataError(f"{path}: no ratings in the file")
    return Ratings(torch.tensor(users), torch.tensor(movies),
                   torch.tensor(ratings, dtype=torch.float32))


def read_titles(path: str | os.PathLike[str]) -> dict[int, str]:
    """Movie id -> title from u.item (``id|title|release date|...``)."""
    path = Path(path)
    titles = {}
    for n, line in enumerate(_lines(path), start=1):
        if not line.strip():
            continue
        parts = line.split("|")
        if len(parts) < 2:
            raise DataError(f"{path}:{n}: expected '|'-separated fields (movie id|title|...), "
                            f"got {line[:80]!r}")
        titles[_int(parts[0], "movie id", f"{path}:{n}")] = parts[1]
    return titles


def read_users(path: str | os.PathLike[str]) -> dict[int, str]:
    """User id -> "age, gender, occupation" from u.user (``id|age|gender|occupation|zip``)."""
    path = Path(path)
    users = {}
    for n, line in enumerate(_lines(path), start=1):
        if not line.strip():
            continue
        parts = line.split("|")
        if len(parts) != 5:
            raise DataError(f"{path}:{n}: expected 5 '|'-separated fields (user id|age|gender|"
                            f"occupation|zip code), got {len(parts)}: {line[:80]!r}")
        users[_int(parts[0], "user id", f"{path}:{n}")] = ", ".join(parts[1:4])
    return users


def read_directory(directory: str | os.PathLike[str]) -> MovieLens:
    """Reads MovieLens 100K from a directory with u.data (u.item and u.user when present)."""
    directory = Path(directory).expanduser()
    if not (directory / "u.data").is_file():
        raise DataError(f"{directory}: no u.data here; point --data at the unpacked ml-100k "
                        f"directory (it holds u.data, u.item, u.user, u1.base, ...)")
    ratings = read_ratings(directory / "u.data")
    titles = read_titles(directory / "u.item") if (directory / "u.item").is_file() else {}
    users = read_users(directory / "u.user") if (directory / "u.user").is_file() else {}
    return MovieLens(ratings, num_users=int(ratings.user_id.max()),
                     num_movies=int(ratings.movie_id.max()), source=str(directory),
                     directory=directory, titles=titles, users=users)


# --------------------------------------------------------------------------------- download
def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def download(cache_dir: str | os.PathLike[str], url: str = URL, timeout: float = 10.0) -> Path:
    """Fetches the official archive, checks every file's sha256 and unpacks it into ``cache_dir``.

    The files are unpacked into a temporary sibling directory which is renamed into place only
    once all of them are verified, so ``cache_dir`` never holds a partial copy.

    Raises:
        DownloadError: no network (after at most ``timeout`` seconds), a bad archive, or a
            checksum mismatch.
    """
    cache_dir = Path(cache_dir).expanduser()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            archive = response.read()
    except (OSError, ValueError) as e:  # URLError, socket timeouts and HTTP errors are OSErrors
        raise DownloadError(f"cannot fetch {url}: {getattr(e, 'reason', e)}") from None
    try:
        with zipfile.ZipFile(io.BytesIO(archive)) as z:
            # Only the known files, found by base name: nothing else is written to disk.
            members = {Path(name).name: name for name in z.namelist()
                       if Path(name).name in SHA256}
            missing = sorted(set(SHA256) - set(members))
            if missing:
                raise DownloadError(f"{url}: the archive lacks {missing}")
            files = {name: z.read(member) for name, member in members.items()}
    except zipfile.BadZipFile as e:
        raise DownloadError(f"{url}: not a zip archive ({e})") from None
    for name, data in files.items():
        if _sha256(data) != SHA256[name]:
            raise DownloadError(f"{url}: {name} has sha256 {_sha256(data)}, expected "
                                f"{SHA256[name]}; the download is corrupt or not MovieLens 100K")
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cache_dir.name}-", dir=cache_dir.parent))
    try:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        if cache_dir.exists():  # e.g. an earlier copy without u.data: replace it
            shutil.rmtree(cache_dir)
        tmp.rename(cache_dir)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DownloadError(f"cannot unpack into {cache_dir}: {e}") from None
    return cache_dir


def load_movielens(data_dir: str | os.PathLike[str] | None = None,
                   cache_dir: str | os.PathLike[str] = DEFAULT_CACHE, *, url: str = URL,
                   timeout: float = 10.0,
                   log: Callable[[str], None] = print) -> MovieLens:
    """MovieLens 100K from ``data_dir``; else a local copy; else the cache; else downloaded; else
    synthetic.

    An explicit ``data_dir`` must hold the data (DataError otherwise). Without one: the directory
    in $EMBCORE_ML100K or the shared copy beside the checkout (``local_copy()``); else the cache
    when it holds u.data; else the archive is downloaded into it; when that fails the reason is
    logged in one line and the synthetic stand-in (``synthetic()``) is returned.
    """
    if data_dir is not None:
        return read_directory(data_dir)
    if (found := local_copy()) is not None:
        return read_directory(found)
    cache_dir = Path(cache_dir).expanduser()
    if (cache_dir / "u.data").is_file():
        return read_directory(cache_dir)
    try:
        log(f"MovieLens 100K not in {cache_dir}; downloading {url}")
        return read_directory(download(cache_dir, url, timeout))
    except DownloadError as e:
        log(f"download failed ({e}); using the built-in synthetic data set "
            f"({NUM_USERS} users, {NUM_MOVIES} movies, {NUM_RATINGS:,} ratings) instead")
        return synthetic()


# --------------------------------------------------------------------------------- synthetic
def synthetic(seed: int = 0, num_users: int = NUM_USERS, num_movies: int = NUM_MOVIES,
              num_ratings: int = NUM_RATINGS, rank: int = 8) -> MovieLens:
    """A stand-in with MovieLens 100K's shape, drawn from a latent-factor model.

    Every user rates at least 20 distinct movies (as in MovieLens), more active users rate more,
    popular movies are rated more often (a Zipf-like popularity), and each rating is
    ``round(mean + user bias + movie bias + <user factors, movie factors> + noise)`` clipped to
    1...5. The same seed gives the same data on every machine.
    """
    g = torch.Generator().manual_seed(seed)
    min_per_user = 20
    if num_ratings < min_per_user * num_users or num_ratings > num_users * num_movies // 2:
        raise ValueError(f"num_ratings={num_ratings} must lie in "
                         f"[{min_per_user * num_users}, {num_users * num_movies // 2}]")
    # How many movies each user rates: 20 + a heavy-tailed share of the rest.
    activity = torch.randn(num_users, generator=g).mul(0.9).exp()  # (U,) log-normal
    extra = activity / activity.sum() * (num_ratings - min_per_user * num_users)
    cap = num_movies // 2
    counts = (extra.floor().long() + min_per_user).clamp(max=cap)  # (U,)
    by_activity = torch.argsort(activity, descending=True)  # (U,)
    while (short := num_ratings - int(counts.sum())) > 0:  # rounding and the cap: top up
        room = by_activity[counts[by_activity] < cap][:short]
        counts[room] += 1
    # Which movies: drawn without replacement with Zipf-like popularity, a random id per rank.
    popularity = 1.0 / torch.arange(1, num_movies + 1, dtype=torch.float64) ** 0.8  # (M,)
    popularity = popularity[torch.randperm(num_movies, generator=g)]
    users = torch.repeat_interleave(torch.arange(num_users), counts)  # (R,)
    movies = torch.cat([torch.multinomial(popularity, int(c), generator=g)
                        for c in counts.tolist()])  # (R,) distinct within each user
    # The ratings: a latent-factor model plus noise, tuned to MovieLens' mean and spread.
    user_bias = 0.45 * torch.randn(num_users, generator=g)  # (U,)
    movie_bias = 0.5 * torch.randn(num_movies, generator=g) + 0.3 * popularity.log().sub(
        popularity.log().mean()).div(popularity.log().std())  # (M,) popular movies rate higher
    p = torch.randn(num_users, rank, generator=g) * 0.6 / rank ** 0.25  # (U, rank)
    q = torch.randn(num_movies, rank, generator=g) * 0.6 / rank ** 0.25  # (M, rank)
    score = (3.25 + user_bias[users] + movie_bias[movies] + (p[users] * q[movies]).sum(1)
             + 0.8 * torch.randn(users.shape[0], generator=g, dtype=torch.float64))  # (R,)
    rating = score.round().clamp(1, 5).float()
    shuffle = torch.randperm(users.shape[0], generator=g)  # MovieLens' u.data is unordered too
    ratings = Ratings(users[shuffle] + 1, movies[shuffle] + 1, rating[shuffle])  # 1-based ids
    return MovieLens(ratings, num_users=num_users, num_movies=num_movies, source="synthetic")


# --------------------------------------------------------------------------------- raw ids
RAW_ID_KEY = 0x6A09E667F3BCC908  # a fixed constant below 2**63 (sqrt(2)'s fraction, SHA-512's)


def raw_ids(ids: torch.Tensor) -> torch.Tensor:
    """MovieLens ids -> "raw" ids spread over all of int64, for ``train.py --raw-ids``.

    Real raw ids (hashed user names, URLs, 64-bit item keys) come from an unbounded space; this
    stands in for such a source with a fixed bijection of int64: ``splitmix64(id ^ RAW_ID_KEY)``
    (``embcore.numerics.hashing``). Distinct ids stay distinct, so the model sees the same data; only a
    dynamic table (``ec.DynamicVocabulary``) can take ids like these.
    """
    return ec.numerics.hashing.splitmix64(ids.to(torch.int64) ^ RAW_ID_KEY)  # (R,) int64


# --------------------------------------------------------------------------------- splits
def split(data: MovieLens, how: str = "random", seed: int = 42) -> tuple[Ratings, Ratings]:
    """(train, test) ratings.

    ``"random"``: all ratings shuffled with ``seed``, the first 80% train, the rest test (the
    tutorial's split). ``"u1"`` ... ``"u5"``: the canonical folds shipped with the data
    (u1.base / u1.test, ...); for the synthetic set, fold k of a 5-way partition of a shuffle
    with ``seed`` (disjoint test sets, like the real folds).

    Raises:
        ValueError: an unknown split name.
        DataError: a fold's files are missing or malformed.
    """
    if how not in SPLITS:
        raise ValueError(f"unknown split {how!r}; choose one of {', '.join(SPLITS)}")
    ratings = data.ratings
    perm = torch.randperm(len(ratings), generator=torch.Generator().manual_seed(seed))  # (R,)
    if how == "random":
        cut = int(0.8 * len(ratings))
        return ratings[perm[:cut]], ratings[perm[cut:]]
    fold = int(how[1:])
    if data.directory is None:
        test = torch.zeros(len(ratings), dtype=torch.bool)
        test[perm.chunk(5)[fold - 1]] = True
        return ratings[~test], ratings[test]
    base, held_out = data.directory / f"{how}.base", data.directory / f"{how}.test"
    for p in (base, held_out):
        if not p.is_file():
            raise DataError(f"{p}: not found; --split {how} needs the canonical folds that ship "
                            f"with MovieLens 100K ({how}.base and {how}.test beside u.data)")
    return read_ratings(base), read_ratings(held_out)
