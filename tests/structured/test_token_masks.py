"""Token masks: the vocabulary's bytes (byte-level BPE and SentencePiece), batched masks against a
per-token check, and a request's rows with MTP drafts."""
import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from moeserve.structured.grammar import GrammarMatcher, TokenGrammar, TokenTable, token_bytes
from moeserve.structured.params import StructuredOutputsParams as SO, compile_params
from tests.checkpoints import tokenizer as tiny_tokenizer


@pytest.fixture(autouse=True)
def _builtin(builtin):  # these test the hand-written engine's byte tables; test_guidance.py the default one
    pass


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


@pytest.mark.parametrize("spec", [SO(json_object=True), SO(regex=r"(\d+|[a-z ]+)é?"), SO(choice=["hi there", "hello"])])
def test_batched_masks_equal_a_per_token_check(tok, spec):
    pieces = token_bytes(tok, len(tok))
    dfa = compile_params(spec)
    grammar = TokenGrammar(dfa, TokenTable(pieces))
    rng = random.Random(0)
    for state in rng.sample(range(1, dfa.num_states), min(40, dfa.num_states - 1)) + [0]:
        want = [p is not None and dfa.step(state, p) != 0 for p in pieces]
        assert grammar.allowed(state).tolist() == want, state


def test_rows_follow_the_drafts_and_end_tokens_need_a_match(tok):
    pieces = token_bytes(tok, len(tok))
    grammar = TokenGrammar(compile_params(SO(choice=["ab", "abc"])), TokenTable(pieces))
    ids = {p: i for i, p in enumerate(pieces) if p in (b"a", b"b", b"c", b"x")}
    eos = tok.eos_token_id
    m = GrammarMatcher(grammar)
    rows = m.row_masks([ids[b"a"]], [ids[b"b"], ids[b"x"], ids[b"c"]], [eos])
    assert rows.shape == (4, len(pieces))
    assert rows[0, ids[b"b"]] and not rows[0, eos]  # after "a": "b", not the end
    assert rows[1, ids[b"c"]] and rows[1, eos]  # after "ab": "c" or the end
    assert torch.equal(rows[2], rows[1]) and torch.equal(rows[3], rows[1])  # draft "x" breaks: never used
    # the state comes from the output tokens, so a shorter output (drafts rejected) needs no rollback
    assert m.row_masks([ids[b"a"], ids[b"b"], ids[b"c"]], [], [eos])[0].nonzero().flatten().tolist() == [eos]


def test_after_a_marker_the_pattern_applies(tok):
    pieces = token_bytes(tok, len(tok))
    grammar = TokenGrammar(compile_params(SO(choice=["yes", "no"])), TokenTable(pieces))
    ids = {p: i for i, p in enumerate(pieces) if p in (b"a", b"<", b"/", b"x", b"y", b"e", b"s", b">")}
    m = GrammarMatcher(grammar, after=b"</x>")
    eos = tok.eos_token_id
    thinking = [ids[b"a"], ids[b"<"], ids[b"/"]]  # "a</": the marker is not complete yet
    assert m.row_masks(thinking, [], [eos]) is None  # free text
    rows = m.row_masks(thinking, [ids[b"x"], ids[b">"], ids[b"y"]], [eos])
    assert rows[0].all() and rows[1].all()  # "a</x" still thinking
    assert rows[2, ids[b"y"]] and not rows[2, ids[b"a"]] and not rows[2, eos]  # after "</x>": yes | no
    assert rows[3, ids[b"e"]] and not rows[3, ids[b"y"]]
    after = thinking + [ids[b"x"], ids[b">"], ids[b"y"], ids[b"e"], ids[b"s"]]
    assert m.row_masks(after, [], [eos])[0].nonzero().flatten().tolist() == [eos]  # "yes": complete


def test_masks_are_bounded_across_the_engines_grammars(tok, monkeypatch):
    from moeserve.structured import grammar as g
    monkeypatch.setattr(g, "MASK_CACHE_BYTES", len(tok) * 20)  # 20 masks in all
    manager = g.StructuredOutputManager("unused", len(tok), tokenizer=tok)
    matchers = [manager.matcher(SO(regex=f"[a-z]{{1,{n}}}x")) for n in range(10, 16)]
    for m in matchers:  # each visits 11+ states: a budget per grammar would keep 6 x 16 masks
        for state in range(1, m.grammar.dfa.num_states):
            m.grammar.allowed(state)
    assert len(manager._masks.masks) <= 20
