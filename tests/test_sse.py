import json

from llmgw.gateway.sse import MAX_PENDING, EventRelay

USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}


def event(obj):
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


TOKEN = event({"choices": [{"index": 0, "delta": {"content": "hi"}}]})
FINAL = event({"choices": [], "usage": USAGE})
DONE = b"data: [DONE]\n\n"


def test_whole_events_pass_at_once_and_a_partial_one_waits():
    relay = EventRelay(keep_usage=False)
    assert relay.feed(TOKEN[:10]) == b""
    assert relay.feed(TOKEN[10:] + TOKEN[:5]) == TOKEN
    assert relay.feed(TOKEN[5:]) == TOKEN


def test_usage_is_read_and_dropped_when_the_client_did_not_ask():
    relay = EventRelay(keep_usage=False)
    out = relay.feed(TOKEN + FINAL + DONE)
    assert out == TOKEN + DONE
    assert relay.usage == USAGE


def test_usage_is_kept_when_the_client_asked():
    relay = EventRelay(keep_usage=True)
    assert relay.feed(TOKEN + FINAL + DONE) == TOKEN + FINAL + DONE
    assert relay.usage == USAGE


def test_usage_inside_a_content_chunk_is_never_dropped():
    both = event({"choices": [{"index": 0, "delta": {"content": "x"}}], "usage": USAGE})
    relay = EventRelay(keep_usage=False)
    assert relay.feed(both) == both and relay.usage == USAGE


def test_an_event_without_an_end_is_not_held_forever():
    relay = EventRelay(keep_usage=False)
    blob = b"data: " + b"x" * (MAX_PENDING + 10)
    assert relay.feed(blob) == blob
    relay.feed(b"data: tail")
    assert relay.rest() == b"data: tail"


def test_the_deltas_passed_on_are_counted_and_done_is_noted():
    relay = EventRelay(keep_usage=False)
    relay.feed(TOKEN + TOKEN[:7])
    assert relay.deltas == 1 and not relay.done
    relay.feed(TOKEN[7:] + TOKEN + FINAL)
    assert relay.deltas == 3 and relay.usage == USAGE  # the usage-only event is no delta
    relay.feed(DONE)
    assert relay.deltas == 3 and relay.done


def test_a_kept_usage_event_is_no_delta_either():
    relay = EventRelay(keep_usage=True)
    relay.feed(TOKEN + FINAL + DONE)
    assert relay.deltas == 1 and relay.done


def test_usage_reports_are_summed_and_counted():
    # llama.cpp streams one report per prompt and choice; a completion's rides on its last choice event.
    last = event({"choices": [{"index": 1, "text": "", "finish_reason": "length"}], "usage": USAGE})
    relay = EventRelay(keep_usage=False)
    relay.feed(FINAL + last + DONE)
    assert relay.reports == 2 and relay.usage["prompt_tokens"] == 10 and relay.usage["completion_tokens"] == 4
