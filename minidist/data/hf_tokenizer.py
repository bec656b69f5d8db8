"""Text <-> token ids with a Hugging Face ``tokenizer.json`` (GPT-2's byte-level BPE, or any other),
through the ``tokenizers`` package: an optional extra, ``pip install 'minidist[hf]'``.

Used when ``--init-from-hf DIR`` names a folder that holds a tokenizer.json: ``--data`` is then
encoded with it (in memory, at the start of each run) instead of read as bytes.
"""
import numpy as np

from minidist.untrusted import json_of, read_bounded

MAX_TOKENIZER_BYTES = 64 << 20
"""The largest tokenizer.json read: GPT-2's is 1.4 MB, the largest vocabularies' about 35 MB."""


def tokenizer_bytes(path, error=ValueError) -> bytes:
    """The bytes of tokenizer.json ``path``, read bounded (minidist/untrusted.py: a regular file of at
    most :data:`MAX_TOKENIZER_BYTES`, JSON nested at most 64 deep); ``error`` naming the file otherwise."""
    data = read_bounded(path, MAX_TOKENIZER_BYTES, "a tokenizer.json", error)
    json_of(data, path, "a tokenizer.json", error)
    return data


class HFTokenizer:
    """The tokenizer saved in ``path`` (a tokenizer.json). ``encode`` gives uint16 ids (uint32 for a
    vocabulary beyond 65536), the dtype the batches are drawn from."""

    def __init__(self, path):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ImportError(f"{path} needs the 'tokenizers' package: pip install tokenizers "
                              "(or pip install 'minidist[hf]')") from e
        try:
            self._tokenizer = Tokenizer.from_str(tokenizer_bytes(path).decode("utf-8"))
        except ValueError:
            raise
        except Exception as e:  # the Rust side raises plain Exceptions for a malformed file
            raise ValueError(f"{path}: not a tokenizer.json the tokenizers package can read ({e})") from e
        self.vocab_size = self._tokenizer.get_vocab_size()
        self.dtype = np.uint16 if self.vocab_size <= 2**16 else np.uint32

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text``, shape (n_tokens,): the text's own tokens, no special ones added (a
        tokenizer whose template adds [CLS] or <s> would otherwise put one at every chunk's start;
        ``python -m minidist.data.prepare`` encodes the same way: data/encode.py)."""
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, dtype=self.dtype)

    def decode(self, ids) -> str:
        """Text of token ids (any integer array or list)."""
        return self._tokenizer.decode([int(i) for i in np.asarray(ids).reshape(-1)])
