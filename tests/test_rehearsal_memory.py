"""worldmodel/memory.py: the self-assessment rule (its precedence) and the memory format, exactly,
and that the toy tokenizer with MEMORY_WORDS reads a memory word by word (no <unk>)."""
import pytest

from worldmodel import memory as rm
import world
from machinery.checkpoint import build_tokenizer


def imagined(calls, responses, answer=None):
    return {"calls": calls, "responses": responses, "answer": answer, "finished": answer is not None,
            "cause": "answer" if answer is not None else "bad_call"}


@pytest.mark.parametrize("episode, verdict", [
    (imagined(["price apple"], ["3"], "3"), "good"),
    (imagined(["price apple", "pay 9"], ["3", "error funds"], "0"), "bad"),    # answered, but a failure was shown
    (imagined(["price 3"], ["error item"]), "bad"),
    (imagined(["price apple", "pay 3"], ["3"]), "unfinished"),                 # ended at a call: no answer
    (imagined([], []), "unfinished"),
    (imagined(["price apple"], ["errors"], "3"), "good"),                      # not a failure signal
])
def test_self_assessment_rule(episode, verdict):
    assert rm.self_assess(episode) == verdict


def test_memory_format_exactly():
    eps = [imagined(["price pear"], ["4"], "4"), imagined(["price 3"], ["error item"]),
           imagined(["price apple", "mul 2 , 3"], ["3"])]
    assert rm.memory_text(eps) == ("memory tried price pear got 4 answer 4 good tried price 3 got error item bad "
                                   "tried price apple got 3 unfinished")
    assert rm.memory_prompt("not pear price apple", eps[:1]) == "not pear price apple memory tried price pear got 4 answer 4 good"
    assert rm.memory_prompt("price apple", []) == "price apple" and rm.memory_text([]) == ""


def test_a_memory_is_read_word_by_word():
    tok = build_tokenizer(world.WORDS + rm.MEMORY_WORDS)
    text = rm.memory_prompt("cost 2 fig", [imagined(["price fig", "mul 2 , 4"], ["4", "8"], "8")])
    tokens = tok.convert_ids_to_tokens(tok.encode(text, add_special_tokens=False))
    assert tokens == ["cost", "2", "fig", "memory", "tried", "price", "fig", "got", "4", "mul", "2", ",", "4",
                      "got", "8", "answer", "8", "good"]
