"""A word-level tokenizer built locally from a token list (nothing is downloaded)."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]


def build_tokenizer(tokens: Sequence[str]) -> PreTrainedTokenizerFast:
    """Specials first (pad=0, bos=1, eos=2, unk=3), then `tokens` in order; whitespace-split."""
    dupes = {t for t in tokens if list(tokens).count(t) > 1} | (set(tokens) & set(SPECIAL_TOKENS))
    if dupes:
        raise ValueError(f"tokenizer vocabulary repeats or shadows tokens: {sorted(dupes)}")
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *tokens])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
    )
