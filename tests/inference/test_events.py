"""The output events' one wire form: every event reads back as itself, the unversioned form events had before
reads as version 1, and an unknown version, type or malformed event is refused by name."""
import json

import pytest

from inference.events import VERSION, Delta, Done, Error, EventFormatError, Usage, event_decode, event_encode, is_final

EVENTS = [Delta("Hel"), Delta("", [[7, -0.25, [[7, -0.25], [9, -2.5]]]]), Delta("lo", tokens=3), Done(), Done("length", Usage(40, 10, 16)),
          Error("lease_lost", "the request's page lease expired")]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_event_reads_back_as_itself(event):
    wire = event_encode(event)
    assert json.loads(wire)["v"] == VERSION and json.loads(wire)["type"] == event.type
    assert event_decode(wire) == event and event_decode(wire.encode()) == event


def test_only_done_and_error_are_final():
    assert [is_final(e) for e in EVENTS] == [False, False, False, True, True, True]


def test_the_unversioned_form_reads_as_version_1():
    """What workers published before events carried `v` (a stream read across a rolling restart)."""
    assert event_decode('{"type": "delta", "text": "a"}') == Delta("a")
    assert event_decode('{"type": "done", "finish_reason": "stop", "usage": {"prompt_tokens": 7, '
                        '"completion_tokens": 5, "cached_tokens": 0}}') == Done("stop", Usage(7, 5))
    assert event_decode('{"type": "error", "code": "timeout", "message": "m"}') == Error("timeout", "m")


def test_a_delta_of_an_engine_step_carries_its_token_and_alternatives():
    assert Delta.step("x") == Delta("x")
    assert Delta.step("x", 5, (-0.5, [(5, -0.5), (6, -1.5)])) == Delta("x", [[5, -0.5, [[5, -0.5], [6, -1.5]]]])
    assert Delta.step("x", 5, None, 4) == Delta("x", tokens=4)  # the completion tokens so far
    assert json.loads(event_encode(Delta("x", tokens=4)))["tokens"] == 4 and "tokens" not in event_encode(Delta("x"))


@pytest.mark.parametrize("wire, words", [
    ('{"v": 2, "type": "delta", "text": "a"}', "version 2 is unknown"),
    ('{"v": "1", "type": "delta", "text": "a"}', "version '1' is unknown"),
    ('{"v": 1, "type": "progress", "text": "a"}', "unknown output event type 'progress'"),
    ('{"v": 1, "text": "a"}', "unknown output event type None"),
    ('{"v": 1, "type": "error", "code": "timeout"}', "malformed error event"),
    ('{"v": 1, "type": "done", "usage": {"completion_tokens": 3}}', "malformed done event"),
    ('["delta", "a"]', "a JSON object, not list"),
    ("not json", "not JSON"),
])
def test_anything_else_is_refused_by_name(wire, words):
    with pytest.raises(EventFormatError, match=words):
        event_decode(wire)


def test_only_output_events_are_encoded():
    with pytest.raises(EventFormatError, match="not an output event"):
        event_encode({"type": "delta", "text": "a"})
