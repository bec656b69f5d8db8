"""The trainer: ``python -m minidist.train``. One package, read in this order:

    entry.py           the entry point: parse, start MPI, run the mode, say how it ended
    cli.py             the command line: its flags, groups and help, parsed into a config
    config.py          the run's settings as one dataclass, and every check on them
    memory.py          whether the run fits in this machine's memory, from the config alone
    folders.py         every output path checked at start-up; the checkpoint and offload folders held
    build.py           the device, the data, this rank's model part, its state (parallel/state.py), engine
    describe.py        what a run says of its layout at the start: who holds what, ZeRO's bytes
    life.py            one run's life: its start (every check once), its steps, its stop
    loop.py            train(): a whole run's life (one step under any layout: minidist/parallel/step.py)
    feed.py            which positions of each window a rank reads, read one step ahead
    progress.py        rank 0's progress: a bar on a terminal, else a line every few seconds
    stopping.py        Ctrl-C, SIGTERM, SIGHUP: every rank stops, rank 0 says how far (exit 128 + n)
    outputs.py         metrics, exports, trace files, the sample
    divergence.py      a NaN or inf loss stops the run (exit status 5), never a checkpoint of it
    explain.py         --explain: who holds what and sends what in the first step, a rank's story
    stories.py         every rank's story gathered to rank 0, printed as what differs
    ps.py              --mode ps: the parameter-server trainer
    population.py      population-based training's rules: draws, exploit, explore
    pbt.py             --mode pbt: the population over sub-groups of the world, a Run per member
    lineage.py         what a population writes and reads back: pbt.jsonl, population files, copies
    support_matrix.py  every combination of the features, and whether it runs
    measure.py         a run's bytes and traffic measured, beside the planner's predictions
"""
from minidist.train.loop import train
from minidist.train.life import Run
from minidist.train.entry import main

__all__ = ["train", "Run", "main"]
