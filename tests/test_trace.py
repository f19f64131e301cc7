"""The stream's trace (selfspec.serve.trace): each round says where its tokens came from (the
engine's Round), and the server's chunks carry the tokens' text and sources, which concatenate to
exactly the response's text."""

import json

import openai
import pytest
import torch

from selfspec.core.engine import Round
from selfspec.serve.trace import SOURCES, Trace, sources

from serving import Running, tiny_served

REPEATING = "w5 w6 w7 w8 w5 w6 w7 w8 w5 w6 w7 w8 w5 w6"  # prompt lookup finds drafts in it


class Bytes:
    """A byte-level tokenizer: token i is the bytes PIECES[i]; a character may span tokens."""

    PIECES = [b"He", b"llo", b" w", b"\xc3", b"\xa9", b"!", b"<eos>"]

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.PIECES[i] for i in ids).decode("utf-8", errors="replace")


def test_sources_of_a_round():
    assert sources(Round([1, 2, 3], drafted=4, accepted=2, drafter="lookup")) == ["lookup", "lookup", "correction"]
    assert sources(Round([1, 2, 3], drafted=2, accepted=2, drafter="feature")) == ["head", "head", "bonus"]
    assert sources(Round([1, 2], drafted=3, accepted=2, drafter="early-exit")) == ["layers", "layers"]  # cut at EOS
    assert sources(Round([7])) == ["ar"]  # the prefill's token, a plain step


def test_pieces_are_exactly_the_text_and_a_split_character_goes_to_the_token_that_completes_it():
    trace, text = Trace(Bytes()), ""
    shown = []
    for round_, released in ((Round([0]), "He"), (Round([1, 2, 3], 3, 2, "lookup"), "llo w"),
                             (Round([4, 5], 1, 1, "swift"), "é!")):
        trace.add(round_)
        shown.append(trace.cut(released))
        text += released
    assert [[(p["text"], p["source"]) for p in pieces] for pieces in shown] == [
        [("He", "ar")], [("llo", "lookup"), (" w", "lookup")], [("é", "layers"), ("!", "bonus")]]
    assert "".join(p["text"] for pieces in shown for p in pieces) == text == "Hello wé!"


def test_text_held_back_and_released_later_is_cut_where_it_lies():
    trace = Trace(Bytes())
    trace.add(Round([0, 1], 1, 1, "lookup"))
    assert trace.cut("Hel") == [{"text": "He", "source": "lookup"}, {"text": "l", "source": "bonus"}]
    trace.add(Round([2], 0, 0, None))
    assert trace.cut("lo w") == [{"text": "lo", "source": "bonus"}, {"text": " w", "source": "ar"}]
    assert trace.cut("") == []


def test_the_engine_says_who_drafted_each_round(tiny):
    model = tiny()
    prompt = torch.tensor([5, 6, 7, 8] * 4)
    stream = model.stream(prompt, method="hybrid", max_new_tokens=40, temperature=0)
    rounds = [chunk.tokens for chunk in stream]
    assert all(isinstance(r, Round) for r in rounds)
    stats = stream.stats
    assert rounds[0].drafted == 0 and rounds[0].drafter is None  # the prefill
    assert sum(r.accepted for r in rounds) == stats.accepted and sum(r.drafted for r in rounds) == stats.drafted
    assert {r.drafter for r in rounds if r.drafted} <= {"lookup", "early-exit"}  # the hybrid's two sources
    assert "lookup" in {r.drafter for r in rounds}


@pytest.fixture(scope="module")
def served():
    running = Running(tiny_served())
    yield running
    running.close()


@pytest.mark.parametrize("method", ["lookup", "hybrid"])
def test_a_traced_stream_describes_every_token_and_round(served, method):
    chunks = list(served.client().completions.create(
        model=served.name, prompt=REPEATING, max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True, "selfspec_trace": True}, extra_body={"selfspec": {"method": method}}))
    usage = chunks[-1].usage
    traced = [c.model_extra["selfspec"] for c in chunks if "selfspec" in (c.model_extra or {})]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert "".join(t["text"] for s in traced for t in s["tokens"]) == text
    assert {t["source"] for s in traced for t in s["tokens"]} <= set(SOURCES)
    rounds = [s["round"] for s in traced if "round" in s]
    assert [r["index"] for r in rounds] == list(range(len(rounds)))
    assert sum(r["emitted"] for r in rounds) == usage.completion_tokens
    spec = usage.model_extra["selfspec"]
    assert sum(r["accepted"] for r in rounds) == spec["accepted"] and sum(r["drafted"] for r in rounds) == spec["drafted"]
    assert len(rounds) - 1 == spec["rounds"]  # every round after the prefill's
    plain = served.client().completions.create(model=served.name, prompt=REPEATING, max_tokens=40, temperature=0,
                                               extra_body={"selfspec": {"method": "ar"}})
    assert text == plain.choices[0].text


def test_chat_chunks_carry_the_trace_only_when_asked(served):
    client = served.client()
    ask = dict(model=served.name, messages=[{"role": "user", "content": REPEATING}], max_tokens=20, temperature=0,
               stream=True, extra_body={"selfspec": {"method": "lookup"}})
    untraced = list(client.chat.completions.create(**ask))
    traced = list(client.chat.completions.create(**ask, stream_options={"selfspec_trace": True}))
    assert not any("selfspec" in (c.model_extra or {}) for c in untraced)
    text = "".join(c.choices[0].delta.content or "" for c in untraced)
    assert "".join(c.choices[0].delta.content or "" for c in traced) == text
    assert "".join(t["text"] for c in traced for t in c.model_extra.get("selfspec", {}).get("tokens", [])) == text


@pytest.mark.real
def test_pieces_concatenate_to_the_text_on_smollm2(smollm2):
    running = Running(smollm2)
    try:
        chunks = list(openai.OpenAI(base_url=running.url + "/v1", api_key="x").chat.completions.create(
            model=running.name, messages=[{"role": "user", "content": "Write café, naïve and 東京 twice."}],
            max_tokens=32, temperature=0, stream=True, stream_options={"selfspec_trace": True},
            extra_body={"selfspec": {"method": "lookup"}}))
    finally:
        running.close()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    pieces = [t for c in chunks for t in c.model_extra.get("selfspec", {}).get("tokens", [])]
    assert text and "".join(t["text"] for t in pieces) == text
    assert json.dumps(pieces, ensure_ascii=False).count("\ufffd") == 0
