from hypothesis import given, settings
from hypothesis import strategies as st

from web.bench.sse import SSEEvent, SSEParser

from tests.support.sse_server import split_at


def parse(chunks):
    parser = SSEParser()
    events = []
    for chunk in chunks:
        events.extend(parser.feed(chunk))
    return events, parser


def test_data_only_framing_and_done():
    events, parser = parse([b'data: {"a": 1}\n\ndata: [DONE]\n\n'])
    assert events == [SSEEvent(data='{"a": 1}')]
    assert parser.saw_done


def test_event_lines_and_multiline_data_joined_with_newline():
    events, _ = parse([b"event: response.output_text.delta\ndata: one\ndata: two\n\n"])
    assert events == [SSEEvent(data="one\ntwo", event="response.output_text.delta")]


def test_empty_data_and_comments_skipped():
    events, parser = parse([b": keep-alive\n\ndata:\n\ndata: \n\n:comment\ndata: x\n\n"])
    assert events == [SSEEvent(data="x")]
    assert not parser.saw_done


def test_only_one_leading_space_stripped_and_no_colon_field():
    events, _ = parse([b"data:  two spaces\n\ndata\ndata:y\n\n"])
    assert events == [SSEEvent(data=" two spaces"), SSEEvent(data="\ny")]


def test_line_endings_cr_crlf_lf_and_split_crlf():
    events, _ = parse([b"data: a\r\n\r\ndata: b\r\rdata: c\n\ndata: d\r", b"\n\r", b"\n"])
    assert [e.data for e in events] == ["a", "b", "c", "d"]


def test_unicode_line_separators_are_content():
    text = 'data: {"t": "a\u2028b\u2029c\u0085d"}\n\n'
    events, _ = parse([text.encode()])
    assert events == [SSEEvent(data='{"t": "a\u2028b\u2029c\u0085d"}')]


def test_split_inside_multibyte_character():
    raw = "data: é€😀\n\n".encode()
    events, _ = parse([raw[i : i + 1] for i in range(len(raw))])
    assert events == [SSEEvent(data="é€😀")]


def test_incomplete_event_is_not_dispatched():
    events, _ = parse([b"data: partial\n"])
    assert events == []


def test_leading_bom_stripped_once():
    events, _ = parse([b"\xef\xbb", b"\xbfdata: x\n\n"])
    assert events == [SSEEvent(data="x")]


def test_id_field_kept():
    events, _ = parse([b"id: 7\ndata: x\n\ndata: y\n\n"])
    assert [(e.id, e.data) for e in events] == [("7", "x"), ("7", "y")]


_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=20
)
_event = st.tuples(st.one_of(st.none(), st.sampled_from(["message", "response.completed", "error"])),
                   st.lists(_text, min_size=1, max_size=3))
_newline = st.sampled_from([b"\n", b"\r\n", b"\r"])


@st.composite
def streams(draw):
    """A stream and its expected events; one newline style per event, so a CR never meets a blank LF."""
    parts, expected = [], []
    for name, data_lines in draw(st.lists(_event, max_size=6)):
        nl = draw(_newline)
        if draw(st.booleans()):
            parts.append(b": comment" + nl)
        if name:
            parts.append(f"event: {name}".encode() + nl)
        parts.extend(b"data: " + line.encode() + nl for line in data_lines)
        parts.append(nl)
        data = "\n".join(data_lines)
        if data and data != "[DONE]":
            expected.append(SSEEvent(data=data, event=name or "message"))
    return b"".join(parts), expected


@settings(max_examples=300, deadline=None)
@given(streams(), st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_any_chunking_yields_the_same_events(stream_and_expected, cuts):
    stream, expected = stream_and_expected
    whole, _ = parse([stream])
    chunked, _ = parse(split_at(stream, cuts))
    assert whole == expected
    assert chunked == expected


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_text.filter(bool), _newline), max_size=6),
       st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_chunked_events_match_expected(items, cuts):
    # Each event ends with the same newline twice; "\r" + "\r" and "\n" + "\n" and "\r\n" + "\r\n" are all blank-line dispatches.
    stream = b"".join(b"data: " + text.encode() + nl + nl for text, nl in items)
    expected = [SSEEvent(data=text) for text, _ in items if text != "[DONE]"]
    events, _ = parse(split_at(stream, cuts))
    assert events == expected


def test_cr_inside_a_chunk_does_not_swallow_the_next_chunks_lf():
    events, _ = parse([b"data: a\rdata: b", b"\n\n"])
    assert events == [SSEEvent(data="a\nb")]
