"""The MovieLens example's data loader: real files, synthetic stand-in, splits, download, errors.

Tests marked ``requires_data`` read the real MovieLens 100K files from ``../shared/data/ml-100k``
beside the checkout (or ``$EMBCORE_ML100K``); its license forbids shipping them in the repository,
so they are skipped where it is absent.
"""

import zipfile
from pathlib import Path

import pytest
import torch

from ml100k import ML100K, requires_data  # also puts examples/movielens on sys.path

import data as ml  # noqa: E402  (examples/movielens/data.py)



@pytest.fixture(scope="module")
def real() -> ml.MovieLens:
    return ml.read_directory(ML100K)


@pytest.fixture(scope="module")
def fake() -> ml.MovieLens:
    return ml.synthetic()


# --------------------------------------------------------------------------------- real files
@requires_data
def test_real_data_has_movielens_shape(real):
    assert len(real.ratings) == ml.NUM_RATINGS
    assert (real.num_users, real.num_movies) == (ml.NUM_USERS, ml.NUM_MOVIES)
    assert real.titles[100] == "Fargo (1996)"  # the tutorial's serving example
    assert real.users[30] == "7, M, student"
    assert set(real.ratings.rating.unique().tolist()) == {1.0, 2.0, 3.0, 4.0, 5.0}


@requires_data
def test_canonical_fold_is_the_shipped_files(real):
    train, test = ml.split(real, "u1")
    assert (len(train), len(test)) == (80_000, 20_000)
    base = ml.read_ratings(ML100K / "u1.base")
    assert torch.equal(train.user_id, base.user_id) and torch.equal(train.rating, base.rating)


@requires_data
def test_random_split_is_seeded_and_partitions(real):
    train, test = ml.split(real, "random")
    again, _ = ml.split(real, "random")
    assert (len(train), len(test)) == (80_000, 20_000)
    assert torch.equal(train.movie_id, again.movie_id)
    pairs = lambda r: set(zip(r.user_id.tolist(), r.movie_id.tolist(), strict=True))  # noqa: E731
    assert pairs(train) | pairs(test) == pairs(real.ratings) and not pairs(train) & pairs(test)


# --------------------------------------------------------------------------------- synthetic
def test_synthetic_has_movielens_shape(fake):
    r = fake.ratings
    assert len(r) == ml.NUM_RATINGS and fake.synthetic
    assert int(r.user_id.min()) == 1 and int(r.user_id.max()) == ml.NUM_USERS
    assert int(r.movie_id.min()) >= 1 and int(r.movie_id.max()) <= ml.NUM_MOVIES
    assert set(r.rating.unique().tolist()) == {1.0, 2.0, 3.0, 4.0, 5.0}
    assert 3.2 < float(r.rating.mean()) < 3.9
    assert len(torch.unique(r.user_id * 10_000 + r.movie_id)) == len(r)  # one rating per pair
    assert int(torch.bincount(r.user_id)[1:].min()) >= 20


def test_synthetic_is_deterministic(fake):
    again = ml.synthetic()
    assert torch.equal(fake.ratings.user_id, again.ratings.user_id)
    assert torch.equal(fake.ratings.rating, again.ratings.rating)
    assert not torch.equal(ml.synthetic(seed=1).ratings.rating, fake.ratings.rating)


@pytest.mark.parametrize("how", ["random", "u1", "u5"])
def test_synthetic_splits_are_80_20(fake, how):
    train, test = ml.split(fake, how)
    assert (len(train), len(test)) == (80_000, 20_000)


def test_synthetic_folds_have_disjoint_test_sets(fake):
    tests = [ml.split(fake, f"u{k}")[1] for k in (1, 2)]
    keys = [set((t.user_id * 10_000 + t.movie_id).tolist()) for t in tests]
    assert not keys[0] & keys[1]


# --------------------------------------------------------------------------------- download
def _zip_of(directory: Path, dest: Path, replace: dict[str, bytes] | None = None) -> str:
    """A zip laid out like the official archive (ml-100k/<file>), as a file:// URL."""
    with zipfile.ZipFile(dest, "w") as z:
        for name in ml.SHA256:
            data = (replace or {}).get(name)
            z.writestr(f"ml-100k/{name}", data if data is not None
                       else (directory / name).read_bytes())
    return dest.as_uri()


@pytest.fixture
def no_local_copy(monkeypatch):
    """Hide $EMBCORE_ML100K and the shared copy, as on a user's machine."""
    monkeypatch.setattr(ml, "local_copy", lambda: None)


@requires_data
def test_default_data_is_the_local_copy_before_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBCORE_ML100K", str(ML100K))
    got = ml.load_movielens(None, tmp_path / "empty-cache", url="http://127.0.0.1:9/none",
                            log=lambda _: None)
    assert not got.synthetic and len(got.ratings) == ml.NUM_RATINGS
    assert not (tmp_path / "empty-cache").exists()  # no download attempted


@requires_data
def test_download_verifies_and_unpacks_into_cache(tmp_path, no_local_copy):
    url = _zip_of(ML100K, tmp_path / "ml-100k.zip")
    cache = tmp_path / "cache" / "ml-100k"
    got = ml.load_movielens(None, cache, url=url, log=lambda _: None)
    assert not got.synthetic and len(got.ratings) == ml.NUM_RATINGS
    assert sorted(p.name for p in cache.iterdir()) == sorted(ml.SHA256)
    # Next time the cache is read; no download.
    assert not ml.load_movielens(None, cache, url="http://127.0.0.1:9/none", log=print).synthetic


@requires_data
def test_download_with_bad_checksum_falls_back_to_synthetic(tmp_path, no_local_copy):
    url = _zip_of(ML100K, tmp_path / "ml-100k.zip", replace={"u.data": b"1\t1\t5\t0\n"})
    cache = tmp_path / "cache"
    with pytest.raises(ml.DownloadError, match="u.data has sha256"):
        ml.download(cache, url)
    assert not cache.exists()  # nothing half-unpacked
    said = []
    assert ml.load_movielens(None, cache, url=url, log=said.append).synthetic
    assert "synthetic" in said[-1] and "\n" not in said[-1]


def test_no_network_falls_back_in_one_line(tmp_path, no_local_copy):
    said = []
    got = ml.load_movielens(None, tmp_path, url="http://127.0.0.1:9/ml-100k.zip", timeout=2,
                            log=said.append)  # port 9 (discard) is closed: refused at once
    assert got.synthetic and len(got.ratings) == ml.NUM_RATINGS
    assert said[-1].startswith("download failed") and "synthetic" in said[-1]


def test_not_a_zip_is_a_download_error(tmp_path):
    junk = tmp_path / "junk.zip"
    junk.write_bytes(b"<html>not found</html>")
    with pytest.raises(ml.DownloadError, match="not a zip"):
        ml.download(tmp_path / "cache", junk.as_uri())


# --------------------------------------------------------------------------------- errors
GOOD = "1\t10\t4\t881250949\n2\t20\t5\t881250950\n"


@pytest.mark.parametrize("line, message", [
    ("3\t30\t4\n", "u.data:3: expected 4 tab-separated fields"),
    ("3\t30\tfour\t881250949\n", "u.data:3: rating must be an integer, got 'four'"),
    ("3\t30\t7\t881250949\n", r"u.data:3: rating must be in \[1, 5\], got 7"),
    ("0\t30\t4\t881250949\n", "u.data:3: user id must be >= 1, got 0"),
    ("3\t-1\t4\t881250949\n", "u.data:3: item id must be >= 1, got -1"),
])
def test_malformed_ratings_name_file_and_line(tmp_path, line, message):
    (tmp_path / "u.data").write_text(GOOD + line)
    with pytest.raises(ml.DataError, match=message):
        ml.read_directory(tmp_path)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(ml.DataError, match="no u.data here"):
        ml.read_directory(tmp_path)
    (tmp_path / "u.data").write_text("\n")
    with pytest.raises(ml.DataError, match="no ratings"):
        ml.read_directory(tmp_path)


def test_malformed_optional_files(tmp_path):
    (tmp_path / "u.data").write_text(GOOD)
    (tmp_path / "u.item").write_text("10|Some Movie (1995)|01-Jan-1995\nabc|Broken\n")
    with pytest.raises(ml.DataError, match=r"u.item:2: movie id must be an integer"):
        ml.read_directory(tmp_path)
    (tmp_path / "u.item").unlink()
    (tmp_path / "u.user").write_text("1|24|M\n")
    with pytest.raises(ml.DataError, match="u.user:1: expected 5 '|'-separated fields"):
        ml.read_directory(tmp_path)


def test_split_errors(tmp_path):
    (tmp_path / "u.data").write_text(GOOD)
    small = ml.read_directory(tmp_path)
    with pytest.raises(ValueError, match="unknown split 'u9'"):
        ml.split(small, "u9")
    (tmp_path / "u1.base").write_text(GOOD)
    with pytest.raises(ml.DataError, match="u1.test: not found"):
        ml.split(small, "u1")


def test_cli_reports_bad_file_in_one_line(tmp_path, capsys):
    import train  # examples/movielens/train.py
    (tmp_path / "u.data").write_text(GOOD + "2\t20\n")
    assert train.cli(["--data", str(tmp_path), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err == f"error: {tmp_path / 'u.data'}:3: expected 4 tab-separated fields (user id, " \
                  f"item id, rating, timestamp), got 2: '2\\t20'\n"


def test_embcore_ml100k_naming_a_missing_folder_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBCORE_ML100K", str(tmp_path / "no-such-folder"))
    with pytest.raises(ml.DataError, match="EMBCORE_ML100K"):
        ml.load_movielens(cache_dir=tmp_path / "cache")
