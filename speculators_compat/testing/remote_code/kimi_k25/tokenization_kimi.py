"""Kimi tokenizer -- the tiny test checkpoint's stand-in for the real checkpoint's
``tokenization_kimi.py`` (written by speculators_compat.testing.tiny, never imported by the library).

Like Kimi-K2 / K2.5 it is a slow ``PreTrainedTokenizer`` over a tiktoken BPE file
(``tiktoken.model``: one ``base64-bytes rank`` line per token), reached only through
``tokenizer_config.json``'s ``auto_map`` (``AutoTokenizer``); there is no ``tokenizer.json``, so
loading it needs ``trust_remote_code=True``. The base vocabulary follows the BPE file; the special
tokens take the ids after it, named by ``added_tokens_decoder`` (``[BOS]``, ``[EOS]``,
``<|media_pad|>``, ...) or ``<|reserved_token_N|>``. The tiny vocabulary has only the 256 byte tokens
(no merges) and ``num_reserved_special_tokens`` special ids.
"""

import base64
import os
from shutil import copyfile

import tiktoken
from transformers.tokenization_utils import PreTrainedTokenizer

VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}
PATTERN = r"""[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def _load_ranks(path):
    ranks = {}
    with open(path, "rb") as fh:
        for line in fh:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(
        self,
        vocab_file,
        bos_token="[BOS]",
        eos_token="[EOS]",
        unk_token="[UNK]",
        pad_token="[PAD]",
        num_reserved_special_tokens=256,
        added_tokens_decoder=None,
        **kwargs,
    ):
        self.vocab_file = vocab_file
        ranks = _load_ranks(vocab_file)
        names = {int(i): str(getattr(t, "content", t)) for i, t in (added_tokens_decoder or {}).items()}
        base = len(ranks)
        self.num_reserved_special_tokens = num_reserved_special_tokens
        self.special_tokens = {
            names.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + num_reserved_special_tokens)
        }
        self.model = tiktoken.Encoding(
            name=os.path.basename(vocab_file), pat_str=PATTERN, mergeable_ranks=ranks, special_tokens=self.special_tokens
        )
        self.decoder = {i: self.model.decode_single_token_bytes(i).decode("latin-1") for i in range(self.model.n_vocab)}
        self.encoder = {text: i for i, text in self.decoder.items()}
        super().__init__(
            bos_token=bos_token,
            eos_token=eos_token,
            unk_token=unk_token,
            pad_token=pad_token,
            added_tokens_decoder=added_tokens_decoder,
            num_reserved_special_tokens=num_reserved_special_tokens,
            **kwargs,
        )

    @property
    def vocab_size(self):
        return self.model.n_vocab

    def get_vocab(self):
        return dict(self.encoder)

    def encode(self, text, allow_special_tokens=True, **kwargs):
        if kwargs:
            return super().encode(text, **kwargs)
        if allow_special_tokens:
            return self.model.encode(text, allowed_special="all")
        return self.model.encode(text, disallowed_special=())

    def decode(self, token_ids, **kwargs):
        if kwargs:
            return super().decode(token_ids, **kwargs)
        return self.model.decode([token_ids] if isinstance(token_ids, int) else list(token_ids))

    def _tokenize(self, text, **kwargs):
        return [self.decoder[i] for i in self.encode(text)]

    def _convert_token_to_id(self, token):
        return self.encoder.get(token, self.encoder.get(str(self.unk_token)))

    def _convert_id_to_token(self, index):
        return self.decoder.get(index)

    def convert_tokens_to_string(self, tokens):
        return b"".join(t.encode("latin-1") for t in tokens).decode("utf-8", "replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        name = (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILES_NAMES["vocab_file"]
        target = os.path.join(save_directory, name)
        if os.path.abspath(self.vocab_file) != os.path.abspath(target):
            copyfile(self.vocab_file, target)
        return (target,)
