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


MULTIBYTE = "a€b naïve 日本"


def offsets_of(tok, params, outputs):
    """Feed the processor outputs (lists of token ids); the text and the text_offsets of every token."""
    proc = OutputProcessor(tok)
    proc.add("r", params, prompt_len=0)
    text, offsets = "", []
    for i, ids in enumerate(outputs):
        d, _ = proc.process(EngineCoreOutput("r", ids, finish_reason="length" if i == len(outputs) - 1 else None))
        text += d.text
        offsets += d.text_offsets
        if d.finished:
            break
    return text, offsets


def test_text_offsets_count_characters_of_the_text_across_split_multibyte_characters(tok):
    # Offsets built from per-token strings drifted: each byte of a split character decodes alone to U+FFFD
    # (one character each), so every token after "€" (3 byte tokens) was placed 2 characters too far.
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    assert [tok.decode([i]) for i in ids[1:4]] == ["\ufffd"] * 3  # "€": three tokens of one byte each
    want = [0, 1, 1, 1, 2, 3, 5, 6, 6, 7, 9, 10, 10, 10, 11, 11, 11]  # a €€€ b " n" a ïï ve " " 日日日 本本本
    text, offsets = offsets_of(tok, SamplingParams(logprobs=0), [[i] for i in ids])
    assert text == MULTIBYTE and offsets == want
    # the slices between offsets are what each token added, and they make up the text
    assert "".join(text[a:b] for a, b in zip(offsets, offsets[1:] + [len(text)])) == text
    # several tokens in one output (MTP) get the same offsets
    assert offsets_of(tok, SamplingParams(logprobs=0), [ids[:3], ids[3:9], ids[9:]]) == (text, want)
    # the prompt side (echo) computes the same by its own linear-time route
    from moeserve.entrypoints.serving_completion import token_offsets
    assert token_offsets(tok.decode, ids) == (want, len(text))
    # a stop string cut: the tokens that made it start at most at the text's end
    text, offsets = offsets_of(tok, SamplingParams(logprobs=0, stop=["ïve"]), [ids[:7], ids[7:]])
    assert text == "a€b na" and offsets == want[:7] + [6, 6, 6]
    assert offsets_of(tok, SamplingParams(), [[i] for i in ids])[1] == []  # only logprobs requests pay for them
