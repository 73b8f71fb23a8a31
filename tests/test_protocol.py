import math
import re

import msgpack
import numpy as np
import pytest

from client import protocol
from client.protocol import ProtocolError


def roundtrip(msg):
    return protocol.decode(protocol.encode(msg))


def test_register_roundtrip_with_and_without_token():
    assert roundtrip(protocol.register("alpha")) == {"type": "register", "team": "alpha",
                                                     "protocol": protocol.PROTOCOL_VERSION}
    assert roundtrip(protocol.register("alpha", token="t"))["token"] == "t"


def test_register_names_the_model_and_welcome_and_end_roundtrip():
    msg = roundtrip(protocol.register("alpha", preset="tiny", weights_fingerprint="ab12", allow_weights_mismatch=True))
    assert (msg["preset"], msg["weights_fingerprint"], msg["allow_weights_mismatch"]) == ("tiny", "ab12", True)
    welcome = roundtrip(protocol.welcome("tiny", None, 400, 8, None))
    assert welcome == {"type": "welcome", "preset": "tiny", "weights_fingerprint": None, "requests": 400,
                       "symbols": 8, "weights_match": None}
    assert roundtrip(protocol.end(400)) == {"type": "end", "requests": 400}
    with pytest.raises(ProtocolError, match="'weights_fingerprint' must be a string"):
        protocol.decode(msgpack.packb({"type": "register", "team": "a", "protocol": 1, "weights_fingerprint": 5}))
    with pytest.raises(ProtocolError, match="welcome: missing field 'requests'"):
        protocol.decode(msgpack.packb({"type": "welcome", "preset": "tiny", "weights_fingerprint": None}))


@pytest.mark.parametrize("timeout_s", [float("inf"), float("nan"), 0.0, -1.0, "2"])
def test_a_welcomes_timeout_is_a_positive_finite_number_of_seconds(timeout_s):
    """The client counts answers in time by the welcome's timeout_s: inf counted every answer, however late, in time,
    and the summary's --json then said Infinity, which is no JSON."""
    assert roundtrip(protocol.welcome("tiny", None, 4, 1, None, timeout_s=2.5))["timeout_s"] == 2.5
    welcome = {**protocol.welcome("tiny", None, 4, 1, None), "timeout_s": timeout_s}
    with pytest.raises(ProtocolError, match="'timeout_s' must be a positive"):
        protocol.decode(protocol.encode(welcome))


def test_inference_request_roundtrip_is_little_endian_row_major():
    features = np.arange(2 * 79, dtype=np.float32).reshape(2, 79)
    msg = roundtrip(protocol.inference_request(np.array([7, 9]), ["SYM_000", "SYM_001"], features, 12.5))
    assert msg["features"] == features.astype("<f4").tobytes()
    ids, symbols, parsed = protocol.parse_inference_request(msg)
    assert ids == [7, 9] and symbols == ["SYM_000", "SYM_001"]
    assert parsed.dtype == np.float32 and np.array_equal(parsed, features)
    parsed[0, 0] = 1.0  # the caller owns a writable copy


def test_parse_inference_request_lets_nan_rows_through():
    features = np.full((1, 79), np.nan, dtype=np.float32)
    _, _, parsed = protocol.parse_inference_request(roundtrip(protocol.inference_request([1], ["S"], features, 0)))
    assert np.isnan(parsed).all()


def test_inference_response_roundtrip_bytes_and_nested_lists():
    predictions = np.array([[0.1, 0.2, 0.3, 0.4], [1, 2, 3, 4]], dtype=np.float32)
    ids, parsed = protocol.parse_inference_response(roundtrip(protocol.inference_response([3, 4], predictions, 1.0)))
    assert ids == [3, 4] and np.array_equal(parsed, predictions)
    nested = {"type": "inference_response", "unique_ids": [3, 4], "predictions": predictions.tolist(),
              "client_timestamp": 2}
    ids, parsed = protocol.parse_inference_response(roundtrip(nested))
    assert parsed.dtype == np.float32 and np.array_equal(parsed, predictions)


def test_empty_response_parses():
    ids, parsed = protocol.parse_inference_response(
        roundtrip(protocol.inference_response([], np.zeros((0, 4), np.float32), 0.0)))
    assert ids == [] and parsed.shape == (0, 4)


def test_score_update_heartbeat_error_roundtrip():
    msg = roundtrip(protocol.score_update(np.array([1, 2]), [0.5, 1.0], [2, 4], [3.0, 4.0]))
    assert msg["correct"] == [2, 4] and msg["pnls"] == [0.5, 1.0]
    assert roundtrip(protocol.heartbeat(5.0))["timestamp"] == 5.0
    assert roundtrip(protocol.error("bad", "why")) == {"type": "error", "error": "bad", "details": "why"}


def nested(depth):
    value = 0
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("frame, match", [
    ("{}", "text frame"),
    (b"\xc1", "malformed msgpack: a byte that begins no msgpack value \\(FormatError\\)$"),  # said, never empty
    (b"\x92\x01", "malformed msgpack: Unpack failed: incomplete input$"),
    (protocol.encode({"type": "heartbeat", "timestamp": 1}) + b"\x00", "malformed msgpack"),
    (msgpack.packb([1, 2]), "must be a msgpack map"),
    (msgpack.packb({1: 2}), "malformed msgpack"),  # non-string keys
    (msgpack.packb({"team": "x"}), "no 'type'"),
    (msgpack.packb({"type": "launch"}), "unknown message type 'launch'"),
    (msgpack.packb({"type": 3}), "unknown message type 3"),
    # lists 1,000 deep (msgpack unpacks 1,024): their repr overflowed the recursion limit, the server's handler failed
    (msgpack.packb({"type": nested(1000)}), re.escape("unknown message type [[[[[[[...]]]]]]]; expected")),
    (msgpack.packb({"type": "register", "team": "x"}), "missing field 'protocol'"),
    (msgpack.packb({"type": "register", "team": 5, "protocol": 1}), "'team' must be a string"),
    (msgpack.packb({"type": "register", "team": "x", "protocol": True}), "'protocol' must be an integer"),
    (msgpack.packb({"type": "heartbeat", "timestamp": "now"}), "'timestamp' must be a number"),
    (msgpack.packb({"type": "inference_response", "unique_ids": [1, "2"], "predictions": b"",
                    "client_timestamp": 0}), "'unique_ids' must be a list of integers"),
    (msgpack.packb({"type": "inference_response", "unique_ids": [1], "predictions": 3.0,
                    "client_timestamp": 0}), "'predictions' must be bytes or"),
    (msgpack.packb({"type": "inference_request", "unique_ids": [1], "symbols": ["S"], "features": [0.0],
                    "timestamp": 0}, use_bin_type=True), "'features' must be bytes"),
])
def test_decode_rejects_bad_frames(frame, match):
    with pytest.raises(ProtocolError, match=match):
        protocol.decode(frame)


def test_decode_rejects_oversized_frame():
    frame = protocol.encode({"type": "error", "error": "x", "details": "y" * 100})
    with pytest.raises(ProtocolError, match="exceeds the limit of 50 bytes"):
        protocol.decode(frame, max_bytes=50)


def test_request_counts_must_agree():
    features = np.zeros((2, 79), np.float32)
    msg = protocol.inference_request([1, 2], ["A", "B"], features, 0)
    with pytest.raises(ProtocolError, match="2 unique_ids but 1 symbols"):
        protocol.parse_inference_request(dict(msg, symbols=["A"]))
    with pytest.raises(ProtocolError, match="expected 632"):
        protocol.parse_inference_request(dict(msg, features=msg["features"][:-4]))
    with pytest.raises(ProtocolError, match="expected message type 'inference_request', got 'heartbeat'"):
        protocol.parse_inference_request(protocol.heartbeat(1.0))
    with pytest.raises(ProtocolError, match=r"shape \(2, 79\)"):
        protocol.inference_request([1, 2], ["A", "B"], np.zeros((2, 78)), 0)
    with pytest.raises(ProtocolError, match="2 unique_ids but 1 symbols"):
        protocol.inference_request([1, 2], ["A"], features, 0)


def test_response_counts_must_agree():
    msg = protocol.inference_response([1, 2], np.zeros((2, 4), np.float32), 0)
    with pytest.raises(ProtocolError, match="expected 32"):
        protocol.parse_inference_response(dict(msg, predictions=msg["predictions"] + b"\0\0\0\0"))
    with pytest.raises(ProtocolError, match="2 unique_ids but 1 predictions"):
        protocol.parse_inference_response(dict(msg, predictions=[[0, 0, 0, 0]]))
    with pytest.raises(ProtocolError, match="list of 4 numbers"):
        protocol.parse_inference_response(dict(msg, predictions=[[0, 0, 0], [0, 0, 0, 0]]))
    with pytest.raises(ProtocolError, match="list of 4 numbers"):
        protocol.parse_inference_response(dict(msg, predictions=[[0, 0, 0, "x"], [0, 0, 0, 0]]))
    with pytest.raises(ProtocolError, match=r"shape \(2, 4\)"):
        protocol.inference_response([1, 2], np.zeros((2, 3)), 0)


def test_builders_reject_inconsistent_input():
    with pytest.raises(ProtocolError, match="lengths differ"):
        protocol.score_update([1, 2], [0.5], [1, 2], [1.0, 2.0])
    with pytest.raises(ProtocolError, match="must be finite"):
        protocol.heartbeat(float("nan"))


@pytest.mark.parametrize("pnls, latencies, message", [
    ([0.5, math.nan, 1.0], [1.0, 2.0, 3.0], "score_update: pnls not finite for unique_ids 8$"),
    ([0.5, 0.5, -math.inf], [1.0, -2.0, 3.0], "score_update: pnls not finite for unique_ids 9; latencies_ms "
                                              "negative or not finite for unique_ids 8$"),
    ([0.5, 0.5, 0.5], [math.inf, 2.0, math.nan], "latencies_ms negative or not finite for unique_ids 7, 9$"),
])
def test_a_score_update_refuses_non_finite_pnls_and_negative_or_non_finite_latencies_naming_their_ids(
        pnls, latencies, message):
    with pytest.raises(ValueError, match=message):
        protocol.score_update([7, 8, 9], pnls, [4, 4, 4], latencies)
    with pytest.raises(ProtocolError, match=message):
        protocol.check_score_values([7, 8, 9], pnls, latencies)
    protocol.check_score_values([7, 8, 9], [0.0, -1.5, 2.0], [0.0, 1.0, 2000.0])  # a PnL may be negative


def test_a_score_update_names_at_most_ten_of_its_offending_ids():
    with pytest.raises(ProtocolError, match=r"unique_ids 0, 1, 2, 3, 4, 5, 6, 7, 8, 9 \.\.\. \(12 in all\)$"):
        protocol.score_update(range(12), [math.nan] * 12, [4] * 12, [1.0] * 12)


@pytest.mark.parametrize("team, problem", [
    ("alpha", None), ("x" * 64, None), ("", "got '' (0 characters)"), ("a\nb", "got 'a\\nb' (3 characters)"),
    ("x" * 65, "(65 characters)"),
])
def test_team_names_are_one_to_64_printable_characters(team, problem):
    said = protocol.team_name_problem(team)
    assert said == problem if problem is None else said.startswith("a team name is 1..64 printable characters, ")
    if problem is not None:
        assert said.endswith(problem)


def test_register_and_welcome_carry_the_session_key():
    assert roundtrip(protocol.register("a", session_key="k"))["session_key"] == "k"
    assert roundtrip(protocol.welcome("tiny", "f", 10, 2, True, session_key="k"))["session_key"] == "k"
    assert "session_key" not in protocol.register("a") and "session_key" not in protocol.welcome("t", "f", 1, 1, None)


def test_list_fields_take_their_types_alone_looked_at_in_c_first_then_one_by_one():
    """A list field's element types are looked at in C first, then element by element: a bool is no integer, an
    int subclass (IntEnum) still is one, and a float or a bool in a number list is told apart as before."""
    import enum

    class Flag(enum.IntEnum):
        ONE = 1

    features = np.zeros((2, protocol.NUM_FEATURES), np.float32).tobytes()
    base = {"type": "inference_request", "unique_ids": [1, 2], "symbols": ["A", "B"], "features": features,
            "timestamp": 0.5}
    assert protocol.validate(dict(base)) is not None
    assert protocol.validate(dict(base, unique_ids=[Flag.ONE, 2]))["unique_ids"] == [1, 2]
    for field, value in (("unique_ids", [1, True]), ("unique_ids", [1, 2.0]), ("symbols", ["A", b"B"]),
                         ("unreadable_rows", [0, None])):
        with pytest.raises(ProtocolError, match=f"'{field}' must be") as caught:
            protocol.validate(dict(base, **{field: value}))
        if field == "unique_ids":  # the integers among them still count as requests
            assert caught.value.unique_ids == [1]
    score = protocol.score_update([1, 2], [0.5, 1], [4, 3], [2.5, 3.0])
    assert roundtrip(score)["pnls"] == [0.5, 1.0]
    with pytest.raises(ProtocolError, match="'latencies_ms' must be"):
        protocol.validate(dict(score, latencies_ms=[2.5, False]))


def test_a_decoded_request_is_parsed_without_validating_it_again_but_still_by_its_type():
    msg = roundtrip(protocol.inference_request([7], ["A"], np.ones((1, protocol.NUM_FEATURES), np.float32), 1.0))
    ids, symbols, features = protocol.parse_inference_request(msg, validated=True)
    assert (ids, symbols, features.shape) == ([7], ["A"], (1, protocol.NUM_FEATURES))
    with pytest.raises(ProtocolError, match="expected message type 'inference_request', got 'end'"):
        protocol.parse_inference_request(roundtrip(protocol.end(3)), validated=True)
    with pytest.raises(ProtocolError, match="'symbols' must be a list of strings"):
        protocol.parse_inference_request(dict(msg, symbols=[3]))  # not validated before: validated here
