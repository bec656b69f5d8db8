"""Data: tokenizers, the generated default corpus, token files and shard folders (prepared once, cached), batches
and their prefetch."""
from minidist.data.corpus import default_corpus, default_data_dir, grammar_text
from minidist.data.dataset import get_batch, inputs_and_targets, load_tokens, train_val_split
from minidist.data.hf_tokenizer import HFTokenizer
from minidist.data.tokenizer import ByteTokenizer, TokenIds

__all__ = ["ByteTokenizer", "TokenIds", "HFTokenizer", "default_corpus", "default_data_dir", "grammar_text", "get_batch",
           "inputs_and_targets", "load_tokens", "train_val_split"]
