"""jllama.generation.stop.StopMatcher on hand-made streams: the released text must equal the text before
the first stop string, however the stream is cut into pieces."""

import pytest

from jllama.generation.stop import StopMatcher


def run(stops, pieces):
    matcher = StopMatcher(stops)
    out = []
    for piece in pieces:
        out.append(matcher.push(piece))
        if matcher.stopped:
            return "".join(out), True
    out.append(matcher.flush())
    return "".join(out), False


def test_stop_inside_one_piece():
    assert run(["END"], ["abc", "xENDy", "z"]) == ("abcx", True)


def test_stop_split_across_pieces_is_never_released():
    matcher = StopMatcher(["END"])
    assert matcher.push("abcE") == "abc"  # "E" might start "END": held back
    assert matcher.push("N") == ""
    assert matcher.push("Dxyz") == ""
    assert matcher.stopped


def test_held_back_text_is_released_when_it_turns_out_not_to_stop():
    matcher = StopMatcher(["END"])
    assert matcher.push("abEN") == "ab"
    assert matcher.push("x") == "ENx"
    assert matcher.flush() == ""
    assert run(["END"], ["abE"]) == ("abE", False)  # the stream ends: flush releases it


def test_stop_at_the_first_piece():
    assert run(["Once"], ["Once", " upon"]) == ("", True)


def test_earliest_of_several_stops_wins():
    assert run(["cd", "b"], ["abcd"]) == ("a", True)
    assert run(["xyz", "yz1"], ["xy", "z1"]) == ("", True)


def test_every_split_of_a_text_gives_the_same_output():
    text = "one two. three\n\nfour"
    for stops, want in [(["\n\n"], "one two. three"), ([". t"], "one two"), (["zz"], text)]:
        for cut in range(len(text) + 1):
            for cut2 in range(cut, len(text) + 1):
                pieces = [text[:cut], text[cut:cut2], text[cut2:]]
                assert run(stops, pieces)[0] == want, (stops, pieces)


def test_empty_stop_refused():
    with pytest.raises(ValueError, match="empty"):
        StopMatcher(["a", ""])


def test_matched_names_the_stop_string_found():
    """`matched` is the stop string the text ended at (the earliest; at one place, the first
    given); None while nothing stopped (Anthropic's stop_sequence reports it)."""
    matcher = StopMatcher(["cd", "b"])
    assert matcher.push("ab") == "a" and matcher.matched == "b"
    for stops, pieces, want in [(["xyz", "yz1"], ["xy", "z1"], "xyz"),
                                (["END", "\n"], ["one\ntwo END"], "\n"),
                                (["bc", "b"], ["abc"], "bc")]:
        matcher = StopMatcher(stops)
        for piece in pieces:
            matcher.push(piece)
        assert matcher.matched == want, (stops, pieces)
    matcher = StopMatcher(["zz"])
    matcher.push("abc")
    matcher.flush()
    assert matcher.matched is None and not matcher.stopped
