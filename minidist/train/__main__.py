"""``python -m minidist.train``: see minidist/train/loop.py."""
from minidist.train.loop import main

main()
