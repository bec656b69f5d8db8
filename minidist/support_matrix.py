"""``python -m minidist.support_matrix``: print the README's support matrix (the table is made in
minidist/train/support_matrix.py, with the trainer it describes)."""
from minidist.train.support_matrix import markdown

if __name__ == "__main__":
    print(markdown())
