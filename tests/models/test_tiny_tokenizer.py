"""The tiny model's word-level tokenizer (built in memory and as saved)."""
from transformers import AutoTokenizer

from rlctl.demo.tiny import SPECIAL_TOKENS, SYMBOLS, build_tokenizer

PAD, BOS, EOS, UNK = 0, 1, 2, 3
D = {str(d): 4 + d for d in range(10)}  # digits follow the four special tokens
EQ = 14


def _check(tok):
    assert len(tok) == len(SPECIAL_TOKENS) + len(SYMBOLS) == 19
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (
        PAD, BOS, EOS, UNK)
    assert tok.padding_side == "left"
    text = "3 1 4 1 5 ="
    ids = tok(text)["input_ids"]
    assert ids == [BOS, D["3"], D["1"], D["4"], D["1"], D["5"], EQ]
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids) == "<bos> " + text
    assert tok("1 1 3", add_special_tokens=False)["input_ids"] == [D["1"], D["1"], D["3"]]
    assert tok.decode([D["1"], D["2"], EOS, PAD, PAD], skip_special_tokens=True) == "1 2"
    assert tok("7 x =")["input_ids"] == [BOS, D["7"], UNK, EQ]
    assert tok("+ - * :")["input_ids"] == [BOS, 15, 16, 17, 18]


def test_tokenizer_in_memory():
    _check(build_tokenizer())


def test_tokenizer_saved_and_reloaded(tiny_dir):
    _check(AutoTokenizer.from_pretrained(tiny_dir))


def test_left_padding_batch():
    tok = build_tokenizer()
    enc = tok(["3 1 4 1 5 =", "2 ="], padding=True)
    assert enc["input_ids"][1] == [PAD, PAD, PAD, PAD, BOS, D["2"], EQ]
    assert enc["attention_mask"][1] == [0, 0, 0, 0, 1, 1, 1]
    assert enc["attention_mask"][0] == [1] * 7
