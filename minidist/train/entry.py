"""The entry point of ``python -m minidist.train``: parse the command line, start MPI, run the mode
(collective training, parameter servers, a population), say how it ended, exit with its status.

    main(argv)   parse -> init -> Run | train_ps | train_pbt | train_search -> the final line and the sample

Each mode is its own module (train/life.py, train/ps.py, train/pbt.py, train/search.py); this one only
chooses, so no mode imports another's entry. MPI is asked once which machine each rank is on, here.
"""
import os
import sys

from minidist.allocator import keep_freed_memory
from minidist.checkpoint.format import SaveStopped
from minidist.checkpoint.training import ResumeRefused
from minidist.comm import init
from minidist.comm.fault_tolerance import spawned
from minidist.comm.machines import machines_of
from minidist.comm.transport import EXIT_CONFIG, EXIT_DIVERGED
from minidist.data.tokens import DataError
from minidist.files import NoSpace, PathRefused
from minidist.launchers import leave_after_rank_0
from minidist.threads import limit_blas_threads
from minidist.train.build import sample_tokenizer
from minidist.train.cli import launcher_rank, parse_args
from minidist.train.config import ConfigError, TrainConfig, comm_timeout_problems
from minidist.train.divergence import Diverged
from minidist.train.fault_tolerant import announced
from minidist.train.folders import FolderNotShared, FoldersInUse
from minidist.train.life import Run
from minidist.train.memory import memory_available
from minidist.train.outputs import sample
from minidist.train.lineage import final_line
from minidist.train.pbt import train_pbt
from minidist.train.ps import train_ps
from minidist.train.search import final_line as search_line, train_search
from minidist.train.stopping import Stopped, Stopping, as_stop, exit_stopped, stop_line


def main(argv=None):
    """Entry point of ``python -m minidist.train``. Each message comes once, from rank 0, and every
    rank exits with the same status (2 refused, 3 a timeout, 4 a mismatch, 5 diverged, 128 + n stopped
    by signal n), so the job prints it once and ``mpiexec`` exits with it (it ORs its ranks' statuses).

    A usage error (or --help) is found before MPI starts, and MPI is not started only to say which
    rank prints it: starting it takes a while and fails where MPI is broken, where --help must still
    work. The launcher's environment says it (:func:`~minidist.train.cli.launcher_rank`, read here
    only: rank 0 prints, the others exit 2 silently); once MPI has started, it says. A stop signal
    (SIGINT, SIGTERM, SIGHUP) stops every rank at once, rank 0 saying how far the run got
    (train/stopping.py)."""
    stopping = Stopping(rank=launcher_rank(os.environ))  # the launcher's rank until MPI says
    try:
        cfg = parse_args(argv, quiet=stopping.rank != 0)
        with stopping:
            try:
                _run(cfg, stopping, sys.argv[1:] if argv is None else list(argv))
            except (Stopped, SaveStopped) as error:  # every rank, at once (SaveStopped: a peer's, met in a save)
                stop = as_stop(error)
                if stopping.rank == 0:
                    steps = cfg.steps if cfg.mode != "ps" else None  # the parameter servers count their own
                    line = stop_line(stop, stopping.done, steps, cfg.ckpt_dir, population=cfg.mode == "pbt")
                    print(f"python -m minidist.train: {line}",
                          file=sys.stderr, flush=True)
                exit_stopped(stop)
    except SystemExit as leaving:  # the others leave after rank 0 has said why (Open MPI: launchers.py)
        if stopping.rank == 0:
            raise
        leave_after_rank_0(leaving.code, os.environ)


def _run(cfg, stopping, argv):
    """:func:`main` once its stop signals are held: start MPI, train, print the result and the sample.
    ``argv``: the trainer's arguments, which a spare replica (--spares) is started with."""
    if not cfg.system_allocator:
        keep_freed_memory()  # the process's malloc setting, made here at the entry point, never by the library
    # the MPI world: under mpiexec, its ranks; run alone, a world of one. A timeout's flight record
    # lands in the run directory. init needs a valid timeout: a bad one is refused with the rest (rank 0)
    timeout = TrainConfig.comm_timeout if comm_timeout_problems(cfg) else cfg.comm_timeout
    try:
        world = init(cfg.backend, timeout=timeout, flight_dir=cfg.out or cfg.trace)
    except (ImportError, RuntimeError) as e:
        if cfg.backend != "nccl":
            raise
        print(f"python -m minidist.train: {e}", file=sys.stderr)  # no CuPy, no GPU, fewer GPUs than ranks
        sys.exit(EXIT_CONFIG)
    stopping.mpi_started(world.rank)  # its rank from now on; the stop signals taken back from MPI's start-up
    with stopping.deferred():  # MPI's shared-memory split is collective: a stop waits for it
        machines = machines_of(world)  # which machine each rank is on (MPI's shared-memory split, its names): asked once
    limit_blas_threads(os.environ.get("OMP_NUM_THREADS"), machines.host_size(world.rank),
                       announce=world.rank == 0)  # a share of its host's cores each
    try:
        if cfg.mode == "pbt":  # a population of collective runs, each a Run on its sub-group
            model, history = train_pbt(cfg, world, machines, memory_bytes=memory_available(), stopping=stopping)
        elif cfg.mode == "search":  # trials of collective runs, a few at a time, each a Run on its sub-group
            state = train_search(cfg, world, machines, memory_bytes=memory_available(), stopping=stopping)
            if world.rank == 0:
                print("\nfinal: " + search_line(state))
            return
        elif cfg.mode == "ps":
            model, history = train_ps(cfg, world, memory_bytes=memory_available())
        else:  # one run's life (train/life.py); only the last record kept
            joining = announced(world) if cfg.fault_tolerant and spawned() else None  # a spare a job started
            cfg = joining.config(cfg, new=True) if joining else cfg
            with Run(cfg, world, machines=machines, memory_bytes=memory_available(), stopping=stopping,
                     keep_history=False, command=[sys.executable, "-m", "minidist.train", *argv],
                     joining=joining) as run:
                history = run.advance(run.cfg.steps)
                run.finish()
            model, world = run.model, run.world  # (--fault-tolerant: the survivors' world, if replicas were lost)
    except (ConfigError, ResumeRefused, FoldersInUse, FolderNotShared) as e:
        if world.rank == 0:
            print(f"python -m minidist.train: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    except PathRefused as e:  # a link or FIFO planted where the run writes (minidist/files.py): on that rank
        print(f"python -m minidist.train: rank {world.rank}: {e.strerror}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    except NoSpace as e:  # a full disk, found before a memory-mapped store could meet it
        print(f"python -m minidist.train: rank {world.rank}: {e.strerror}", file=sys.stderr)
        sys.exit(1)
    except DataError as e:  # a shard changed on disk during the run (data/tokens.py): on the rank that read it
        print(f"python -m minidist.train: rank {world.rank}: --data {e}", file=sys.stderr)
        sys.exit(1)
    except Diverged as e:  # every rank, at the same step (minidist/train/divergence.py)
        if world.rank == 0:
            print(f"python -m minidist.train: {e}", file=sys.stderr)
        sys.exit(EXIT_DIVERGED)
    if world.rank == 0 and history:
        print("\nfinal: " + (final_line(history, cfg.population) if cfg.mode == "pbt" else
                             f"train loss {history[-1]['loss']:.4f}, val loss {history[-1]['val_loss']:.4f}"))
    # the sample: in a collective run every rank generates with its part of the model (the same text
    # on all; minidist/parallel/whole_model/generate.py); with parameter servers rank 0 holds the whole model
    if cfg.sample_tokens > 0 and history and cfg.mode != "pbt" and (cfg.mode != "ps" or world.rank == 0):
        pipeline = cfg.mode != "ps" and cfg.pp > 1  # the stages pass activations over the run's pp group
        pp_group = run.mesh.pp_group if pipeline else None
        model.eval()
        tokenizer = sample_tokenizer(cfg)  # the data's: bytes, a tokenizer.json, or ids alone
        text = sample(model, "The ", cfg.sample_tokens, seed=cfg.seed, pp_group=pp_group, tokenizer=tokenizer)
        if world.rank == 0:
            print("sample:\n" + text)
    if cfg.mode == "collective" and run.tolerance is not None:
        run.tolerance.leave()  # a world that shrank or grew ends together (train/fault_tolerant.py)

