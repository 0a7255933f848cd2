"""The Criteo example's data path: the TSV reader, the synthetic generator and the metrics."""

import dataclasses
import gzip
import hashlib
import itertools
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles import examples

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))  # the criteo package
from criteo import data  # noqa: E402
from criteo.data import (  # noqa: E402
    MAX_ID,
    MISSING_ID,
    DataError,
    ReadStats,
    count_distinct,
    count_lines,
    detect_labeled,
    has_labels,
    read_all,
    read_batches,
)
from criteo.generate import KAGGLE_CARDINALITIES, generate, scaled_cardinalities  # noqa: E402
from criteo.metrics import log_loss, roc_auc  # noqa: E402


def line(label="0", dense=None, cats=None) -> str:
    dense = [str(i) for i in range(13)] if dense is None else dense
    cats = [f"{j:08x}" for j in range(26)] if cats is None else cats
    return "\t".join(([label] if label is not None else []) + dense + cats) + "\n"


def write(tmp_path, *lines, name="f.txt") -> Path:
    path = tmp_path / name
    path.write_text("".join(lines))
    return path


def test_fields_are_parsed_and_transformed(tmp_path):
    dense = ["", "-3", "0", "1", "12"] + ["7"] * 8
    cats = ["", "68fd1e64", "FFFFFFFF"] + ["0000000a"] * 23
    path = write(tmp_path, line("1", dense, cats), line("0"))
    b = read_all(path)
    assert b.dense.dtype == np.float32 and b.dense.shape == (2, 13)
    assert b.sparse.dtype == np.int64 and b.sparse.shape == (2, 26)
    assert b.label.tolist() == [1.0, 0.0]
    # missing -> 0, negative -> log(1 + 0) = 0, else log(1 + x)
    np.testing.assert_allclose(b.dense[0, :5], [0, 0, 0, math.log(2), math.log(13)], rtol=1e-6)
    assert b.sparse[0, :4].tolist() == [MISSING_ID, 0x68FD1E64, 0xFFFFFFFF, 10]
    assert b.sparse[1].tolist() == list(range(26))


def test_hash_buckets_take_the_id_modulo_the_size_and_missing_as_zero(tmp_path):
    cats = ["", "68fd1e64"] + ["000003e9"] * 24
    path = write(tmp_path, line("1", None, cats))
    assert read_all(path, hash_buckets=1000).sparse[0, :3].tolist() == [0, 0x68FD1E64 % 1000, 1]
    sizes = list(range(7, 33))
    got = read_all(path, hash_buckets=sizes).sparse[0]
    assert got.tolist() == [0, 0x68FD1E64 % 8] + [1001 % s for s in sizes[2:]]
    with pytest.raises(ValueError, match="26"):
        read_all(path, hash_buckets=[3, 4])


@pytest.mark.parametrize("bad, message", [
    (line("2"), "label '2' is not 0 or 1"),
    (line("0", ["1.5"] + ["0"] * 12), "count I1 '1.5' is not an integer"),
    (line("0", ["0"] * 12 + ["x"]), "count I13 'x' is not an integer"),
    (line("0", None, ["zz"] + ["0"] * 25), "category C1 'zz' is not 1 to 16 hex digits"),
    (line("0", None, ["0"] * 25 + ["12345678901234567"]), "category C26"),
    (line("0", None, ["0"] * 25 + ["ffffffffffffffff"]),
     "category C26 'ffffffffffffffff' is above 7fffffffffffffff"),
    (line("0", None, ["8000000000000000"] + ["0"] * 25),
     "category C1 '8000000000000000' is above 7fffffffffffffff"),
    ("0\t1\t2\n", "3 tab-separated fields, expected 40"),
])
def test_a_bad_line_names_the_file_and_line(tmp_path, bad, message):
    path = write(tmp_path, line(), line(), bad, line())
    with pytest.raises(DataError, match=f"f.txt:3: {message}"):
        read_all(path)
    stats = ReadStats()
    b = read_all(path, skip_bad=True, stats=stats)
    assert len(b.label) == 3 and stats.skipped == 1 and stats.lines == 4
    assert "f.txt:3" in stats.examples_of_bad[0]


@pytest.mark.parametrize("parser", ["fast", "reference"])
def test_no_category_reads_as_the_missing_id(tmp_path, parser):
    # Ids are 0 ... MAX_ID = 2**63 - 1 (16 hex digits at most, the first of 16 at most 7), so
    # MISSING_ID = -1 is no category's id; 2**63 and above (-1 and -2**63 as 64-bit two's
    # complements) are bad lines, not ids.
    cats = ["", "ffffffff", "FFFFFFFF", "7fffffffffffffff", "7FFFFFFFFFFFFFFF", "0" * 16,
            "0fffffffffffffff", "0", "00000000", "68fd1e64"] + [""] * 16
    path = write(tmp_path, line("1", None, cats))
    got = read_all(path, parser=parser).sparse[0].tolist()
    assert got[:10] == [MISSING_ID, 2**32 - 1, 2**32 - 1, MAX_ID, MAX_ID, 0, 2**60 - 1, 0, 0,
                        0x68FD1E64]
    assert MAX_ID == 2**63 - 1 and got[10:] == [MISSING_ID] * 16
    assert read_all(path, parser=parser, hash_buckets=1000).sparse[0, :4].tolist() == \
        [0, (2**32 - 1) % 1000, (2**32 - 1) % 1000, MAX_ID % 1000]
    for big in ("ffffffffffffffff", "FFFFFFFFFFFFFFFF", "8000000000000000", "9" + "0" * 15,
                "a000000000000000"):
        bad = write(tmp_path, line(), line("0", None, ["1"] * 5 + [big] + [""] * 20),
                    name="b.txt")
        with pytest.raises(DataError, match=f"b.txt:2: category C6 '{big}' is above "
                                            f"7fffffffffffffff"):
            read_all(bad, parser=parser)
        stats = ReadStats()
        b = read_all(bad, parser=parser, skip_bad=True, stats=stats)
        assert stats.skipped == 1 and len(b.label) == 1 and (b.sparse >= 0).all()


def test_unlabeled_files_are_detected_or_declared(tmp_path):
    path = write(tmp_path, line(None), line(None))
    assert detect_labeled(path) is False
    b = read_all(path)
    assert b.label is None and b.dense.shape == (2, 13)
    with pytest.raises(DataError, match="f.txt:1: 39 tab-separated fields, expected 40"):
        read_all(path, labeled=True)
    mixed = write(tmp_path, line(None), line("1"), name="m.txt")
    with pytest.raises(DataError, match="m.txt:2: 40 tab-separated fields, expected 39"):
        read_all(mixed)


def test_batches_holdout_limit_resume_and_gzip(tmp_path):
    lines = [line(str(i % 2), [str(i)] * 13) for i in range(1, 11)]
    path = write(tmp_path, *lines)

    def first_counts(**kw):
        return [round(math.expm1(float(x))) for b in read_batches(path, 3, **kw)
                for x in b.dense[:, 0]]

    assert [len(b.label) for b in read_batches(path, 4)] == [4, 4, 2]
    assert first_counts(part="test", holdout_every=3) == [3, 6, 9]
    assert first_counts(part="train", holdout_every=3) == [1, 2, 4, 5, 7, 8, 10]
    assert first_counts(limit=4) == [1, 2, 3, 4]
    stats = ReadStats()
    it = read_batches(path, 3, stats=stats, part="train", holdout_every=3)
    next(it)
    assert first_counts(part="train", holdout_every=3, start_after=stats.lines) == [5, 7, 8, 10]
    gz = tmp_path / "f.txt.gz"
    gz.write_bytes(gzip.compress("".join(lines).encode()))
    assert np.array_equal(read_all(gz).dense, read_all(path).dense)
    with pytest.raises(ValueError, match="holdout_every"):
        list(read_batches(path, 3, part="test"))


def test_count_distinct(tmp_path):
    path = write(tmp_path, line(), line(), line("0", None, [""] * 26))
    assert count_distinct(path).tolist() == [2] * 26


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def test_generator_is_deterministic_format_valid_and_reports_the_best_auc(tmp_path, capsys):
    a = generate(tmp_path / "a", train_lines=3000, test_lines=1000, scale=1e-4, seed=3)
    b = generate(tmp_path / "b", train_lines=3000, test_lines=1000, scale=1e-4, seed=3)
    c = generate(tmp_path / "c", train_lines=3000, test_lines=1000, scale=1e-4, seed=4)
    for name in ("train.txt", "test.txt", "synthetic.json"):
        assert _md5(tmp_path / "a" / name) == _md5(tmp_path / "b" / name)
    assert _md5(tmp_path / "a" / "train.txt") != _md5(tmp_path / "c" / "train.txt")
    assert a == b and a != c and a["synthetic"] and "SYNTHETIC" in a["note"]
    assert 0.6 < a["best_test_auc"] < 1 and 0 < a["best_test_logloss"] < math.log(2)
    assert 0.15 < a["train_ctr"] < 0.35
    text = (tmp_path / "a" / "train.txt").read_text()
    assert all(s.count("\t") == 39 for s in text.splitlines())
    assert "\t\t" in text  # some empty fields
    train = read_all(tmp_path / "a" / "train.txt")  # format-valid: the reader takes every line
    assert len(train.label) == 3000 and set(np.unique(train.label)) == {0.0, 1.0}
    cards = scaled_cardinalities(1e-4)
    assert len(KAGGLE_CARDINALITIES) == 26 and a["cardinalities"] == list(cards)
    for j in range(26):
        present = train.sparse[:, j][train.sparse[:, j] != MISSING_ID]
        assert 0 < np.unique(present).size <= cards[j]
    from criteo import generate as gen  # the command line says it is synthetic
    gen.main(["--out", str(tmp_path / "d"), "--train-lines", "200", "--test-lines", "100",
              "--scale", "1e-5"])
    printed = capsys.readouterr().out
    assert "SYNTHETIC DATA" in printed and "best achievable test AUC" in printed


# --------------------------------------------------------------------------------- metrics
def brute_force_auc(y, s) -> float:
    pos = [si for yi, si in zip(y, s) if yi == 1]
    neg = [si for yi, si in zip(y, s) if yi == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


@settings(max_examples=examples(150), deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(-3, 3)), min_size=2, max_size=60))
def test_auc_equals_the_pairwise_definition_with_ties(pairs):
    y = [p[0] for p in pairs]
    s = [p[1] / 2 for p in pairs]  # few distinct scores: many ties
    if len(set(y)) < 2:
        with pytest.raises(ValueError, match="one class"):
            roc_auc(y, s)
        return
    assert roc_auc(y, s) == pytest.approx(brute_force_auc(y, s), abs=1e-12)


@settings(max_examples=examples(50), deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.floats(0.0, 1.0)), min_size=1, max_size=40))
def test_log_loss_matches_the_definition(pairs):
    y = [p[0] for p in pairs]
    p = [min(max(q[1], 1e-7), 1 - 1e-7) for q in pairs]
    want = -sum(math.log(pi) if yi else math.log(1 - pi) for yi, pi in zip(y, p)) / len(y)
    assert log_loss(y, p) == pytest.approx(want, rel=1e-9)


def test_auc_examples_and_errors():
    assert roc_auc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]) == 0.75
    assert roc_auc([0, 1, 0, 1], [1, 1, 1, 1]) == 0.5
    assert roc_auc([1, 0], [0.9, 0.1]) == 1.0
    with pytest.raises(ValueError, match="undefined with one class only"):
        roc_auc([1, 1], [0.2, 0.3])
    with pytest.raises(ValueError, match="0 or 1"):
        roc_auc([0, 2], [0.2, 0.3])
    with pytest.raises(ValueError, match="length"):
        roc_auc([0, 1], [0.2])


# --------------------------------------------------------------------------------- fast parser
def _trace(path, parser, **kw):
    """Everything a read shows: each batch with the stats at its yield, then the error or the
    final stats."""
    stats = ReadStats()
    seen = []
    try:
        for b in read_batches(path, stats=stats, parser=parser, **kw):
            seen.append((b.dense.dtype, b.sparse.dtype, b.dense.tolist(), b.sparse.tolist(),
                         None if b.label is None else (b.label.dtype, b.label.tolist()),
                         dataclasses.astuple(stats)))
    except DataError as e:
        seen.append(("error", str(e), dataclasses.astuple(stats)))
    seen.append(("end", dataclasses.astuple(stats)))
    return seen


def _same_as_reference(path, block_bytes=None, **kw):
    old = data._BLOCK_BYTES
    data._BLOCK_BYTES = block_bytes or old
    try:
        fast = _trace(path, "fast", **kw)
    finally:
        data._BLOCK_BYTES = old
    assert fast == _trace(path, "reference", **kw)
    return fast


_count = st.one_of(  # well formed
    st.just(""), st.integers(-3, 30).map(str), st.integers(0, 10**9).map(str),
    st.integers(15, 19).flatmap(lambda n: st.integers(10 ** (n - 1), 10**n - 1)).map(str),
    st.integers(-(10**16), -1).map(str), st.sampled_from(["-0", "007", "65535", "65536"]))
_category = st.one_of(  # well formed
    st.just(""), st.integers(0, 2**32 - 1).map(lambda v: f"{v:08x}"),
    st.integers(0, 2**63 - 1).map(lambda v: f"{v:x}"),
    st.integers(0, 2**63 - 1).map(lambda v: f"{v:X}"), st.integers(0, 15).map(lambda v: f"{v:x}"),
    st.integers(0, 2**63 - 1).map(lambda v: f"{v:016x}"),
    st.sampled_from(["0" * 16, "aBcD", "7fffffffffffffff", "7FFFFFFFFFFFFFFF"]))
_odd_count = st.sampled_from([  # some parse (as the reference says), most do not
    "+5", " 5", "5 ", "1_0", "x", "-", "--1", "-1-", "1-2", "0x1f", "1e3", "a1", "1a", "-a", "1-",
    "F", "\xe9", "\xa01", "9" * 17, "-" + "9" * 17, "1" * 30, "5\r"])
_odd_category = st.one_of(
    st.sampled_from(["zz", "-1", "1-", "g", "12345678901234567", "0" * 17, " a", "a ", "+1",
                     "\xe9", "a\r", "8000000000000000", "ffffffffffffffff", "F" * 16]),
    st.integers(2**63, 2**64 - 1).map(lambda v: f"{v:x}"))  # above MAX_ID


@st.composite
def _lines(draw, labeled: bool) -> str:
    """A well-formed line (empty fields, negative and long counts included), or one with a
    single oddity: a strange field, a wrong field count, an empty line, other line ends."""
    fields = ([draw(st.sampled_from(["0", "1"]))] if labeled else []) \
        + [draw(_count) for _ in range(13)] + [draw(_category) for _ in range(26)]
    kind = draw(st.integers(0, 11))
    off = int(labeled)
    if kind == 0 and labeled:
        fields[0] = draw(st.sampled_from(["2", "", "01", "-1", "1 ", "x", "-"]))
    elif kind == 1:
        fields[off + draw(st.integers(0, 12))] = draw(_odd_count)
    elif kind == 2:
        fields[off + 13 + draw(st.integers(0, 25))] = draw(_odd_category)
    elif kind == 3:
        del fields[draw(st.integers(0, len(fields) - 1)):]
    elif kind == 4:
        fields.insert(draw(st.integers(0, len(fields))), draw(_count))
    end = draw(st.sampled_from(["\n"] * 8 + ["\r\n", "\r\r\n", "\r"]))
    return "\t".join(fields) + end if kind != 5 else end


@settings(max_examples=examples(200), deadline=None)
@given(st.data())
def test_the_fast_parser_equals_the_reference_on_random_lines(tmp_path_factory, data_):
    labeled = data_.draw(st.booleans())
    lines = data_.draw(st.lists(_lines(labeled), max_size=30))
    text = "".join(lines)
    if text and data_.draw(st.booleans()):
        text = text.rstrip("\n")  # no newline at the end
    path = tmp_path_factory.mktemp("f") / "f.txt"
    path.write_bytes(text.encode("latin-1"))
    part = data_.draw(st.sampled_from(["all", "train", "test"]))
    kw = {"batch_size": data_.draw(st.integers(1, 7)), "labeled": labeled,
          "skip_bad": data_.draw(st.booleans()),
          "limit": data_.draw(st.none() | st.integers(1, 40)),
          "start_after": data_.draw(st.integers(0, 8)), "part": part,
          "holdout_every": data_.draw(st.integers(2, 5)) if part != "all" else 0,
          "hash_buckets": data_.draw(st.none() | st.integers(1, 1000))}
    world = data_.draw(st.integers(1, 3))
    if world > 1:
        kw["share"] = (data_.draw(st.integers(0, world - 1)), world)
    _same_as_reference(path, block_bytes=data_.draw(st.sampled_from([1, 50, 300, 1 << 22])),
                       **kw)


@settings(max_examples=examples(50), deadline=None)
@given(st.data())
def test_the_fast_parser_equals_the_reference_on_long_categories(tmp_path_factory, data_):
    # 16 hex digits around MAX_ID: up to 7fffffffffffffff an id, from 8000000000000000 a bad line
    category = st.one_of(st.just(""), st.integers(0, 2**32 - 1).map(lambda v: f"{v:08x}"),
                         st.integers(2**63 - 2**8, 2**63 + 2**8).map(lambda v: f"{v:016x}"),
                         st.integers(0, 2**64 - 1).map(lambda v: f"{v:016X}"))
    rows = data_.draw(st.lists(st.lists(category, min_size=26, max_size=26), min_size=1,
                               max_size=6))
    path = tmp_path_factory.mktemp("l") / "l.txt"
    path.write_text("".join(line("1", None, cats) for cats in rows))
    _same_as_reference(path, batch_size=data_.draw(st.integers(1, 4)), labeled=True,
                       skip_bad=data_.draw(st.booleans()))
    good = [cats for cats in rows if all(not c or int(c, 16) <= MAX_ID for c in cats)]
    assert read_all(path, labeled=True, skip_bad=True).sparse.tolist() == \
        [[int(c, 16) if c else MISSING_ID for c in cats] for cats in good]


def test_the_fast_parser_equals_the_reference_on_the_files_above(tmp_path):
    cats = ["", "68fd1e64", "FFFFFFFF", "7fffffffffffffff", "0" * 16, "1"] + ["a"] * 20
    dense = ["", "-3", "0", "1", "12", "65535", "65536", "9999999999999999", "-0", "007"] \
        + ["123456789"] * 3
    good = line("1", dense, cats)
    bads = [line("2"), line("0", ["1.5"] + ["0"] * 12), line("0", None, ["zz"] + ["0"] * 25),
            line("0", None, ["0"] * 25 + ["12345678901234567"]), "0\t1\t2\n", "\n",
            line("0", None, ["ffffffffffffffff"] + ["0"] * 25),
            line("0", None, ["0"] * 25 + ["8000000000000000"]),
            line("0", ["+5"] + ["0"] * 12), line("0", [" 5"] + ["0"] * 12),
            line("0", ["9" * 30] + ["0"] * 12), line("0", ["9" * 17] + ["0"] * 12),
            line("0", ["-"] + ["0"] * 12), line("0", ["-1-"] + ["0"] * 12),
            line("0", ["1-2"] + ["0"] * 12), line("0", None, ["-1"] + ["0"] * 25), line("-"),
            line(None)]
    path = write(tmp_path, good, *bads, good.replace("\n", "\r\n"), line("0"), good)
    for kw in ({}, {"skip_bad": True}, {"skip_bad": True, "hash_buckets": 97},
               {"skip_bad": True, "part": "test", "holdout_every": 3},
               {"skip_bad": True, "share": (1, 2)}, {"skip_bad": True, "start_after": 5}):
        for batch_size in (1, 2, 5, 64):
            _same_as_reference(path, batch_size=batch_size, **kw)
    gz = tmp_path / "g.txt.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    _same_as_reference(gz, batch_size=3, skip_bad=True)
    unlabeled = write(tmp_path, line(None, ["-3"] + ["4"] * 12), line(None, ["-"] + ["4"] * 12),
                      line(None, ["3-"] + ["4"] * 12), line(None, None, ["-2"] * 26),
                      line(None, ["-3"] * 13, [""] * 26), name="u.txt")
    _same_as_reference(unlabeled, batch_size=2, skip_bad=True)


def test_the_fast_parser_equals_the_reference_on_generated_data(tmp_path):
    generate(tmp_path, train_lines=3000, test_lines=10, scale=1e-3, seed=5)
    for kw in ({}, {"part": "train", "holdout_every": 7, "start_after": 100},
               {"share": (0, 2), "hash_buckets": 1000}, {"share": (2, 3), "limit": 2500}):
        trace = _same_as_reference(tmp_path / "train.txt", batch_size=256, block_bytes=10_000,
                                   **kw)
        assert len(trace) > 5


# The fast parser hands the lines its checks cannot vouch for to the reference parser
# (``parse_line``): on those lines "fast equals reference" holds by construction. The tests below
# see through that: the fast parser's own conversions (the lines it did not hand over) against the
# reference and against the format as documented (``_documented``, written apart from both
# parsers), every bad line's outcome against the documented one, and nothing handed over but bad
# lines and the rare forms the parser documents.
_COUNT_FORM = re.compile(r"[+-]?([0-9]+)\Z")
_CATEGORY_FORM = re.compile(r"[0-9a-fA-F]{1,16}\Z")


def _documented(text: str, labeled: bool):
    """What the format (examples/criteo/data.py's docstring) says of one line, ``text`` without
    its newline: ``("bad", what the error names)``, or ``("good", (dense, sparse, label),
    plain)``; ``plain``: in none of the rare forms the fast parser may hand over (a '+' sign, a
    count of more than 16 digits, more than one '\\r' at the end)."""
    body, ends = text, 0
    while body.endswith("\r"):
        body, ends = body[:-1], ends + 1
    fields = body.split("\t")
    if len(fields) != (40 if labeled else 39):
        return "bad", "tab-separated fields"
    label = None
    if labeled:
        if fields[0] not in ("0", "1"):
            return "bad", "label"
        label, fields = float(fields[0]), fields[1:]
    plain = ends <= 1
    dense = []
    for i, x in enumerate(fields[:13]):
        form = _COUNT_FORM.match(x)
        if x and form is None:
            return "bad", f"count I{i + 1}"
        plain = plain and not x.startswith("+") and (not x or len(form.group(1)) <= 16)
        v = int(x) if x else 0
        dense.append(float(np.float32(math.log1p(v))) if v > 0 else 0.0)
    sparse = []
    for j, c in enumerate(fields[13:]):
        if c and (not _CATEGORY_FORM.match(c) or int(c, 16) > MAX_ID):
            return "bad", f"category C{j + 1}"
        sparse.append(int(c, 16) if c else MISSING_ID)
    return "good", (dense, sparse, label), plain


def _values(dense, sparse, label) -> tuple:
    return dense.tolist(), sparse.tolist(), None if math.isnan(label) else float(label)


def _fast_parser_alone(path, labeled: bool):
    """Every line of ``path`` through the fast parser's blocks: ``(own, handed_over, bad)``,
    the values of the lines it converted itself by line number, the numbers of the lines it
    handed to the reference parser, and the bad lines' messages by number."""
    own, handed, bad = {}, set(), {}
    for block in data._fast_blocks(path, labeled, None, 0, "all", 0):
        handed.update(block.handed_over.tolist())
        bad.update(block.bad)
        mine = np.flatnonzero(~np.isin(block.good, block.handed_over))
        if len(mine):
            dense, sparse, label = block.rows(mine)
            for k, i in enumerate(mine.tolist()):
                own[int(block.good[i])] = _values(dense[k], sparse[k], label[k])
    return own, handed, bad


def _check_the_fast_parser_alone(path, labeled: bool, block_bytes=None) -> int:
    """The checks above on every line of ``path``; returns how many lines the fast parser
    converted itself."""
    old = data._BLOCK_BYTES
    data._BLOCK_BYTES = block_bytes or old
    try:
        own, handed, bad = _fast_parser_alone(path, labeled)
    finally:
        data._BLOCK_BYTES = old
    raw = Path(path).read_bytes()
    texts = (gzip.decompress(raw) if str(path).endswith(".gz") else raw).decode("latin-1")
    texts = texts.split("\n")
    if texts[-1] == "":  # (the last line's newline, or an empty file)
        texts.pop()
    assert not set(own) & handed
    assert set(own) | handed | set(bad) == set(range(1, len(texts) + 1))
    for number, text in enumerate(texts, 1):
        verdict = _documented(text, labeled)
        if verdict[0] == "bad":  # an error naming the documented field, whoever found it
            assert number not in own and verdict[1] in bad.get(number, ""), (number, text)
            continue
        _, want, plain = verdict
        dense, sparse = np.zeros(13, np.float32), np.zeros(26, np.int64)
        reference = _values(dense, sparse, data.parse_line(text, labeled, dense, sparse))
        assert reference == want, (number, text)  # (the specification agrees with the docs)
        if plain:  # a common line: the fast parser converts it itself
            assert number not in handed, f"line {number} handed over: {text!r}"
        if number in own:
            assert own[number] == want, (number, text)
    return len(own)


@settings(max_examples=examples(200), deadline=None)
@given(st.data())
def test_the_fast_parsers_own_conversions_on_random_lines(tmp_path_factory, data_):
    labeled = data_.draw(st.booleans())
    text = "".join(data_.draw(st.lists(_lines(labeled), max_size=30)))
    if text and data_.draw(st.booleans()):
        text = text.rstrip("\n")  # no newline at the end
    path = tmp_path_factory.mktemp("o") / "o.txt"
    path.write_bytes(text.encode("latin-1"))
    _check_the_fast_parser_alone(path, labeled,
                                 data_.draw(st.sampled_from([1, 50, 300, 1 << 22])))


def test_the_fast_parsers_own_conversions_on_the_files_above(tmp_path):
    dense = ["", "-3", "0", "1", "12", "65535", "65536", "9999999999999999", "-0", "007"] \
        + ["-9999999999999999", "123456789", "1234567890123"]
    cats = ["", "68fd1e64", "FFFFFFFF", "7fffffffffffffff", "0" * 16, "1"] + ["aBc"] * 20
    good = [line("1", dense, cats), line("0"), line("1", [""] * 13, [""] * 26),
            line("0", dense, cats).replace("\n", "\r\n")]
    rare = [line("0", ["+5"] + ["0"] * 12), line("0", ["9" * 17] + ["0"] * 12),
            line("1").replace("\n", "\r\r\n")]
    bads = [line("2"), line("0", ["1.5"] + ["0"] * 12), line("0", None, ["zz"] + ["0"] * 25),
            line("0", None, ["0"] * 25 + ["12345678901234567"]), "0\t1\t2\n", "\n",
            line("0", None, ["8000000000000000"] + ["0"] * 25), line("0", [" 5"] + ["0"] * 12),
            line("0", ["-"] + ["0"] * 12), line("0", ["1-2"] + ["0"] * 12), line(None)]
    path = write(tmp_path, *good, *rare, *bads, *good)
    assert _check_the_fast_parser_alone(path, True) == 2 * len(good)
    unlabeled = write(tmp_path, line(None, ["-3"] * 13), line(None, ["3-"] + ["4"] * 12),
                      line(None, None, ["-2"] * 26), line(None, ["-3"] * 13, [""] * 26),
                      name="u.txt")
    assert _check_the_fast_parser_alone(unlabeled, False) == 2


def test_the_fast_parser_converts_all_of_generated_data_itself(tmp_path):
    generate(tmp_path, train_lines=2000, test_lines=10, scale=1e-3, seed=5)
    for name, lines in (("train.txt", 2000), ("test.txt", 10)):
        own, handed, bad = _fast_parser_alone(tmp_path / name, True)
        assert not handed and not bad and len(own) == lines
    assert _check_the_fast_parser_alone(tmp_path / "train.txt", True, block_bytes=10_000) == 2000


def test_shares_are_the_slices_of_the_whole_batches(tmp_path):
    generate(tmp_path, train_lines=1000, test_lines=10, scale=1e-3, seed=6)
    path = tmp_path / "train.txt"
    whole = list(read_batches(path, 96, part="train", holdout_every=7))
    for rank in range(3):
        stats = ReadStats()
        mine = list(read_batches(path, 96, part="train", holdout_every=7, share=(rank, 3),
                                 stats=stats))
        assert len(mine) == len(whole) and stats.examples == sum(len(b.label) for b in whole)
        for m, w in zip(mine, whole):
            assert np.array_equal(m.sparse, w.sparse[rank::3])
            assert np.array_equal(m.dense, w.dense[rank::3])
            assert np.array_equal(m.label, w.label[rank::3])
    with pytest.raises(ValueError, match="share"):
        list(read_batches(path, 96, share=(3, 3)))


# --------------------------------------------------------------------------------- gzip damage
def _damaged(raw: bytes, how: str) -> bytes:
    """A gzip file's bytes, damaged."""
    if how == "truncated":
        return raw[:len(raw) // 2]
    if how == "no trailer":  # the data whole, its CRC and length cut off
        return raw[:-8]
    if how == "corrupt":  # deflate data overwritten
        return raw[:40] + bytes(b ^ 0xFF for b in raw[40:100]) + raw[100:]
    if how == "bad crc":
        return raw[:-8] + bytes([raw[-8] ^ 1]) + raw[-7:]
    assert how == "not gzip"
    return gzip.decompress(raw)


@pytest.mark.parametrize("parser", ["fast", "reference"])
@pytest.mark.parametrize("how", ["truncated", "no trailer", "corrupt", "bad crc", "not gzip"])
def test_a_damaged_gzip_file_raises_a_data_error_naming_it(tmp_path, how, parser):
    lines = [line(str(i % 2), [str(i)] * 13) for i in range(400)]
    text = "".join(lines).encode()
    path = tmp_path / "d.txt.gz"
    path.write_bytes(_damaged(gzip.compress(text, mtime=0), how))
    whole = read_all(write(tmp_path, *lines))
    for skip_bad in (False, True):
        got = []
        with pytest.raises(DataError, match=r"d.txt.gz: not a readable gzip file, or a truncated "
                                            r"or corrupt one: reading stopped (after line \d+|"
                                            r"before its first line) \((EOFError|zlib.error|"
                                            r"gzip.BadGzipFile): ") as e:
            for b in read_batches(path, 64, labeled=True, skip_bad=skip_bad, parser=parser):
                got.append(b.dense)
        assert isinstance(e.value, ValueError)
        if got:  # what came before the damage is the file's beginning
            got = np.concatenate(got)
            assert np.array_equal(got, whole.dense[:len(got)])
    if how in ("corrupt", "not gzip"):  # the first line cannot be read: detection says so
        for detect in (detect_labeled, has_labels, read_all):
            with pytest.raises(DataError, match="d.txt.gz: .* before its first line"):
                detect(path)
    else:
        assert detect_labeled(path) is True and has_labels(path) is True


# --------------------------------------------------------------------------------- line counts
def test_count_lines_counts_what_the_reader_reads(tmp_path):
    path = write(tmp_path, *[line()] * 9, line().rstrip("\n"))  # the last without a newline
    assert count_lines(path) == (10, True)
    assert count_lines(path, limit=4) == (4, True) and count_lines(path, limit=99) == (10, True)
    assert count_lines(path, part="train", holdout_every=3) == (7, True)
    assert count_lines(path, part="test", holdout_every=3, limit=8) == (2, True)
    assert count_lines(write(tmp_path, name="e.txt")) == (0, True)
    assert count_lines(write(tmp_path, "\n", "\r\n", "\r", name="r.txt")) == (3, True)
    gz = tmp_path / "f.txt.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert count_lines(gz) is None
    big = write(tmp_path, *[line()] * 50, name="big.txt")
    old = data._COUNT_BYTES
    data._COUNT_BYTES = 2 * len(line())  # estimates from the first 2 lines' worth
    try:
        assert count_lines(big, exact_up_to=1000) == (50, False)
        assert count_lines(big, exact_up_to=1000, limit=30) == (30, False)
        assert count_lines(big, exact_up_to=1000, limit=1) == (1, True)  # found first
        assert count_lines(big, exact_up_to=10**6) == (50, True)
        assert count_lines(write(tmp_path, "x" * 5000, name="x.txt"), exact_up_to=1000) is None
    finally:
        data._COUNT_BYTES = old


@settings(max_examples=examples(40), deadline=None)
@given(st.data())
def test_count_lines_equals_the_lines_read_on_random_files(tmp_path_factory, data_):
    text = "".join(data_.draw(st.lists(_lines(True), max_size=12)))
    if text and data_.draw(st.booleans()):
        text = text.rstrip("\n")
    path = tmp_path_factory.mktemp("c") / "c.txt"
    path.write_bytes(text.encode("latin-1"))
    part = data_.draw(st.sampled_from(["all", "train", "test"]))
    kw = {"limit": data_.draw(st.none() | st.integers(1, 15)), "part": part,
          "holdout_every": data_.draw(st.integers(2, 4)) if part != "all" else 0}
    stats = ReadStats()
    read_all(path, labeled=True, skip_bad=True, stats=stats, **kw)
    assert count_lines(path, **kw) == (stats.examples + stats.skipped, True)
