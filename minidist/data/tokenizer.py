"""Byte-level tokenizer: a token is one byte of the UTF-8 text, so the vocabulary has 256 entries.

No training, no merges, nothing to download: ``encode`` is ``str.encode("utf-8")`` seen as integers.
It also means a UTF-8 text file already *is* a token file (one uint8 token per byte).
"""
import numpy as np


class ByteTokenizer:
    """Text <-> token ids, one token per UTF-8 byte (ids 0..255)."""
    vocab_size = 256

    def encode(self, text):
        """Token ids of ``text`` as a uint8 array (the dtype of token files), shape (len(bytes),)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, ids):
        """Text of token ids (any integer array or list); bytes that are not valid UTF-8, and ids
        outside 0..255 (a model with a larger vocabulary can sample them), become '\\ufffd'."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        ids = np.where((ids < 0) | (ids > 255), 0xFF, ids)  # 0xFF is never valid UTF-8
        return bytes(ids.astype(np.uint8).tolist()).decode("utf-8", errors="replace")


class TokenIds:
    """No tokenizer (a shard folder of ids alone): text is the ids, written as numbers. ``encode``
    reads the numbers in a text (a prompt without any is token 0)."""

    def encode(self, text):
        """The integers in ``text`` as an int64 array ([0] when it holds none)."""
        ids = [int(word) for word in text.split() if word.isdigit()]
        return np.asarray(ids or [0], dtype=np.int64)

    def decode(self, ids):
        """``ids`` as numbers between spaces."""
        return " ".join(str(int(i)) for i in np.asarray(ids).reshape(-1))
