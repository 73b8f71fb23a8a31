import json
import re
import sys

import numpy as np
import pytest

from client.streams import (FEATURE_COLUMNS, Stream, generate_stream, load_stream, save_stream,
                            stream_fingerprint)


def small_stream(num_requests=6, targets=False):
    rng = np.random.default_rng(1)
    return Stream(
        symbols=np.array([f"SYM_{i % 3:03d}" for i in range(num_requests)]),
        features=rng.standard_normal((num_requests, 79)).astype(np.float32),
        delay_ms=np.full(num_requests, 12.5, dtype=np.float32),
        targets=rng.standard_normal((num_requests, 4)).astype(np.float32) if targets else None,
        meta={"preset": "tiny", "weights_fingerprint": "abc"},
    )


def assert_same_stream(a, b):
    np.testing.assert_array_equal(a.symbols, b.symbols)
    np.testing.assert_array_equal(a.features, b.features)
    np.testing.assert_array_equal(a.delay_ms, b.delay_ms)
    if a.targets is None:
        assert b.targets is None
    else:
        np.testing.assert_array_equal(a.targets, b.targets)


# --- generation -----------------------------------------------------------------------------

def test_generate_is_deterministic_and_well_formed():
    a, b = generate_stream(7, 200, seed=3), generate_stream(7, 200, seed=3)
    assert_same_stream(a, b)
    assert a.features.dtype == np.float32 and a.features.shape == (200, 79)
    assert a.delay_ms.dtype == np.float32 and a.delay_ms.shape == (200,)
    assert a.targets is None
    assert set(a.symbols.tolist()) == {f"SYM_{i:03d}" for i in range(7)}
    assert not np.array_equal(generate_stream(7, 200, seed=4).features, a.features)


def test_generate_values_are_the_same_on_every_machine():
    # PCG64 draws pinned: a change here means streams (and their cached targets) differ across machines.
    stream = generate_stream(3, 4, seed=0)
    assert stream.symbols.tolist() == ["SYM_001", "SYM_002", "SYM_000", "SYM_000"]
    np.testing.assert_allclose(stream.features[0, :3], [-0.18548468, 1.2047737, 0.77745306], rtol=1e-6)
    np.testing.assert_allclose(stream.delay_ms, [7.637358, 34.041725, 14.410815, 6.214311], rtol=1e-6)
    assert stream_fingerprint(stream) == "3bdb96e3bba917581299c656b20855e7b6484dc4c350f372fe48596fbd2ffa81"


def test_every_symbol_appears_when_requests_suffice():
    stream = generate_stream(50, 50, seed=9)
    assert sorted(stream.symbols.tolist()) == [f"SYM_{i:03d}" for i in range(50)]
    assert len(generate_stream(50, 10, seed=9)) == 10


def test_symbol_names_widen_past_a_thousand_symbols():
    stream = generate_stream(1500, 1500, seed=0)
    assert "SYM_0000" in stream.symbols and "SYM_1499" in stream.symbols


def test_many_symbols_and_few_requests_name_only_the_symbols_drawn():
    # every one of the num_symbols names was made first: 10^8 symbols and 3 requests took 12 GB
    import tracemalloc

    tracemalloc.start()
    try:
        stream = generate_stream(2_000_000, 3, seed=0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(stream) == 3 and all(len(symbol) == len("SYM_0000000") for symbol in stream.symbols)
    assert peak < 40e6  # the permutation of 2e6 symbols (16 MB) and its copies; the names took 200 MB


def test_delay_mean_follows_the_rate():
    assert generate_stream(5, 20000, seed=2).delay_ms.mean() == pytest.approx(12.0, rel=0.05)
    assert generate_stream(5, 20000, seed=2, rate=400).delay_ms.mean() == pytest.approx(2.5, rel=0.05)
    assert (generate_stream(5, 1000, seed=2).delay_ms >= 0).all()


@pytest.mark.parametrize("args, message", [
    ((0, 10), "num_symbols"),
    ((3, 0), "num_requests"),
    ((2.5, 10), "num_symbols"),
    ((3, 10, -1.0), "rate"),
    ((3, 10, float("nan")), "rate"),
])
def test_generate_rejects_bad_arguments(args, message):
    num_symbols, num_requests, *rate = args
    with pytest.raises(ValueError, match=message):
        generate_stream(num_symbols, num_requests, seed=0, rate=rate[0] if rate else None)


# --- validation -----------------------------------------------------------------------------

def with_changes(**changes):
    stream = small_stream(targets=True)
    fields = dict(symbols=stream.symbols, features=stream.features, delay_ms=stream.delay_ms,
                  targets=stream.targets, meta=stream.meta)
    fields.update(changes)
    return fields


def nan_at(row, array, value=np.nan):
    array = array.copy()
    array[row, ...] = value
    return array


@pytest.mark.parametrize("make_fields, message", [
    (lambda s: with_changes(features=s.features[:, :78]), r"\[M, 79\].*wrong feature count"),
    (lambda s: with_changes(features=s.features[0]), "wrong feature count"),
    (lambda s: with_changes(features=nan_at(4, s.features)), "NaN or inf at row 4"),
    (lambda s: with_changes(features=nan_at(2, s.features, np.inf)), "NaN or inf at row 2, feature 0 "),
    (lambda s: with_changes(features=nan_at(3, s.features.T).T), r"NaN or inf at row 0, feature 3 \(6 bad rows\)"),
    (lambda s: with_changes(delay_ms=nan_at(3, s.delay_ms, -1.0)), "negative at row 3"),
    (lambda s: with_changes(delay_ms=nan_at(3, s.delay_ms, 1.7e12)), r"delay_ms at row 3 is 1.7e\+12 ms, over a day"),
    (lambda s: with_changes(delay_ms=nan_at(1, s.delay_ms)), "delay_ms is NaN or inf at row 1"),
    (lambda s: with_changes(delay_ms=s.delay_ms[:5]), "differ in length.*delay_ms 5"),
    (lambda s: with_changes(symbols=s.symbols[:4]), "differ in length.*symbols 4"),
    (lambda s: with_changes(targets=s.targets[:, :3]), r"targets must have shape \[M, 4\]"),
    (lambda s: with_changes(targets=nan_at(5, s.targets)), "targets contain NaN or inf at row 5"),
    (lambda s: with_changes(symbols=np.arange(6)), "symbols must be strings"),
    # as a parquet column's values come: the null, or the number, and its row named ("got dtype object" before)
    (lambda s: with_changes(symbols=np.array(["A", None] * 3, dtype=object)),
     r"symbols must be strings; row 1 holds None \(NoneType\)"),
    (lambda s: with_changes(symbols=np.array(["A", "B", "C", 7, "E", "F"], dtype=object)),
     r"symbols must be strings; row 3 holds 7 \(int\)"),
    # held as numpy str, "B\x00" would be played as "B": one state for two symbols (a parquet column, or a list)
    (lambda s: with_changes(symbols=np.array(["A", "B", "B\x00"] * 2, dtype=object)),
     r"symbol 'B\\x00' at row 2 ends in a NUL character, which a numpy string array drops: it would be played as 'B'"),
    (lambda s: with_changes(symbols=["A", "B", "C", "D", "E", "F\x00\x00"]), "row 5 ends in a NUL character"),
    # a numpy str array is as wide as its longest symbol on every row: one long name, gigabytes
    (lambda s: with_changes(symbols=np.array(["A", "B", "C", "D", "X" * 129, "F"], dtype=object)),
     r"symbol at row 4 is 129 characters long \('XXXXXXXXXXXXXXXXXXXX'...\); a symbol is a name of at most 128"),
    # UTF-8 (the fingerprint, the protocols) cannot hold it: the codec's message named neither the file nor the row
    (lambda s: with_changes(symbols=np.array(["A", "\ud800B"] * 3)),
     r"symbol '\\ud800B' at row 1 is not Unicode text \(UTF-8 cannot hold '\\ud800'\)"),
    (lambda s: with_changes(meta="preset=tiny"), "meta must be a dict"),
    (lambda s: with_changes(symbols=s.symbols[:0], features=s.features[:0], delay_ms=s.delay_ms[:0],
                            targets=s.targets[:0]), "the stream has no requests"),
    # cast to float32, these would lose an imaginary part, parse text, or read seconds as milliseconds
    (lambda s: with_changes(features=s.features + 1j), "features must be real numbers, got dtype complex"),
    (lambda s: with_changes(delay_ms=s.delay_ms.astype(str)), "delay_ms must be real numbers"),
    (lambda s: with_changes(delay_ms=s.delay_ms.astype("timedelta64[s]")), "delay_ms must be real numbers"),
    (lambda s: with_changes(targets=s.targets.astype(object)), "targets must be real numbers"),
    # float64 values past float32's range are finite in the file: told as such, not as the inf a cast would make
    (lambda s: with_changes(features=nan_at(2, s.features.astype(np.float64), 1e300)),
     r"features at row 2 exceed float32's range \(max \|value\| 1e\+300\)"),
    (lambda s: with_changes(targets=nan_at(4, s.targets.astype(np.float64), -1e39)),
     "targets at row 4 exceed float32's range"),
])
def test_bad_streams_are_rejected_naming_the_problem(make_fields, message):
    with pytest.raises(ValueError, match=message):
        Stream(**make_fields(small_stream(targets=True)))


def test_odd_symbols_are_kept_as_they_are(tmp_path):
    odd = ["", " ", "日本", "\U0001f642", "A\nB", "\x1b[2J", "7", "X" * 128]
    stream = Stream(odd, np.zeros((len(odd), 79), np.float32), np.zeros(len(odd), np.float32))
    save_stream(stream, tmp_path / "odd.npz")
    assert load_stream(tmp_path / "odd.npz").symbols.tolist() == odd


def test_a_nul_inside_a_symbol_is_kept_and_its_symbol_is_its_own():
    stream = Stream(["A\x00B", "AB", "A\x00B"], np.zeros((3, 79)), [1, 1, 1])
    assert stream.symbols.tolist() == ["A\x00B", "AB", "A\x00B"]


def test_stream_coerces_to_float32():
    stream = Stream(["A"], np.zeros((1, 79), dtype=np.float64), [3], None)
    assert stream.features.dtype == np.float32 and stream.delay_ms.dtype == np.float32


# --- fingerprint ----------------------------------------------------------------------------

def test_fingerprint_is_pinned():
    stream = Stream(["SYM_000", "SYM_001"], np.arange(158, dtype=np.float32).reshape(2, 79), [1.0, 2.5])
    assert stream_fingerprint(stream) == "022512595995647c5008b2e47e52e30023bbe67d28de44cf7282c1476a0d333d"


def test_fingerprint_covers_requests_but_not_targets_or_meta():
    base = small_stream()
    fingerprint = stream_fingerprint(base)
    assert stream_fingerprint(small_stream(targets=True)) == fingerprint
    assert stream_fingerprint(Stream(base.symbols, base.features, base.delay_ms, meta={"x": 1})) == fingerprint
    features = base.features.copy()
    features[2, 5] += 1e-3
    symbols = base.symbols.copy()
    symbols[1] = "SYM_009"
    delays = base.delay_ms.copy()
    delays[0] = 0.0
    changed = [Stream(base.symbols, features, base.delay_ms), Stream(symbols, base.features, base.delay_ms),
               Stream(base.symbols, base.features, delays), Stream(base.symbols[:5], base.features[:5],
                                                                   base.delay_ms[:5])]
    assert len({fingerprint, *map(stream_fingerprint, changed)}) == 5


# --- npz --------------------------------------------------------------------------------------

@pytest.mark.parametrize("targets", [False, True])
def test_npz_round_trip(tmp_path, targets):
    stream = small_stream(targets=targets)
    path = tmp_path / "sub" / "stream.npz"
    save_stream(stream, path)
    loaded = load_stream(path)
    assert_same_stream(stream, loaded)
    assert loaded.meta == dict(stream.meta, stream_fingerprint=stream_fingerprint(stream))
    assert [p.name for p in path.parent.iterdir()] == ["stream.npz"]  # no temporary left behind
    with np.load(path, allow_pickle=False) as archive:  # the native format's arrays, readable without pickle
        assert archive["symbols"].dtype.kind == "U"
        assert json.loads(str(archive["meta"]))["preset"] == "tiny"


def test_load_rejects_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found.*nothing.npz"):
        load_stream(tmp_path / "nothing.npz")


def test_load_rejects_an_unreadable_file(tmp_path):
    path = tmp_path / "garbage.npz"
    path.write_bytes(b"not a zip file")
    with pytest.raises(ValueError) as caught:
        load_stream(path)
    # not numpy's advice to load it with allow_pickle, which would run whatever the file holds
    assert str(caught.value) == (f"cannot read stream {path} as .npz: not a whole zip archive, which an .npz is "
                                 f"(it starts with b'not a zi')")


@pytest.mark.parametrize("name", ["stream.csv", "stream"])
def test_unknown_formats_are_rejected(tmp_path, name):
    with pytest.raises(ValueError, match="unknown stream format"):
        save_stream(small_stream(), tmp_path / name)
    with pytest.raises(ValueError, match="unknown stream format"):
        load_stream(tmp_path / name)


def test_load_rejects_missing_arrays(tmp_path):
    path = tmp_path / "partial.npz"
    np.savez(path, symbols=np.array(["A"]), features=np.zeros((1, 79), np.float32))
    with pytest.raises(ValueError, match="lacks the arrays delay_ms"):
        load_stream(path)


def test_load_validates_requests(tmp_path):
    path = tmp_path / "nan.npz"
    features = np.zeros((3, 79), np.float32)
    features[2, 0] = np.nan
    np.savez(path, symbols=np.array(["A", "B", "A"]), features=features, delay_ms=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="nan.npz.*NaN or inf at row 2"):
        load_stream(path)


def test_load_detects_a_stream_edited_after_saving(tmp_path):
    path = tmp_path / "stream.npz"
    save_stream(small_stream(), path)
    with np.load(path) as archive:
        arrays = dict(archive)
    arrays["delay_ms"] = arrays["delay_ms"] + 1
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match="does not match the fingerprint"):
        load_stream(path)


def test_a_saved_stream_gets_the_mode_any_new_file_gets(tmp_path):
    """Not mkstemp's private 0600: a server or team run as another user reads the stream."""
    save_stream(small_stream(), tmp_path / "stream.npz")
    (tmp_path / "plain").write_bytes(b"")
    assert (tmp_path / "stream.npz").stat().st_mode == (tmp_path / "plain").stat().st_mode
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


# --- parquet ----------------------------------------------------------------------------------

def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow` raise ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    path = tmp_path / "stream.parquet"
    with pytest.raises(ImportError, match="pip install pyarrow"):
        save_stream(small_stream(), path)
    path.write_bytes(b"PAR1")
    with pytest.raises(ImportError, match="pip install pyarrow"):
        load_stream(path)
    assert [p.name for p in tmp_path.iterdir()] == ["stream.parquet"]


@pytest.mark.parametrize("targets", [False, True])
def test_parquet_round_trip(tmp_path, targets):
    pytest.importorskip("pyarrow")
    stream = small_stream(targets=targets)
    path = tmp_path / "stream.parquet"
    save_stream(stream, path)
    loaded = load_stream(path)
    assert_same_stream(stream, loaded)
    assert loaded.meta["weights_fingerprint"] == "abc"


def test_parquet_original_schema_without_meta(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    stream = small_stream(targets=True)
    columns = {name: stream.features[:, i] for i, name in enumerate(FEATURE_COLUMNS)}
    columns.update(symbol=stream.symbols.tolist(), delay_ms=stream.delay_ms.astype(np.float64),
                   **{f"target_{i:02d}": stream.targets[:, i].astype(np.float64) for i in range(4)})
    pq.write_table(pa.table(columns), tmp_path / "original.parquet")
    loaded = load_stream(tmp_path / "original.parquet")
    assert_same_stream(stream, loaded)
    assert loaded.meta == {}


@pytest.mark.parametrize("dropped, message", [
    (["feature_78"], "lacks the columns feature_78"),
    (["symbol", "delay_ms"], "lacks the columns symbol, delay_ms"),
    (["target_02"], "only some target columns"),
])
def test_parquet_missing_columns(tmp_path, dropped, message):
    pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    path = tmp_path / "stream.parquet"
    save_stream(small_stream(targets=True), path)
    table = pq.read_table(path)
    pq.write_table(table.drop_columns(dropped), path)
    with pytest.raises(ValueError, match=message):
        load_stream(path)


def test_parquet_bad_meta_names_the_file(tmp_path):
    pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    path = tmp_path / "stream.parquet"
    save_stream(small_stream(), path)
    table = pq.read_table(path)
    pq.write_table(table.replace_schema_metadata({b"fastens_meta": b"{not json"}), path)
    with pytest.raises(ValueError, match=f"stream {path}: its meta is not JSON text: Expecting property name"):
        load_stream(path)


def write_original(path, num_requests=6, extra=(), **columns):
    """A parquet file in the original's schema, as another tool writes it: `columns` replace its columns (pyarrow
    arrays, or values), `extra` is (name, array) pairs appended as they are, so a name may come twice."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    stream = small_stream(max(num_requests, 1))  # a Stream has requests; the file may not
    table = {name: stream.features[:num_requests, i].astype(np.float64) for i, name in enumerate(FEATURE_COLUMNS)}
    table.update(symbol=stream.symbols[:num_requests].tolist(), delay_ms=np.arange(num_requests))
    table.update(columns)
    names = list(table) + [name for name, _ in extra]
    arrays = [pa.array(values) for values in table.values()] + [pa.array(values) for _, values in extra]
    pq.write_table(pa.Table.from_arrays(arrays, names=names), path)
    return stream


def test_parquet_null_in_a_dictionary_symbol_is_refused_not_read_as_another_symbol(tmp_path):
    # a pandas categorical with a missing value: to_numpy() gave the null row one of the dictionary's symbols
    pa = pytest.importorskip("pyarrow")
    symbols = pa.array(["A", "B", None, "A", "B", "A"]).dictionary_encode()
    write_original(tmp_path / "s.parquet", symbol=symbols)
    with pytest.raises(ValueError, match=r"s.parquet: column symbol is null \(.*\) at row 2 \(1 null rows\)$"):
        load_stream(tmp_path / "s.parquet")


@pytest.mark.parametrize("column, values, message", [
    # a null in a number column was told as "NaN or inf", which the file does not hold
    ("feature_40", [0.5, None, 1, 2, 3, 4], r"column feature_40 is null \(missing, or a NaN as pandas writes one\)"
     r" at row 1 \(1 null rows\)"),
    ("delay_ms", [1, 2, 3, None, 5, None], r"column delay_ms is null \(.*\) at row 3 \(2 null rows\)"),
    # the column and its type, not "features must be real numbers, got dtype object"
    ("feature_05", ["1.5"] * 6, "column feature_05 holds string values, not numbers"),
    ("feature_05", [[1.0, 2.0]] * 6, r"column feature_05 holds list<\w+: double> values, not numbers"),
    ("feature_05", [None] * 6, "column feature_05 holds null values, not numbers"),
    ("delay_ms", ["12"] * 6, "column delay_ms holds string values, not numbers"),
    ("symbol", list(range(6)), "column symbol holds int64 values, not text"),
    ("symbol", [b"A"] * 6, "column symbol holds binary values, not text"),
    # the features are made float32 a column at a time: a float64 past its range, or an inf, is told as before
    ("feature_05", [0, 0, 1e300, 0, 0, 0], r"feature_05 values at row 2 exceed float32's range \(max \|value\| 1e\+300\)"),
    ("feature_05", [0, 0, 0, -np.inf, 0, 0], r"features contain NaN or inf at row 3, feature 5 \(1 bad rows\)"),
])
def test_parquet_bad_columns_are_named_with_their_row(tmp_path, column, values, message):
    write_original(tmp_path / "s.parquet", **{column: values})
    with pytest.raises(ValueError) as error:
        load_stream(tmp_path / "s.parquet")
    assert re.fullmatch(re.escape(f"stream {tmp_path / 's.parquet'}: ") + message, str(error.value))


def test_parquet_null_target_is_named(tmp_path):
    targets = {f"target_{i:02d}": np.ones(6) for i in range(4)}
    targets["target_02"] = [1.0, 1.0, 1.0, 1.0, None, 1.0]
    write_original(tmp_path / "s.parquet", **targets)
    with pytest.raises(ValueError, match=r"column target_02 is null \(.*\) at row 4"):
        load_stream(tmp_path / "s.parquet")


def test_parquet_without_rows_says_so(tmp_path):
    # an empty column's type is whatever the writer chose (null, double): "column symbol holds null values" before
    pa = pytest.importorskip("pyarrow")
    write_original(tmp_path / "s.parquet", 0, symbol=pa.array([]), delay_ms=pa.array([], pa.float64()))
    with pytest.raises(ValueError, match=r"s.parquet: the stream has no requests$"):
        load_stream(tmp_path / "s.parquet")


@pytest.mark.parametrize("name", ["feature_10", "symbol", "delay_ms"])
def test_parquet_a_column_named_twice_is_refused_in_one_line(tmp_path, name):
    # read_table failed with "Multiple matches for FieldRef.Name(...)" and the whole schema, 86 lines
    write_original(tmp_path / "s.parquet", extra=[(name, np.zeros(6) if name != "symbol" else ["Z"] * 6)])
    with pytest.raises(ValueError) as error:
        load_stream(tmp_path / "s.parquet")
    assert str(error.value) == f"stream {tmp_path / 's.parquet'} has 2 columns named {name}"


def test_parquet_an_unknown_column_named_twice_is_not_read(tmp_path):
    stream = write_original(tmp_path / "s.parquet", extra=[("note", ["x"] * 6), ("note", [1] * 6)])
    assert_same_stream(Stream(stream.symbols, stream.features, np.arange(6)), load_stream(tmp_path / "s.parquet"))


def test_parquet_a_feature_beyond_the_79_is_refused(tmp_path):
    # 80 features would have been played as their first 79
    write_original(tmp_path / "s.parquet", feature_79=np.zeros(6), target_04=np.zeros(6))
    with pytest.raises(ValueError, match=r"s.parquet has numbered columns other than feature_00..feature_78 and "
                                         r"target_00..target_03: feature_79, target_04$"):
        load_stream(tmp_path / "s.parquet")


def test_parquet_a_missing_column_names_its_near_miss(tmp_path):
    pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    write_original(tmp_path / "s.parquet")
    table = pq.read_table(tmp_path / "s.parquet")
    pq.write_table(table.rename_columns([{"symbol": "Symbol", "delay_ms": "delay_ms ", "feature_05": "feature_5"}.get(
        name, name) for name in table.column_names]), tmp_path / "s.parquet")
    with pytest.raises(ValueError, match=r"lacks the columns feature_05, symbol, delay_ms \(it has 'feature_5', "
                                         r"'Symbol', 'delay_ms '\)$"):
        load_stream(tmp_path / "s.parquet")


def test_parquet_pandas_style_file_plays(tmp_path):
    # what pandas writes: float64 features, an index column, int64 gaps, a categorical symbol, columns reordered
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    stream = small_stream(targets=True)
    columns = {"__index_level_0__": np.arange(10, 16), "delay_ms": np.full(6, 12)}
    columns.update({name: stream.features[:, i].astype(np.float64) for i, name in enumerate(FEATURE_COLUMNS)})
    columns["symbol"] = pa.array(stream.symbols.tolist()).dictionary_encode()
    columns.update({f"target_{i:02d}": stream.targets[:, i].astype(np.float64) for i in range(4)})
    pq.write_table(pa.table(columns), tmp_path / "s.parquet", row_group_size=4)
    loaded = load_stream(tmp_path / "s.parquet")
    assert_same_stream(Stream(stream.symbols, stream.features, np.full(6, 12.0), stream.targets), loaded)


def test_parquet_a_corrupted_file_is_refused_in_one_line(tmp_path):
    pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    path = tmp_path / "s.parquet"
    write_original(path)
    pq.write_table(pq.read_table(path), path, compression="none")
    data = bytearray(path.read_bytes())
    for i in range(200, len(data) // 2, 7):  # pages garbled, the footer whole
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError) as error:
        load_stream(path)
    assert str(error.value).startswith(f"cannot read stream {path} as parquet: ") and "\n" not in str(error.value)


@pytest.mark.parametrize("meta, message", [
    (np.array(b'{"preset": "tiny"}'), None),  # bytes, as another tool may write it: str() of it is "b'...'"
    (np.array("{not json"), "meta is not JSON text: Expecting property name"),
])
def test_npz_meta_is_read_from_text_or_bytes(tmp_path, meta, message):
    path = tmp_path / "stream.npz"
    np.savez(path, symbols=np.array(["A"]), features=np.zeros((1, 79), np.float32), delay_ms=np.ones(1), meta=meta)
    if message is None:
        assert load_stream(path).meta == {"preset": "tiny"}
    else:
        with pytest.raises(ValueError, match=f"stream {path}: its {message}"):
            load_stream(path)


# --- scripts/make_stream.py -----------------------------------------------------------------

def load_make_stream():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "scripts" / "make_stream.py"
    spec = importlib.util.spec_from_file_location("make_stream", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_make_stream_writes_the_generated_stream(tmp_path):
    out = tmp_path / "stream.npz"
    load_make_stream().main(["--symbols", "4", "--requests", "30", "--seed", "5", "--rate", "100",
                             "--out", str(out)])
    loaded = load_stream(out)
    assert_same_stream(generate_stream(4, 30, seed=5, rate=100), loaded)
    assert loaded.meta["seed"] == 5 and loaded.meta["rate"] == 100


@pytest.mark.parametrize("argv, message", [
    (["--symbols", "2", "--requests", "5", "--seed", "1", "--targets"], "--targets needs --preset"),
    (["--symbols", "2", "--requests", "5", "--seed", "1", "--preset", "tiny"], "only apply with --targets"),
    # else accepted and nothing cached: the targets' cache is only used with --targets
    (["--symbols", "2", "--requests", "5", "--seed", "1", "--cache-dir", "c"], "--cache-dir only apply with --targets"),
    (["--symbols", "2", "--requests", "5", "--seed", "1", "--out", "s.csv"], "must end in .npz or .parquet"),
    (["--symbols", "2", "--requests", "5", "--seed", "1", "--targets", "--preset", "huge"], "invalid choice"),
    (["--symbols", "2", "--requests", "5", "--seed", "1", "--targets", "--preset", "tiny", "--weights", "w.pt",
      "--weights-seed", "1"], "not allowed with"),
    # named as the option, not as generate_stream's num_symbols
    (["--symbols", "-1", "--requests", "5", "--seed", "1"], "argument --symbols: must be a positive integer, got '-1'"),
    (["--symbols", "2", "--requests", "0", "--seed", "1"], "argument --requests: must be a positive integer, got '0'"),
    (["--symbols", "2", "--requests", "5", "--seed", "1", "--rate", "-4"],
     "argument --rate: must be a positive number, got '-4'"),
    (["--symbols", "2", "--requests", "5", "--seed", "1", "--rate", "1e-9"],  # named no option: a gap over a day
     "argument --rate: must be at least 0.001 requests/s"),
])
def test_make_stream_rejects_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit):
        load_make_stream().main(argv)
    assert message in capsys.readouterr().err
