"""Stop strings against the bundled model's real tokenizer: streamed deltas add up to the final text."""
import pytest
from transformers import AutoTokenizer

from moeserve.engine.output_processor import OutputProcessor
from moeserve.models.default import BUNDLED
from moeserve.protocol import EngineCoreOutput
from moeserve.sampling_params import SamplingParams

TEXT = 'def add(a, b):\n    """Return the sum of a and b."""\n    return a + b\n'


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(BUNDLED)


def stream(tok, params, ids):
    proc = OutputProcessor(tok)
    proc.add("r", params, prompt_len=0)
    deltas, hit = [], False
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        d, hit = proc.process(EngineCoreOutput("r", [t], finish_reason="length" if last else None))
        deltas.append(d.text)
        if d.finished:
            return deltas, d
    raise AssertionError("never finished")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_over_several_tokens_never_retracts_streamed_text(tok, include):
    ids = tok.encode(TEXT, add_special_tokens=False)
    pieces = [tok.decode(ids[:i + 1]) for i in range(len(ids))]
    # A stop string that starts inside one token and ends in a later one.
    k = next(i for i in range(1, len(ids)) if len(pieces[i]) - len(pieces[i - 1]) >= 3 and i + 2 < len(ids))
    start = len(pieces[k]) - 2
    stop = pieces[-1][start:start + 5]
    assert len(stop) == 5 and TEXT.find(stop) == start
    deltas, final = stream(tok, SamplingParams(stop=[stop], include_stop_str_in_output=include), ids)
    want = TEXT[: start + (len(stop) if include else 0)]
    assert "".join(deltas) == want
    assert final.final.text == want and final.finish_reason == "stop" and final.stop_reason == stop


def test_without_stop_strings_nothing_is_held_back(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    deltas, final = stream(tok, SamplingParams(), ids)
    assert "".join(deltas) == TEXT and all(deltas[:-1]) or "".join(deltas) == TEXT
    assert "".join(deltas[:3]) == tok.decode(ids[:3]).rstrip("\ufffd")
