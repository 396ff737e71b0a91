"""Token masks: the vocabulary's bytes (byte-level BPE and SentencePiece), llguidance's masks against a
per-token check by independent oracles (the regex module, a choice's strings), and the engine's bounded
grammar cache. A request's rows with MTP drafts, stop tokens and a thinking marker: test_guidance.py."""
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from moeserve.structured.grammar import StructuredOutputManager, token_bytes
from moeserve.structured.params import StructuredOutputsParams as SO, compile_params
from tests.checkpoints import tokenizer as tiny_tokenizer
from tests.structured.oracle import regex_full, regex_prefix


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_byte_level_pieces_are_what_decoding_writes(tok):
    pieces = token_bytes(tok, len(tok) + 5)
    assert pieces[-5:] == [None] * 5  # padded model vocabulary: never generated
    for i in tok.all_special_ids:
        assert pieces[i] is None
    for i in range(len(tok)):
        text = tok.decode([i])
        if pieces[i] is not None and "\ufffd" not in text:
            assert pieces[i] == text.encode("utf-8"), i
    assert any(p and len(p) > 1 and p[0] == 0x20 for p in pieces)  # leading-space tokens keep their space


def test_sentencepiece_pieces_map_the_space_marker_and_byte_fallback():
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<0x41>": 3, "<0xE2>": 4, "\u2581hi": 5, "a": 6, "\u2581": 7}
    raw = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    assert token_bytes(tok, 8) == [None, None, None, b"A", b"\xe2", b" hi", b"a", b" "]


@pytest.mark.parametrize("spec,exact", [
    (SO(regex=r"(\d+|[a-z ]+)é?"), True), (SO(regex=r"[a-f]{2,6}-\d{2}"), True),
    (SO(regex=r"\w+@[\w.]+\.(com|org)"), True), (SO(choice=["hi there", "hello", "hé"]), False)])
def test_masks_equal_a_per_token_check(tok, spec, exact):
    """Along random valid outputs, every row allows exactly the tokens whose bytes keep the output a prefix of
    a match (the `regex` module's partial match decides; for a choice, a prefix of one of its strings), and
    the end token exactly where the output matches. Where the grammar forces the next bytes (the rest of a
    choice's literal) llguidance allows only the tokens of their canonical tokenization ("he" + "ll", never
    "he" + "l"): a subset, never empty."""
    if spec.regex is not None:
        prefix = lambda text: regex_prefix(spec.regex, text, extra="é")  # noqa: E731
        full = lambda text: regex_full(spec.regex, text)  # noqa: E731
    else:
        prefix = lambda text: any(c.encode().startswith(text) for c in spec.choice)  # noqa: E731
        full = lambda text: text in [c.encode() for c in spec.choice]  # noqa: E731
    manager = StructuredOutputManager("unused", len(tok) + 3, tokenizer=tok)  # a padded model vocabulary
    pieces = token_bytes(tok, len(tok) + 3)
    eos = tok.eos_token_id
    rng = random.Random(0)
    m = manager.matcher(spec, compile_params(spec).to_bytes())
    for _ in range(6):
        out, text = [], b""
        for _ in range(12):
            row = m.row_masks(out, [], [eos])[0]
            want = [p is not None and prefix(text + p) for p in pieces]
            want[eos] = full(text)
            if exact:
                assert row.tolist() == want, (spec, text)
            else:
                assert row[eos] == want[eos] and all(want[t] for t in row.nonzero().flatten().tolist())
                assert row.any() == any(want), (spec, text)
            choices = [t for t, ok in enumerate(row.tolist()) if ok and t != eos]
            if not choices:
                break
            t = rng.choice(choices)
            out.append(t)
            text += pieces[t]


def test_the_engine_holds_a_bounded_number_of_grammars(tok):
    manager = StructuredOutputManager("unused", len(tok), tokenizer=tok)
    for n in range(70):
        manager.matcher(SO(regex=f"[a-z]{{1,{n + 1}}}x"))
    assert len(manager._checked) == 64 and len(manager._guidance.templates) <= 64
