"""The gradient norm's sum of squares over GPT-2 124M's gradients: the whole-array ``(g * g).sum()``
against ``minidist.optim.clip.square_sum`` (chunks in NumPy's pairwise order), alternated in one
process, checked to give the same float to the bit.

    OMP_NUM_THREADS=1 python benchmarks/clip_sum.py [--rounds 7]
"""
import argparse
import time

import numpy as np

from minidist.optim.clip import grad_norm_sq

# GPT-2 small, untied: wte, wpe, 12 blocks (ln_1, attn, ln_2, mlp), ln_f, lm_head
BLOCK = [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,), (768,), (768,), (768, 3072), (3072,), (3072, 768),
         (768,)]
SHAPES = [(50257, 768), (1024, 768)] + BLOCK * 12 + [(768,), (768,), (50257, 768)]


def whole_array(grads) -> float:
    """The sum as the trainer computed it before: one ``g * g`` temporary per gradient."""
    total = 0.0
    for g in grads:
        total = total + (g * g).sum().astype("float64")
    return float(total)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(s, dtype=np.float32) for s in SHAPES]
    assert whole_array(grads) == grad_norm_sq(grads), "not the same float"
    times = {"whole array": [], "chunked": []}
    for _ in range(args.rounds):
        for name, fn in (("whole array", whole_array), ("chunked", grad_norm_sq)):
            start = time.perf_counter()
            fn(grads)
            times[name].append(time.perf_counter() - start)
    old, new = (float(np.median(times[k])) for k in ("whole array", "chunked"))
    print(f"{sum(g.size for g in grads):,} float32 elements: whole array {old:.3f} s, chunked {new:.3f} s "
          f"(median of {args.rounds}), chunked / whole {new / old:.2f}x, the same float to the bit")


if __name__ == "__main__":
    main()
