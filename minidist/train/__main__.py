"""``python -m minidist.train``: see minidist/train/entry.py."""
from minidist.train.entry import main

main()
