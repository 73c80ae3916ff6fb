"""How a run ends when something goes wrong: one line and an exit status (docs/faults.md).

train.py calls the algorithm; this file is what surrounds it, as nanoGPT leaves faults to the
process: nothing here runs inside a step.

    exit_status(load, run, debug)  runs train.py's run and turns what it raises into one line on
                                 stderr and an exit status: 0 done, 1 a failure (non-finite
                                 training, an unexpected exception or user code calling sys.exit;
                                 --debug adds the traceback), 2 a bad config or input (ConfigError),
                                 130 Ctrl-C or SIGTERM
    sigterm_as_interrupt()       SIGTERM raises KeyboardInterrupt, as Ctrl-C does: either ends the
                                 run at once, wherever it is
    interrupted_line(out_dir)    what is saved in out_dir (read from the disk) and the command that
                                 goes on from it
    nonfinite(grad_norm, loss)   whether an optimizer step must be skipped, the same on every rank

Checkpoints are written whole (machinery/savefiles.py: to a temporary name, then renamed), so a
signal in the middle of a save leaves the previous checkpoint whole, and `--resume` continues
exactly from the last one. Under torchrun, torchrun forwards the signal to every rank; only rank 0
prints. What a line says comes from the exception's own message.
"""
import math
import os
import signal
import sys
import traceback

import torch
import torch.distributed as dist

from machinery.config import ConfigError
from machinery.distributed import RankFailed, all_sum
from machinery.savefiles import is_checkpoint
from envace import NonFiniteError


def sigterm_as_interrupt():
    """SIGTERM (a scheduler's kill, torchrun passing one on) raises KeyboardInterrupt, as Ctrl-C does
    (SIGINT's own handler is set too, whatever the process inherited: an ignored SIGINT would not stop it)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.default_int_handler)


def saved_in(out_dir):
    """What a run in `out_dir` has saved, in words: the RL checkpoint and its step, the finished warm
    start, or None. Read from the disk (a whole ckpt/ or the ckpt.old a save in progress keeps)."""
    for folder in ("ckpt", "ckpt.old"):
        path = os.path.join(out_dir, folder)
        if is_checkpoint(path) and os.path.isfile(os.path.join(path, "trainer_state.pt")):
            try:
                step = torch.load(os.path.join(path, "trainer_state.pt"), mmap=True, weights_only=False)["step"]
            except Exception:              # damaged: --resume names the file
                return f"a checkpoint in {path}"
            return f"the checkpoint of RL step {step} in {path}"
    for folder in ("warmstart", "warmstart.old"):
        if is_checkpoint(os.path.join(out_dir, folder)):
            return f"the finished warm start in {os.path.join(out_dir, folder)}"
    return None


def interrupted_line(cfg):
    """The one line for Ctrl-C or SIGTERM: what is saved, and how to go on."""
    if cfg is None:
        return "interrupted during setup: nothing saved"
    saved = saved_in(cfg["out_dir"])
    if saved is None:
        return "interrupted: nothing saved; run the same command to start over"
    again = f"python train.py --config {os.path.join(cfg['out_dir'], 'config.yaml')} --resume"
    return f"interrupted: {saved} is saved; continue with: {again}"


def error_line(e, where=None, debug=False):
    """The one line for an unexpected exception (user code, a tokenizer, a library), naming `where`
    it happened when the caller knows; with `debug` the traceback is printed first."""
    if debug:
        traceback.print_exc()
    rank = f"rank {dist.get_rank()}: " if dist.is_initialized() and dist.get_world_size() > 1 else ""
    message = (str(e).strip().splitlines() or [""])[0]
    return (f"{rank}error{' in ' + where if where else ''}: {type(e).__name__}{': ' + message if message else ''}"
            + ("" if debug else " (--debug shows the traceback)"))


def exit_status(load, run, debug=False):
    """run(load()) -> its exit status, every fault one line on rank 0's stderr: load() reads the
    config (its errors are one line too), run(cfg) is the run; an interruption line reads what is
    saved in the config's out_dir."""
    cfg = None

    def say(line):                     # rank 0 alone (asked after run set up the process group)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(line, file=sys.stderr)
    sigterm_as_interrupt()
    try:
        cfg = load()
        return run(cfg)
    except ConfigError as e:
        say(f"error: {e}")
        return 2
    except NonFiniteError as e:
        say(f"\nerror: {e}")
        return 1
    except KeyboardInterrupt:
        say("\n" + interrupted_line(cfg))
        return 130
    except RankFailed as e:            # rank 0 failed alone (a save, its evaluation): it says why
        return 2 if e.config else 1
    except (Exception, SystemExit) as e:           # SystemExit: user code (a check, a tool's module) exiting
        print("\n" + error_line(e, debug=debug), file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def nonfinite(grad_norm, loss):
    """Whether a step's gradient norm or this rank's loss is not finite, the same answer on every
    rank (the gradients are synchronised, so grad_norm is the same everywhere; the loss is not)."""
    return not math.isfinite(grad_norm) or all_sum([not math.isfinite(loss)])[0] > 0
