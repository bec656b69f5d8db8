"""The scale planner: memory, traffic and time of a training run, from minidist's own 8 processes to
10,000 GPUs on paper (``python -m minidist.plan``; tutorials/14_scale.py).

    models.py     the model by shape: minidist's GPT, GPT-2, GPT-3, Llama 3; parameters and ZeRO units
    layout.py     the run: dp x pp x cp x tp (ep), the batch, ZeRO, precision, recompute, schedule
    memory.py     bytes per rank: ZeRO's model states, Korthikanti's (or minidist's) activations
    comm.py       bytes each rank sends per step and axis, as the trace counts them
    hardware.py   H100 and A100 profiles; calibrate.py measures this machine ("local")
    timing.py     seconds per step: FLOPs, bytes, the overlap rules, the pipeline's simulator; MFU
    predict.py    all of it as one dict; search.py every layout of N devices that fits, ranked

The same quantities measured on a minidist run, to hold the two side by side, are the trainer's
(minidist/train/measure.py): the planner imports nothing of the trainer.
"""
from minidist.plan.hardware import PROFILES, Hardware
from minidist.plan.layout import RunSpec, layout_problems
from minidist.plan.models import PRESETS, ModelSpec, from_gpt_config, parameter_count, preset
from minidist.plan.predict import hardware_profile, predict
from minidist.plan.search import search

__all__ = ["PROFILES", "PRESETS", "Hardware", "ModelSpec", "RunSpec", "from_gpt_config", "hardware_profile",
           "layout_problems", "parameter_count", "predict", "preset", "search"]
