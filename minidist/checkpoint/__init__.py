"""Sharded checkpoints that load into any layout (see format.py for what is on disk).

regions.py  which part of a global tensor a piece is (boxes; ZeRO's flat ranges become boxes)
format.py   the folder layout, checksums (the manifest's own too)
paths.py    what a checkpoint may touch: plain regular files inside its real folder, no links
schema.py   every field of a manifest and a rank's JSON, checked before it is used
writer.py   CheckpointWriter: each rank writes its pieces, rank 0 commits the manifest; async option
reader.py   verify, latest_valid, Checkpoint.read(name, region): assembles any region from any ranks
identity.py a run's identity: what must match for --resume (training.py uses it)
export.py   one consolidated safetensors file with GPT-2 names
"""
from minidist.checkpoint.export import export_safetensors, save_state_dict
from minidist.checkpoint.format import CheckpointError, step_dir
from minidist.checkpoint.reader import Checkpoint, latest_valid, read, read_full, verify
from minidist.checkpoint.regions import Flat, Piece, flat_boxes, full_box
from minidist.checkpoint.writer import CheckpointWriter

__all__ = ["CheckpointWriter", "Checkpoint", "CheckpointError", "Flat", "Piece", "export_safetensors",
           "flat_boxes", "full_box", "latest_valid", "read", "read_full", "save_state_dict", "step_dir", "verify"]
