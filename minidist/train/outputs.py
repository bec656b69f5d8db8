"""What a training run leaves behind: metrics lines (strict JSON), validation losses, the ``--explain``
story, the consolidated export, the ``--trace`` run directory, and a sample of generated text.
"""
import contextlib
import io
import json
import math
from pathlib import Path

import numpy as np

from minidist.autograd import no_grad
from minidist.checkpoint import save_state_dict
from minidist.checkpoint.hf import CONFIG, WEIGHTS, write_hf
from minidist.data import ByteTokenizer, inputs_and_targets
from minidist.device import to_device
from minidist.files import create, real_folder, write_atomically
from minidist.train.stories import print_explanation
from minidist.inspect.write import step_peak_bytes, stream_trace, write_memory_report
from minidist.parallel.whole_model.consolidate import full_state_dict
from minidist.parallel.whole_model.generate import generate
from minidist.parallel.data.sampler import DistributedSampler, micro_batches
from minidist.untrusted import Unreadable, open_bounded, parse_json


def open_metrics(out, start: int = 0):
    """DIR/metrics.jsonl opened for writing (DIR created), or a no-op context when ``out`` is None.
    Resuming at step ``start``, the rows of steps before it are kept and later ones dropped (the
    resumed run writes them again), so the file reads as one uninterrupted run."""
    if out is None:
        return contextlib.nullcontext()
    path = real_folder(out) / "metrics.jsonl"
    kept = earlier_rows(path, start) if start > 0 and path.is_file() and not path.is_symlink() else []
    f = create(path, text=True)  # never through a link planted at the name
    f.write("".join(kept))
    return f


METRICS_LINE_BYTES = 1 << 20  # one step's metrics are a few hundred bytes


def earlier_rows(path, start: int) -> list[str]:
    """The lines of metrics file ``path`` of steps before ``start``, read through the one bounded
    reader, a line at a time: a line that is not a step's record (cut by a crash, garbled, over
    :data:`METRICS_LINE_BYTES`) is dropped, not trusted. None of a file that is not a regular one."""
    kept = []
    try:
        with open_bounded(path, follow_links=False) as f:
            for line in iter(lambda: f.readline(METRICS_LINE_BYTES), b""):
                try:
                    row = parse_json(line)
                except ValueError:
                    continue
                if isinstance(row, dict) and type(row.get("step")) is int and row["step"] < start:
                    kept.append(line.decode().rstrip("\n") + "\n")
    except Unreadable:
        return []  # (create refuses a FIFO or a link at the name itself)
    return kept


TIMINGS = ("tokens_per_s", "data_wait_s")  # the metrics that are measured times: they differ from run to run


def metrics_line(record: dict) -> str:
    """One line of metrics.jsonl: ``record`` as strict JSON (RFC 8259 has no NaN nor Infinity, so a
    diverged step's non-finite numbers are written as ``null``), ending in a newline."""
    return json.dumps(finite_or_null(record), allow_nan=False) + "\n"


def finite_or_null(value):
    """``value`` with every NaN or +-inf float inside it (dicts, lists, tuples) replaced by None."""
    if isinstance(value, dict):
        return {key: finite_or_null(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def trace_file(cfg, trace):
    """``--trace DIR``: a context inside which every event ``trace`` records goes to
    DIR/trace/rank<r>.jsonl as it happens, in the compact format (``comm/trace_events.py``: about 50
    bytes an event; each rank its own file; nothing sent), so the in-memory
    trace can stay a short ring however long the run. The file starts with the events the trace
    still keeps when the context opens (with ``init()``'s ring of ``KEEP_RECENT``: every call since
    ``init``, unless more came before the loop). A no-op context without ``--trace``."""
    return stream_trace(cfg.trace, trace) if cfg.trace is not None else contextlib.nullcontext()


def estimate_val_loss(model, val_tokens, cfg, engine=None, spans=None):
    """Mean loss over ``cfg.eval_iters`` validation batches, the same batches at every evaluation
    (through the pipeline ``engine``'s forward-only schedule when there is one). Every rank evaluates
    every row (so each gets the loss one process gets, bitwise), and reads of each window only the
    positions ``spans`` it uses (train/feed.py's ``rank_spans``; None: whole windows)."""
    rows = DistributedSampler(val_tokens, cfg.batch_size, cfg.block_size, cfg.seed, 0, 1, spans=spans)  # all rows
    model.eval()
    with no_grad():
        losses = []
        for i in range(cfg.eval_iters):
            batch = to_device(rows.batch(i), cfg.device)  # (B, T+1), zero where this rank reads nothing
            if engine is not None:
                losses.append(engine.evaluate(micro_batches(batch, cfg.micro_batches)))
            else:
                idx, targets = inputs_and_targets(batch)
                losses.append(model(idx, targets)[1].item())
    model.train()
    return float(np.mean(losses))


def explain_step(mesh, model, events, batch_shape, state):
    """``--explain``: every rank's story of the step just run, printed by rank 0 in rank order
    (collective over the world), with what the model's ``state`` says of itself (parallel/state.py):
    under ZeRO-3 the shards it keeps, under offload what it moved between device, host and disk."""
    print_explanation(mesh, model, events, batch_shape=batch_shape, **state.explained())


def write_outputs(cfg, model, state, mesh, quiet=False):
    """``--export``: the consolidated full state_dict (collective over the mesh, ZeRO-3's parameters
    gathered first; written by global rank 0) as .npz, or as safetensors when the path ends in
    ``.safetensors``. ``--export-hf DIR``: the same state_dict as a Hugging Face GPT-2 folder
    (DIR/config.json, DIR/model.safetensors: :func:`~minidist.checkpoint.hf.write_hf`), from the same
    one consolidation. ``--trace DIR``: this rank's memory rows for ``python -m minidist.inspect DIR``,
    the bytes held after the last step and the most held during it (``peak``: step_peak_bytes) (each
    rank writes its own file; :func:`trace_file` has written its events during the loop). Under
    mixed precision the exports hold the float32 masters (``state.full_parameters``: the model's
    state, parallel/state.py). ``quiet``: the exports say nothing."""
    if cfg.export is not None or cfg.export_hf is not None:
        with state.full_parameters():
            full = full_state_dict(model, mesh)
        if mesh.rank == 0 and cfg.export is not None:
            export(full, cfg.export, model.config, quiet)
        if mesh.rank == 0 and cfg.export_hf is not None:
            write_hf(cfg.export_hf, full, model.config)
            if not quiet:
                print(f"exported {parameter_count(full, model.config):,} parameters ({dtype_of(full)}) as a "
                      f"Hugging Face GPT-2 folder: {cfg.export_hf}/config.json and model.safetensors", flush=True)
    if cfg.trace is not None:
        held = state.held_bytes()
        write_memory_report(cfg.trace, mesh.rank, [dict(label="after last step", **held,
                                                        peak=step_peak_bytes(mesh.world.trace, held))])


def final_exports(cfg, folder) -> dict:
    """Where a run among several (a population member, a search trial) writes its final model for
    ``--export`` / ``--export-hf``: in its own ``folder``, in the format the asked path names
    ({TrainConfig field: path})."""
    found = {}
    if cfg.export is not None:
        found["export"] = str(Path(folder) / ("final.safetensors" if cfg.export.endswith(".safetensors") else "final.npz"))
    if cfg.export_hf is not None:
        found["export_hf"] = str(Path(folder) / "final-hf")
    return found


def copy_final_model(cfg, folder) -> dict:
    """The final model that a run among several wrote in ``folder`` (:func:`final_exports`) copied to
    ``--export`` and ``--export-hf``, each file atomically, never through a link: {flag: (from, to)}.
    The caller is rank 0 of the world; sends nothing."""
    copied = {}
    for field, written in final_exports(cfg, folder).items():
        asked = getattr(cfg, field)
        if field == "export":
            write_atomically(real_folder(Path(asked).parent) / Path(asked).name, Path(written).read_bytes())
        else:
            for name in (WEIGHTS, CONFIG):
                write_atomically(real_folder(asked) / name, (Path(written) / name).read_bytes())
        copied["--" + field.replace("_", "-")] = (written, asked)
    return copied


def export(state: dict, path: str, config, quiet: bool = False) -> None:
    """Write a full state_dict ({GPT-2 name: array}) of the GPT of ``config`` to ``path``:
    safetensors when it ends in ``.safetensors``, else .npz (NumPy's zip of arrays; neither
    pickles); then, unless ``quiet``, print one line saying what was written where (the caller is
    global rank 0)."""
    real_folder(Path(path).parent)
    if path.endswith(".safetensors"):
        save_state_dict(state, path)
    else:
        data = io.BytesIO()
        np.savez(data, **state)
        write_atomically(path, data.getvalue())  # the old file or the whole new one; a link replaced, not followed
    kind = "safetensors" if path.endswith(".safetensors") else "NumPy .npz"
    if not quiet:
        print(f"exported {parameter_count(state, config):,} parameters ({len(state)} tensors, {dtype_of(state)}, "
              f"GPT-2 names) to {path} ({kind})", flush=True)


def parameter_count(state: dict, config) -> int:
    """The elements of a full state_dict, a tied ``lm_head.weight`` counted once (as the model does)."""
    tied = getattr(config, "tie_embeddings", False) and "lm_head.weight" in state
    return sum(int(v.size) for v in state.values()) - (int(state["lm_head.weight"].size) if tied else 0)


def dtype_of(state: dict) -> str:
    """The dtype(s) of a state_dict's arrays, in words ("float32")."""
    return "/".join(sorted({np.dtype(v.dtype).name for v in state.values()}))


def sample(model, prompt, max_new_tokens, seed=0, pp_group=None, tokenizer=None):
    """Text generated by ``model`` after ``prompt`` (temperature 0.8, top-k 20): the whole GPT, or
    this rank's part of it in any layout (``pp_group``: the mesh's, with pipeline parallelism).
    Collective over the mesh: every rank calls it and gets the same text, one process's text (see
    minidist/parallel/whole_model/generate.py for what each token sends). ``tokenizer`` encodes the prompt and
    decodes the text (None: the byte tokenizer)."""
    tok = tokenizer if tokenizer is not None else ByteTokenizer()
    idx = tok.encode(prompt).astype(np.int64)[None, :]                                    # (1, T)
    out = generate(model, idx, max_new_tokens, temperature=0.8, top_k=20, rng=np.random.default_rng(seed),
                   pp_group=pp_group)
    return tok.decode(out[0])
