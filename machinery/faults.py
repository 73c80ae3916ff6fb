"""How a run fails: one line and an exit status for every fault, and what is saved (docs/faults.md).

train.py and evaluate.py call the algorithm; this file is what surrounds it when something goes
wrong, so that the paper's path reads without it:

    exit_status(body, debug)          runs train.py's body and turns what it raises into one line
                                      and an exit status: 0 done (or interrupted during RL: saved),
                                      1 a failure (non-finite training, an unexpected exception or
                                      user code calling sys.exit: the phase named; --debug adds
                                      the traceback), 2 a bad config
                                      or input (ConfigError), 130 interrupted outside the RL loop
    StopRequest                       SIGINT/SIGTERM as a flag the warm start and the RL step check
                                      between micro-batches (stop_if_signalled) and the sampler
                                      between tokens (stop_point), or at once (`immediate`) elsewhere
    until_signalled                   a step's micro-batches, each after that check (train.py's
                                      warm start and update iterate through it)
    all_ranks_stop_together           around the sampling: a rank's own stop_point becomes every
                                      rank's stop, after the sampler, at one check
    rank0_interruptible(fn, stop)     rank 0 alone runs fn (an evaluation), every rank learns of a
                                      failure or a signal there and stops with it
    WholeStepOrNone, check_finite     around an RL step's PPO epochs: all applied or none (a
                                      non-finite epoch or a signal undoes the earlier ones)
    interrupted_line(cfg)             what is saved, and the command that goes on from it
    start_run, now, saved             the run's position those lines read: its phase, what is saved
                                      (and the step of that checkpoint), whether it resumed
Under torchrun only rank 0 prints; a failure on rank 0 alone reaches the others as RankFailed
(distributed.from_rank0) and they stop silently with its exit status.
"""
import contextlib
import copy
import math
import os
import signal
import sys
import traceback

import torch
import torch.distributed as dist

from machinery.config import ConfigError
from machinery.distributed import RankFailed, all_sum, from_rank0, in_step, release_freed_memory
from envace import NonFiniteError


class Interrupted(Exception):
    """Ctrl-C or SIGTERM outside the RL loop (setup, the warm start, an evaluation, a save): its
    message is the one line saying what is saved and how to go on; main prints it, exits 130."""


class StepAbandoned(Exception):
    """A signal during an RL step, seen before the step's update was applied: train.py drops the
    step (weights, optimizer and RNGs as the step found them), saves the step before and exits 0."""


_installed = []         # the StopRequests whose handlers are installed, innermost last


class Position:
    """Where train.py's run is, for the one line a fault ends it with: the phase it is in, what is
    saved (None, "warmstart", or "ckpt" of RL step `step`), and whether it resumed."""

    def __init__(self, resume=False):
        self.phase, self.saved, self.step, self.resume = "setup", None, 0, resume


position = Position()       # the run's: start_run makes a new one, now and saved move it


def start_run(resume=False):
    """A run starts (train.run; exit_status before it): in setup, nothing saved, nothing kept of an
    earlier run in this process."""
    global position
    position = Position(resume)


def now(phase):
    """The run enters `phase` ("warm start", "RL step 3", "final evaluation"): a fault line names it."""
    position.phase = phase


def saved(what, step=0):
    """`what` is saved in out_dir: "warmstart", or "ckpt" holding RL step `step`; an interruption
    line says so and how to go on from it."""
    position.saved, position.step = what, step


class StopRequest:
    """SIGINT/SIGTERM set a flag, which the long loops check between micro-batches (the warm start,
    the RL update: stop_if_signalled) or tokens (the sampler: stop_point), so that a step of many
    micro-batches stops within one of them: the warm start stops, nothing saved; an RL step not yet
    applied is dropped and the step before saved. `immediate`: the signal raises KeyboardInterrupt
    at once (SIGTERM too), for what cannot stop half-way and leaves nothing half-written (an
    evaluation, an atomic save); it can be switched on and off while the handlers are installed.
    `exception`: what stop_if_signalled raises for it: KeyboardInterrupt (the run's: the warm start
    stops), StepAbandoned (the RL loop's: the step is dropped)."""

    def __init__(self, immediate=False, exception=KeyboardInterrupt):
        self.signal = None
        self.immediate = immediate
        self.exception = exception

    def __enter__(self):
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        _installed.append(self)
        return self

    def handle(self, signum, frame):
        self.signal = signum
        if self.immediate:
            raise KeyboardInterrupt

    def __exit__(self, *exc):
        _installed.remove(self)
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def signalled(stop):
    """Whether any rank's StopRequest caught a signal (a collective: every rank gets the same answer)."""
    return all_sum([stop.signal is not None])[0] > 0


def stop_if_signalled(exception=None):
    """Between two micro-batches of a step: raise `exception` (None: the innermost StopRequest's own,
    StepAbandoned during RL, KeyboardInterrupt in the warm start) if any rank's innermost
    StopRequest caught a signal (none installed: never). A collective: every rank calls it at the
    same point (distributed.in_step gives every rank the same number of micro-batches)."""
    if _installed and signalled(_installed[-1]):
        raise exception or _installed[-1].exception


def until_signalled(batches, lengths, model):
    """A step's micro-batches (distributed.in_step: as many on every rank), each after a check
    (stop_if_signalled): a signal on any rank stops every rank before its next micro-batch. The
    warm start and the RL update iterate through this, so neither holds a line of signal handling."""
    for micro_batch in in_step(batches, lengths, model):
        stop_if_signalled()
        yield micro_batch


@contextlib.contextmanager
def all_ranks_stop_together():
    """Around work whose ranks run different numbers of steps (the sampler, a world's probe), where
    a signal stops this rank alone between two tokens (stop_point: StepAbandoned): after it every
    rank, finished or stopped, meets one check (stop_if_signalled) and all stop together, or none."""
    try:
        yield
    except StepAbandoned:       # this rank's own signal: the check below raises it again, on every rank
        pass
    stop_if_signalled()


def stop_point():
    """Between two tokens of the sampler, whose ranks run different numbers of steps (so no
    collective): StepAbandoned if the innermost StopRequest stops between steps (not `immediate`:
    the RL loop's) and caught a signal in this process. The RL loop then makes every rank agree
    (stop_if_signalled) before any other collective."""
    if _installed and not _installed[-1].immediate and _installed[-1].signal is not None:
        raise StepAbandoned


def rank0_interruptible(fn, stop=None):
    """fn() on rank 0, its result on every rank (distributed.from_rank0). With `stop` (the run's
    StopRequest) outside the RL loop (immediate): a signal stops rank 0's fn at once and every
    rank with it; one that reaches another rank, which only waits (or rank 0 after fn), is noted
    and every rank stops (KeyboardInterrupt) once fn is done."""
    interruptible = stop is not None and stop.immediate         # the same on every rank

    def on_rank0():
        if interruptible:
            stop.immediate = True
        try:
            return fn()
        finally:
            if interruptible:
                stop.immediate = False
    if interruptible:
        stop.immediate = False     # a KeyboardInterrupt on one rank alone would leave the others waiting
    try:
        result = from_rank0(on_rank0)
    finally:
        if interruptible:
            stop.immediate = True
    if interruptible and signalled(stop):     # signalled while waiting: all stop
        raise KeyboardInterrupt
    return result


def unless_signalled(evaluation, stop):
    """evaluation(stop=stop) (train.py's rank0_eval) inside the RL loop, which `stop` (the loop's
    StopRequest) interrupts at once as outside the loop (rank0_interruptible): its result, or None
    on every rank when a signal came before or during it."""
    if signalled(stop):
        return None
    stop.immediate = True
    try:
        return evaluation(stop=stop)
    except KeyboardInterrupt:
        return None
    finally:
        stop.immediate = False


def error_line(e, phase_name, debug=False):
    """The one line for an unexpected exception (user code, a tokenizer, a library), naming the
    phase it happened in; with `debug` the traceback is printed first."""
    if debug:
        traceback.print_exc()
    where = f"rank {dist.get_rank()}: " if dist.is_initialized() and dist.get_world_size() > 1 else ""
    message = (str(e).strip().splitlines() or [""])[0]
    return (f"{where}error in {phase_name}: {type(e).__name__}{': ' + message if message else ''}"
            + ("" if debug else " (--debug shows the traceback)"))


def exit_status(body, debug=False):
    """body() (train.py's run) -> its exit status, every fault one line on rank 0's stderr. The
    run's position starts over here (start_run; body's run keeps it up to date): its phase names
    where an unexpected exception happened."""
    def rank0():                       # asked after body() set up the process group
        return not dist.is_initialized() or dist.get_rank() == 0
    start_run()
    try:
        return body()
    except (ConfigError, NonFiniteError) as e:
        if rank0():
            print(f"\nerror: {e}" if isinstance(e, NonFiniteError) else f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    except (Interrupted, KeyboardInterrupt) as e:       # KeyboardInterrupt: before run took over
        if rank0():
            print(f"\n{e}" if isinstance(e, Interrupted) else "\ninterrupted during setup: nothing saved",
                  file=sys.stderr)
        return 130
    except RankFailed as e:            # rank 0 failed alone (a save, its evaluation): it says why
        return 2 if e.config else 1
    except (Exception, SystemExit) as e:           # SystemExit: user code (a check, a tool's module) exiting
        print("\n" + error_line(e, position.phase, debug), file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def interrupted_line(cfg):
    """The one line for an interruption outside the RL loop (the run's position): what is saved,
    and how to go on."""
    out = cfg["out_dir"]
    again = f"python train.py --config {os.path.join(out, 'config.yaml')} --resume"
    where = f"interrupted during {position.phase}"
    if position.saved == "ckpt":
        final = " (it redoes the final evaluation)" if position.phase == "final evaluation" else ""
        return f"{where}: the checkpoint of step {position.step} is saved in {out}/ckpt; continue with: {again}{final}"
    if position.saved == "warmstart":
        return (f"{where}: the finished warm start is saved in {out}/warmstart; continue from it "
                f"(evaluation, gate, RL) with: {again}")
    if position.resume:
        return f"{where}: nothing changed in {out}; resume again with: {again}"
    earlier = any(os.path.isdir(os.path.join(out, d)) for d in ("ckpt", "ckpt.old", "warmstart", "warmstart.old"))
    return f"{where}: nothing saved; " + (f"{out} holds an earlier run's checkpoint: start over with --overwrite"
                                          if earlier else "run the same command to start over")


def nonfinite(grad_norm, loss):
    """Whether a step's gradient norm or this rank's loss is not finite, the same answer on every
    rank (the gradients are synchronised, so grad_norm is the same everywhere; the loss is not)."""
    return not math.isfinite(grad_norm) or all_sum([not math.isfinite(loss)])[0] > 0


class NonFiniteStep(Exception):
    """An epoch's loss or gradient norm is not finite (`check_finite`): the RL step is undone."""


def check_finite(grad_norm, loss):
    """Before an epoch's opt.step: NonFiniteStep if its gradient norm or any rank's loss is not
    finite (`nonfinite`: every rank raises alike)."""
    if nonfinite(grad_norm, loss):
        raise NonFiniteStep


class WholeStepOrNone:
    """Around an RL step's epochs (train.rl_step): the step applies all its epochs or none. A
    non-finite epoch (NonFiniteStep) or a signal (StepAbandoned) undoes the epochs applied before
    it: weights and AdamW state go back to what the step started from (a snapshot, taken only with
    ppo_epochs > 1, since one epoch applies nothing before its check). NonFiniteStep is kept here
    (`nonfinite` then True), StepAbandoned goes on to the loop, which drops the step. Either way
    the gradients are freed and the model left in eval mode (sampling and evaluation need no
    gradients). The snapshot holds local tensors: under FSDP each rank's shard."""

    def __init__(self, model, opt, ppo_epochs):
        self.model, self.opt, self.nonfinite = model, opt, False
        self.snapshot = None if ppo_epochs == 1 else (
            [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict()))

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if kind in (NonFiniteStep, StepAbandoned) and self.snapshot is not None:
            with torch.no_grad():
                for p, kept in zip(self.model.parameters(), self.snapshot[0]):
                    p.copy_(kept)
            self.opt.load_state_dict(self.snapshot[1])
        self.opt.zero_grad(set_to_none=True)
        release_freed_memory()
        self.model.eval()
        self.nonfinite = kind is NonFiniteStep
        return self.nonfinite           # NonFiniteStep is answered here; anything else goes on


def rl_stop_line(cfg, step, failing, dropped=False, eval_left=False):
    """The line when the RL loop stops early: 3 non-finite steps in a row (`failing`) or a signal:
    after step `step`, during step + 1 (`dropped`: its update not applied), or during the
    evaluation after step `step` (`eval_left`: --resume does it first)."""
    out = cfg["out_dir"]
    if failing:
        return (f"\nstopping: 3 non-finite steps in a row (up to step {step}); the last good "
                f"weights are saved in {out}/ckpt. Lower lr or check the data.")
    where = (f" during RL step {step + 1} (dropped: --resume redoes it)" if dropped else
             f" during the evaluation after step {step} (--resume redoes it)" if eval_left else "")
    return (f"\ninterrupted{where}: checkpoint of step {step} saved in {out}/ckpt. Resume with:\n"
            f"  python train.py --config {os.path.join(out, 'config.yaml')} --resume")

