"""Lesson 20: a character model on your own text, nanoGPT's way, with its dropout.

    python tutorials/20_character_model.py                             (the generated corpus, a short run)
    python tutorials/20_character_model.py --text input.txt            (your text file, the same short run)
    python tutorials/20_character_model.py --text input.txt --recipe   (nanoGPT's CPU recipe: 2,000 steps)
    python tutorials/20_character_model.py --png char.png              (also draw the losses and a dropout mask)

nanoGPT's first model is a character-level GPT on Shakespeare (data/shakespeare_char/prepare.py, then
config/train_shakespeare_char.py). Its prepare.py takes a text's characters, sorted, as the vocabulary,
writes the first 90% as train.bin and the rest as val.bin (uint16 ids) and the vocabulary as meta.pkl.
``python -m minidist.train --data DIR`` reads that folder (meta.pkl through an unpickler that allows no
class), and takes nanoGPT's knobs with nanoGPT's meanings: ``--beta1``, ``--beta2``, ``--no-bias`` and
``--dropout P``, which drops where nanoGPT's model.py does: after the token + position embeddings, on
the attention probabilities, after the attention's and after the MLP's output projections (kept
values scaled by 1/(1-p)), in training steps only: evaluation and sampling drop nothing.

nanoGPT draws its masks from PyTorch's random state, so another layout would draw others. minidist's
mask of an element is a hash of (seed, step, layer, site, the element's global row, head, positions,
channel) (minidist/nn/dropout.py): every layout, recomputation and a resumed run draw the masks one
process draws, so a layout with dropout still equals one process.

  1. Prepare: your text into nanoGPT's train.bin, val.bin and meta.pkl, and read back by minidist.
  2. Dropout's masks do not depend on the layout: dp 2 x tp 2 (4 thread ranks) with --dropout 0.2
     equals one process to 1e-10, and evaluation drops nothing.
  3. Train, nanoGPT's way: the losses every 250 steps (its eval_interval), then a sample of text.
  4. How the numbers compare with nanoGPT's recipe: the loss, and where the step's time is compared.
"""
import argparse
import pickle
import tempfile
from pathlib import Path

import numpy as np

import minidist
from minidist.data import grammar_text
from minidist.data.folder import open_corpus
from minidist.data.meta_pkl import CharVocabulary
from minidist.launch_check import check_launch
from minidist.model import GPT, GPTConfig
from minidist.nn.dropout import Dropout, DropoutKey
from minidist.train import Run, train
from minidist.train.cli import parse_args
from minidist.train.config import TrainConfig
from minidist.train.outputs import sample
from minidist.untrusted import Unreadable, read_bounded

# nanoGPT's config/train_shakespeare_char.py with its README's CPU changes (--device=cpu --compile=False
# --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
# --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0), flag for flag
RECIPE = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12, steps=2000, lr=1e-3, min_lr=1e-4,
              warmup=100, beta1=0.9, beta2=0.99, weight_decay=0.1, grad_clip=1.0, no_bias=True, dropout=0.0,
              eval_every=250, eval_iters=20)
COMMAND = ("python -m minidist.train --data DIR --n-layer 4 --n-head 4 --n-embd 128 --block-size 64 --batch-size 12 "
           "--steps 2000 --lr 1e-3 --min-lr 1e-4 --warmup 100 --beta2 0.99 --no-bias --dropout 0.0 --eval-every 250 "
           "--eval-iters 20")  # RECIPE as flags (beta1, weight decay and clipping: minidist's defaults are nanoGPT's)
SHORT = dict(RECIPE, n_layer=2, n_embd=32, block_size=32, steps=500, dropout=0.2)  # the lesson's run: seconds
NANOGPT_VAL_LOSS = 1.88  # nanoGPT's README: its CPU recipe on Shakespeare, after 2,000 iterations
MAX_TEXT = 64 << 20  # bytes of --text read at most


def part1(text: str, root: Path) -> Path:
    print("=== 1. prepare, as nanoGPT's data/shakespeare_char/prepare.py does ===")
    chars = sorted(set(text))  # the vocabulary: every character of the text, sorted
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    n = int(len(ids) * 0.9)  # the first 90% train, the rest validation
    folder = root / "char"
    folder.mkdir()
    ids[:n].tofile(folder / "train.bin")
    ids[n:].tofile(folder / "val.bin")
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)
    corpus = open_corpus(folder)  # what --data reads
    shown = "".join(chars).encode("unicode_escape").decode()
    print(f"  {len(text):,} characters, vocabulary of {len(chars)}: {shown[:70]}{' ...' if len(shown) > 70 else ''}")
    print(f"  train.bin {n:,} ids, val.bin {len(ids) - n:,} ids (uint16), meta.pkl")
    assert corpus.vocab_size == len(chars) and np.array_equal(np.asarray(corpus.train[:]), ids[:n])
    assert np.array_equal(np.asarray(corpus.val[:]), ids[n:])
    print(f"  --data {folder.name}: minidist reads the same ids and the vocabulary of meta.pkl")
    return folder


def quietly(cfg, world=None) -> list[dict]:
    """Every step's record of ``cfg``'s run on ``world`` (None: one process), printing nothing: one run's
    life (minidist/train/life.py), its steps all advanced."""
    with Run(cfg, world, quiet=True, progress=False) as run:
        return run.advance(cfg.steps)


def part2(folder: Path):
    print("\n=== 2. dropout's masks are the element's, not the layout's ===")
    run = dict(n_layer=2, n_head=4, n_embd=32, block_size=32, batch_size=8, steps=3, eval_every=100, eval_iters=1,
               sample_tokens=0, dtype="float64", dropout=0.2, data=str(folder), optimizer="sgd", lr=0.1)
    one = [r["loss"] for r in quietly(TrainConfig(**run))]
    layout = TrainConfig(**run, dp=2, tp=2)
    four = [r["loss"] for r in minidist.run_local(lambda g: quietly(layout, g), 4)[0]]
    plain = [r["loss"] for r in quietly(TrainConfig(**{**run, "dropout": 0.0}))]
    print(f"  one process, --dropout 0.2:  losses {', '.join(f'{x:.10f}' for x in one)}")
    print(f"  dp 2 x tp 2 (4 ranks):       losses {', '.join(f'{x:.10f}' for x in four)}")
    print(f"  --dropout 0 (no masks):      losses {', '.join(f'{x:.10f}' for x in plain)}")
    assert all(abs(a - b) <= 1e-10 * b for a, b in zip(four, one)) and plain != one
    print("  the 4 ranks (each its rows and its heads) dropped what one process dropped: equal to 1e-10")
    model = GPT(GPTConfig(n_layer=1, n_head=4, n_embd=32, block_size=32, vocab_size=16), dtype="float64")
    idx = np.arange(64).reshape(2, 32) % 16
    key = DropoutKey(0.2, 0, 0, (0, 1), 32)
    evaluated = [model(idx, idx)[1].item() for _ in range(2)]  # no key: evaluation, sampling
    trained = model(idx, idx, key)[1].item()
    assert evaluated[0] == evaluated[1] != trained
    print(f"  a forward without a step's key (evaluation, sampling) drops nothing: {evaluated[0]:.6f} twice; "
          f"a training forward: {trained:.6f}")


def part3(folder: Path, settings: dict, text: str):
    print(f"\n=== 3. train: {settings['steps']:,} steps, the losses every {settings['eval_every']} ===")
    cfg = TrainConfig(**settings, data=str(folder), sample_tokens=0)
    model, history = train(cfg, progress=False)  # prints the train and validation losses every eval_every steps
    evaluated = [r for r in history if "val_loss" in r]
    assert [r["step"] + 1 for r in evaluated] == [s for s in range(1, cfg.steps + 1)
                                                 if (s - 1) % cfg.eval_every == 0 or s == cfg.steps]
    vocabulary = CharVocabulary(sorted(set(text)))
    prompt = "\n" if "\n" in vocabulary.stoi else text[0]  # nanoGPT's sample.py starts from "\n"
    model.eval()
    print("sample (temperature 0.8, top-k 20):\n" + sample(model, prompt, 300, seed=cfg.seed, tokenizer=vocabulary))
    return cfg, history


def part4(cfg, history, recipe: bool, given: bool):
    print("\n=== 4. against nanoGPT's recipe ===")
    final = history[-1]["val_loss"]
    print(f"  nanoGPT, CPU recipe on Shakespeare (1.1M characters, 65 symbols): val loss ~{NANOGPT_VAL_LOSS} after "
          f"2,000 iterations (its README)")
    print(f"  this run: val loss {final:.4f} after {cfg.steps:,} steps, {cfg.n_layer} layers x {cfg.n_embd} wide, "
          f"block {cfg.block_size}, batch {cfg.batch_size}, dropout {cfg.dropout}")
    if recipe and given:
        print("  the same recipe flag for flag: on nanoGPT's input.txt the two should land close to each other "
              "(the initial weights and the batches are drawn differently, so not on the same digits)")
    else:
        print("  not comparable digit for digit: " + ("another text (a loss per character depends on the text), "
              if not given else "") + ("a smaller, shorter run; --recipe runs nanoGPT's" if not recipe else ""))
    step_ms = 1e3 * cfg.batch_size * cfg.block_size / float(np.median([r["tokens_per_s"] for r in history]))
    print(f"  a training step here: {step_ms:.1f} ms, this run's median (measured, never asserted: it varies with the "
          "machine and its load).\n  nanoGPT's loop beside minidist's trainer, the recipe on the same cores: "
          "benchmarks/nanogpt_recipe.py (on a 2-core AMD EPYC,\n  0.97x nanoGPT's step on one thread and 0.99x with "
          "--dp 2 against its 2 threads: benchmarks/RESULTS.md)")
    assert parse_args(COMMAND.split()[3:]) == TrainConfig(**RECIPE, data="DIR")
    print(f"  nanoGPT's recipe from the command line (--dropout 0.2 is its GPU config's):\n    {COMMAND}")


def draw_png(path: str, history, cfg):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, mask_ax) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw=dict(width_ratios=[1.6, 1]))
    loss_ax.plot([r["step"] + 1 for r in history], [r["loss"] for r in history], lw=0.8, alpha=0.6, label="train loss")
    evaluated = [r for r in history if "val_loss" in r]
    loss_ax.plot([r["step"] + 1 for r in evaluated], [r["val_loss"] for r in evaluated], "o-", label="val loss")
    loss_ax.axhline(NANOGPT_VAL_LOSS, color="grey", ls=":", label=f"nanoGPT's CPU recipe on Shakespeare ({NANOGPT_VAL_LOSS})")
    loss_ax.set_xlabel("step"), loss_ax.set_ylabel("loss per character (nats)")
    loss_ax.set_title(f"{cfg.n_layer} layers x {cfg.n_embd}, dropout {cfg.dropout}: evaluated every {cfg.eval_every}",
                      fontsize=10, loc="left")
    loss_ax.legend(fontsize=9)
    T = 16
    keep = Dropout(DropoutKey(0.2, cfg.seed, 0, (0,), T), np.arange(T), range(4)).attention(0).scaled_keep(
        range(T), range(T), np.zeros(1))[0, 0]  # row 0, head 0: (T, T)
    shown = np.where(np.tril(np.ones((T, T))) > 0, (keep > 0).astype(float), np.nan)
    mask_ax.imshow(shown, cmap="RdYlGn", vmin=0, vmax=1)
    mask_ax.set_xlabel("key position"), mask_ax.set_ylabel("query position")
    mask_ax.set_title("Attention dropout (p = 0.2) of step 0, row 0, head 0, block 0\n(green kept x1/(1-p), red "
                      "dropped; every layout draws it)", fontsize=10, loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nwrote {path}")


def read_text(parser, path) -> tuple[str, bool]:
    """The text to train on: ``path``'s (UTF-8), or the generated corpus; whether it was given."""
    if path is None:
        return grammar_text(300_000, seed=1), False
    try:
        text = read_bounded(path, MAX_TEXT, "a text file to train on").decode("utf-8")
    except (Unreadable, UnicodeDecodeError) as e:
        parser.error(f"--text {e}" if isinstance(e, Unreadable) else f"--text {path}: not UTF-8 text ({e.reason})")
    if len(set(text)) < 2 or len(text) < 20 * (SHORT["block_size"] + 1):
        parser.error(f"--text {path}: {len(text):,} characters of {len(set(text))} kinds: too little to train on "
                     f"(at least {20 * (SHORT['block_size'] + 1):,} characters, of 2 kinds or more)")
    if len(set(text)) > 65536:
        parser.error(f"--text {path}: {len(set(text)):,} kinds of characters: nanoGPT's uint16 ids hold 65,536")
    return text, True


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--text", help="a UTF-8 text file to train on (default: the generated corpus)")
    parser.add_argument("--recipe", action="store_true", help="nanoGPT's CPU recipe in full: 4 layers x 128, "
                        "2,000 steps (minutes, not seconds)")
    parser.add_argument("--png", help="draw the losses and one attention dropout mask into this file")
    args = parser.parse_args()
    check_launch(parser, args, mpiexec=False)
    text, given = read_text(parser, args.text)
    settings = RECIPE if args.recipe else SHORT
    if args.recipe and len(text) < 20 * (settings["block_size"] + 1):
        parser.error(f"--text {args.text}: too little text for --recipe's block of {settings['block_size']}")
    with tempfile.TemporaryDirectory(prefix="minidist-lesson19-") as tmp:
        folder = part1(text, Path(tmp))
        part2(folder)
        cfg, history = part3(folder, settings, text)
        part4(cfg, history, args.recipe, given)
        if args.png:
            draw_png(args.png, history, cfg)
    print("\nTry:\n  1. --text with any book as plain text (Project Gutenberg's), and --recipe: nanoGPT's recipe on it\n"
          "  2. SHORT with dropout=0.0: the same run without masks; compare its train and val losses with these\n"
          "  3. mpiexec -n 4 python -m minidist.train --data DIR --dp 2 --tp 2 --dropout 0.2 ...: the same run, "
          "the same masks")
    print("\nDropout drew the same masks in every layout, and evaluation drew none. All checks passed.")


if __name__ == "__main__":
    main()
