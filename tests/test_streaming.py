"""Unit tests of swarmkit.contract.streaming: the stop-string cut and the streaming hold-back rules."""

from __future__ import annotations

import subprocess
import sys

from swarmkit.contract.streaming import REPLACEMENT_CHAR, StreamTextBuffer, cut_at_stop, find_stop


def _stream(decodes: list[str], stops: list[str]) -> tuple[list[str], str, bool]:
    """Drive a buffer the way the backends do: push each decode until a stop appears, then finish."""
    buf = StreamTextBuffer(stops)
    chunks: list[str] = []
    final, hit = decodes[-1], False
    for text in decodes:
        final, hit = cut_at_stop(text, stops)
        if hit:
            break
        chunks.append(buf.push(text))
    chunks.append(buf.finish(final))
    return chunks, final, hit


# --------------------------------------------------------------------------- find_stop / cut_at_stop
def test_earliest_of_several_stops_wins():
    text = "alpha END beta STOP gamma"
    assert find_stop(text, ["STOP", "END"]) == text.index("END")
    assert cut_at_stop(text, ["STOP", "END"]) == ("alpha ", True)
    # the earliest *position* counts, not the order in the list nor the length
    assert cut_at_stop("a<b>c<", ["<b>", "<"]) == ("a", True)


def test_empty_stop_list_and_empty_stop_strings():
    assert find_stop("anything", []) is None
    assert cut_at_stop("anything", []) == ("anything", False)
    assert cut_at_stop("anything", [""]) == ("anything", False)  # an empty stop never matches
    assert cut_at_stop("ab|cd", ["", "|"]) == ("ab", True)
    assert cut_at_stop("", ["x"]) == ("", False)


def test_stop_at_position_zero():
    assert find_stop("STOP and more", ["STOP"]) == 0
    assert cut_at_stop("STOP and more", ["STOP"]) == ("", True)
    chunks, final, hit = _stream(["ST", "STOP"], ["STOP"])
    assert hit and final == "" and "".join(chunks) == ""


def test_checked_rescans_a_stop_straddling_the_old_end():
    stops = ["<END>"]
    # the previous decode "abc<EN" (6 chars) had no stop; the stop straddles its end
    assert cut_at_stop("abc<END> tail", stops, checked=6) == ("abc", True)
    # a stop revealed once trailing replacement chars of a split character resolve
    assert cut_at_stop("ab\u00e9<END>", stops, checked=len("ab" + REPLACEMENT_CHAR * 3)) == ("ab\u00e9", True)
    # a stop wholly before the rescan window is (by contract) already known not to be there
    assert cut_at_stop("x<END>" + "y" * 20, stops, checked=26) == ("x<END>" + "y" * 20, False)


# --------------------------------------------------------------------------- StreamTextBuffer
def test_partial_utf8_replacement_chars_are_held_back():
    buf = StreamTextBuffer([])
    assert buf.hold == 0
    assert buf.push("caf") == "caf"
    assert buf.push("caf" + REPLACEMENT_CHAR) == ""  # first byte of "é" only
    assert buf.push("caf" + REPLACEMENT_CHAR * 2) == ""
    assert buf.sent == 3
    assert buf.push("caf\u00e9") == "\u00e9"  # resolved: emitted whole, never the replacement char
    assert buf.push("caf\u00e9!") == "!"
    assert buf.finish("caf\u00e9!") == ""


def test_replacement_chars_already_sent_are_not_taken_back():
    buf = StreamTextBuffer([])
    assert buf.push("a") == "a"
    assert buf.push("a" + REPLACEMENT_CHAR) == ""
    assert buf.finish("a" + REPLACEMENT_CHAR) == REPLACEMENT_CHAR  # a real one at the end is kept
    assert buf.sent == 2


def test_hold_back_covers_the_longest_stop_minus_one():
    buf = StreamTextBuffer(["</s>", "ab"])
    assert buf.hold == 3
    assert buf.push("hello") == "he"
    assert buf.push("hello") == ""  # nothing new
    assert buf.push("hello world") == "llo wo"
    assert buf.finish("hello world") == "rld"


def test_stop_string_split_across_chunks_never_leaks():
    decodes = ["The answer", "The answer is 4", "The answer is 4\n", "The answer is 4\n##", "The answer is 4\n###"]
    chunks, final, hit = _stream(decodes, ["###"])
    assert hit and final == "The answer is 4\n"
    assert "".join(chunks) == final
    assert all("#" not in c for c in chunks)


def test_stream_without_stop_concatenates_to_the_final_text():
    decodes = ["a", "ab" + REPLACEMENT_CHAR, "ab\u20ac", "ab\u20ac c", "ab\u20ac cd"]
    chunks, final, hit = _stream(decodes, ["zz", "xyz"])
    assert not hit and final == "ab\u20ac cd"
    assert "".join(chunks) == final
    assert REPLACEMENT_CHAR not in "".join(chunks[:-1])


def test_decode_shrinking_below_sent_emits_nothing():
    buf = StreamTextBuffer([])
    assert buf.push("abcd") == "abcd"
    assert buf.push("ab") == ""
    assert buf.sent == 4


def test_only_empty_stops_hold_nothing():
    buf = StreamTextBuffer([""])
    assert buf.hold == 0
    assert buf.push("ab" + REPLACEMENT_CHAR) == "ab"
    assert buf.sent == 2


def test_module_is_light():
    code = "import sys, swarmkit.contract.streaming; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
