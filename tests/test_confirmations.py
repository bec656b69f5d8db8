"""``--export``, ``--export-hf`` and ``--init-from-hf`` each say in one line, on rank 0 only, what they
wrote or read, where, and how many parameters (issue 36: they printed nothing).

The runs are tiny (2 layers, 16 wide) and run in this process, one or two ranks as threads.
"""
import numpy as np
import pytest

from minidist import run_local
from minidist.data import grammar_text
from minidist.model import GPT, GPTConfig
from minidist.train import train
from minidist.train.config import TrainConfig
from tests.test_hf import L, H, C, T, V, hf_config_json, hf_tensors, write_folder

RUN = dict(n_layer=2, n_head=4, n_embd=16, block_size=16, batch_size=4, steps=1, eval_every=100, eval_iters=1,
           sample_tokens=0, warmup=0, dtype="float32")


def byte_gpt() -> GPT:
    """RUN's GPT (vocabulary 256, tied embeddings)."""
    return GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=16))


def byte_gpt_parameters() -> int:
    """The parameters of RUN's GPT, counted by the model itself (the tied head once)."""
    return sum(p.data.size for p in byte_gpt().parameters())


def lines_with(out: str, start: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(start)]


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text(grammar_text(2_000, seed=1))
    return str(path)


@pytest.mark.parametrize("name, kind", [("model.npz", "NumPy .npz"), ("model.safetensors", "safetensors")])
def test_export_says_what_it_wrote_where_once_on_rank_0(tmp_path, capsys, text, name, kind):
    path = str(tmp_path / name)
    cfg = TrainConfig(**RUN, data=text, dp=2, export=path)
    run_local(lambda group: train(cfg, progress=False, world=group), world_size=2)
    said = lines_with(capsys.readouterr().out, "exported")
    n = byte_gpt_parameters()  # tied: the lm_head is the embedding, counted once
    tensors = len(byte_gpt().state_dict())  # GPT-2's names, lm_head.weight among them
    assert said == [f"exported {n:,} parameters ({tensors} tensors, float32, GPT-2 names) to {path} ({kind})"]


def test_export_hf_says_what_it_wrote_where_once_on_rank_0(tmp_path, capsys, text):
    folder = str(tmp_path / "hf")
    cfg = TrainConfig(**RUN, data=text, tp=2, export_hf=folder)
    run_local(lambda group: train(cfg, progress=False, world=group), world_size=2)
    said = lines_with(capsys.readouterr().out, "exported")
    assert said == [f"exported {byte_gpt_parameters():,} parameters (float32) as a Hugging Face GPT-2 folder: "
                    f"{folder}/config.json and model.safetensors"]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_init_from_hf_says_what_it_read_once_on_rank_0(tmp_path, capsys, text, tied):
    tensors = hf_tensors(seed=0, tied=tied)
    folder = write_folder(tmp_path / "hf", tensors, hf_config_json(tied))
    cfg = TrainConfig(**dict(RUN, n_layer=L, n_head=H, n_embd=C, block_size=T), data=text, dp=2,
                      init_from_hf=folder)
    run_local(lambda group: train(cfg, progress=False, world=group), world_size=2)
    said = lines_with(capsys.readouterr().out, "initialised from")
    n = sum(int(np.prod(v.shape)) for v in tensors.values())  # Hugging Face's file holds each parameter once
    assert said == [f"initialised from {folder}: {n:,} parameters of a Hugging Face GPT-2 ({L} layers, {H} heads, "
                    f"{C} wide, vocabulary {V}, {T} positions, " + ("tied embeddings)" if tied else "untied head)")]
