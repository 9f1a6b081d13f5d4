"""Incremental detokenisation equals a full decode, and stop strings cut the text exactly."""

from __future__ import annotations

import pytest

from baton.engine.tokenizer import IncrementalDetokenizer, piece_table

TEXT = ("Hello, world! Ünïcödé ☃ and emoji 🎉 work; stop here: END of the line.\n"
        "  Indented code() { return 42; }")


@pytest.fixture
def ids(tokenizer):
    return tokenizer.encode(TEXT)


def stream(tokenizer, ids, stop=(), include=False):
    d = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), list(stop), include, True)
    pieces, matched = [], None
    for t in ids:
        delta, matched = d.add(t)
        pieces.append(delta)
        if matched:
            break
    pieces.append(d.flush())
    return "".join(pieces), matched, d.text


def test_incremental_text_equals_full_decode(tokenizer, ids):
    text, matched, _ = stream(tokenizer, ids)
    assert matched is None
    assert text == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("stop,include", [("END", False), ("END", True), ("42;", False),
                                          ("o, w", False), ("🎉", False)])
def test_stop_string_cuts_exactly(tokenizer, ids, stop, include):
    full = tokenizer.decode(ids, skip_special_tokens=True)
    text, matched, final = stream(tokenizer, ids, [stop, "never-there"], include)
    cut = full.index(stop) + (len(stop) if include else 0)
    assert matched == stop
    assert text == final == full[:cut]


def test_earliest_of_several_stop_strings_wins(tokenizer, ids):
    text, matched, _ = stream(tokenizer, ids, ["code", "world"])
    assert matched == "world" and text == "Hello, "


@pytest.mark.parametrize("prompt", ["Complete this: \ufffd", "Cut: 🎉"])
def test_a_prompt_ending_in_an_incomplete_character_stays_out_of_the_output(tokenizer,
                                                                             prompt):
    """The prompt's last tokens are decoding context only, even when their text ends in
    U+FFFD (an emoji cut before its last byte, or the character itself)."""
    prompt_ids = tokenizer.encode(prompt)
    if prompt.startswith("Cut"):
        prompt_ids = prompt_ids[:-1]  # the emoji's last byte
    assert tokenizer.decode(prompt_ids).endswith("\ufffd")
    out = tokenizer.encode(" and more text")
    d = IncrementalDetokenizer(tokenizer, prompt_ids, [], False, True)
    assert "".join(d.add(t)[0] for t in out) + d.flush() == " and more text"


@pytest.fixture(scope="module")
def byte_fallback():
    """A Llama / Mistral-style SentencePiece BPE (metaspace; byte fallback: a character it
    lacks is its UTF-8 bytes as <0xNN> tokens, ordinary ones) trained here on ASCII lines,
    as a fast tokenizer."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                          normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tk.train_from_iterator(["Hello world, the quick brown fox; and more text"] * 20,
                           trainers.BpeTrainer(vocab_size=120,
                                               special_tokens=["<unk>", "<s>", "</s>"]))
    spec = json.loads(tk.to_str())
    vocab = spec["model"]["vocab"]
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    spec["model"]["byte_fallback"] = True
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_byte_fallback_pieces_join_into_characters(byte_fallback):
    ids = byte_fallback.encode("the 🎉 and 日本語 text", add_special_tokens=False)
    assert "<0xF0>" in byte_fallback.convert_ids_to_tokens(ids)
    text, matched, _ = stream(byte_fallback, ids)
    assert matched is None and text == " the 🎉 and 日本語 text"  # the prompt's context


def test_an_invalid_byte_after_byte_pieces_does_not_fail_the_request(byte_fallback):
    """A byte-fallback decoder turns a run of byte pieces into U+FFFD once an invalid byte
    joins it, so the text no longer extends what was shown ("9" then "��rain"); tokenizers'
    DecodeStream raises on that. The request goes on decoding by windows."""
    ids = byte_fallback.convert_tokens_to_ids(["<0x39>", "<0xFA>"])
    ids += byte_fallback.encode("the quick", add_special_tokens=False)  # ▁the ▁quick
    text, matched, _ = stream(byte_fallback, ids)
    assert matched is None and text.startswith("9") and text.endswith(" the quick")


@pytest.mark.parametrize("skip_special", [True, False])
def test_the_piece_table_gives_the_streaming_decoders_deltas(tokenizer, skip_special):
    """The bundled byte-level tokenizer's tokens whose text is exact on their own skip the
    streaming decoder (`piece_table`). Random ids — parts of characters, bytes that make
    no character, special tokens — give the same deltas, token by token, as the streaming
    decoder alone, with and without stop strings."""
    import random

    table = piece_table(tokenizer)
    assert table is not None and sum(p is not None for p in table) > 0.9 * len(table)
    assert all(table[i] is None for i in tokenizer.all_special_ids)
    rng = random.Random(5)
    prompt = tokenizer.encode("Say:")
    for trial in range(12):
        ids = [rng.choice(tokenizer.all_special_ids) if rng.random() < 0.05
               else rng.randrange(len(tokenizer)) for _ in range(200)]
        stop = [tokenizer.decode(ids[50:52])[-3:]] if trial % 2 else []
        fast, alone = (IncrementalDetokenizer(tokenizer, prompt, stop, False, skip_special)
                       for _ in range(2))
        alone._pieces = []  # the streaming decoder reads every token
        got = {}
        for name, d in (("fast", fast), ("alone", alone)):
            got[name] = []
            for t in ids:
                got[name].append(d.add(t))
                if got[name][-1][1] is not None:
                    break
            got[name].append((d.flush(), None))
        assert got["fast"] == got["alone"]
        assert fast.text == alone.text == "".join(delta for delta, _ in got["fast"])


def test_a_long_output_with_a_stop_string_streams_whole(tokenizer):
    """Thousands of tokens with a stop string never there: the deltas, the text held back
    and the final text all add up to the full decode."""
    ids = tokenizer.encode(TEXT * 100)
    d = IncrementalDetokenizer(tokenizer, [], ["never-there"], False, True)
    deltas = [d.add(t)[0] for t in ids]
    assert "".join(deltas) + d.flush() == d.text == tokenizer.decode(ids,
                                                                   skip_special_tokens=True)
