"""`python -m tessera.launch [torchrun options] -m tessera.train ...`: torchrun, reporting a failed job in one line.

torchrun wraps any failed worker in a ChildFailedError block of 20-40 lines. Here each Tessera rank leaves its
error line in its torchelastic error file (tessera/train.py: report), and this launcher prints the first
failure's line alone and exits with that rank's status: 2 for bad input, 1 for a fault (whose traceback the
rank printed itself), 143 for a run stopped by a signal after saving (tessera/stopping.py).

SIGTERM, SIGUSR1 and SIGUSR2 that reach the launcher (Kubernetes signals the container's first process; SLURM
every process of the step) are passed on to the ranks and nothing more: the ranks stop at a step they agree on,
save it and exit, as they would had they got it themselves. torchrun alone would stop them itself, killing any
still saving after its --shutdown-timeout (30 s), and end with a traceback.
"""

import contextlib
import logging
import os
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from tessera.stopping import children

PASSED_ON = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def pass_on(signum, frame) -> None:
    """To the ranks, which stop and save; before any started there is nothing to save: torchrun's own stop."""
    ranks = children()
    if not ranks:
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def main(argv: list[str]) -> int:
    os.environ["TESSERA_LAUNCHER"] = "1"  # the ranks leave the one line to us
    # The agent's own records of the failure (exit codes, SIGTERMs to the other ranks) restate what we print.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    args = parse_args(argv)
    if os.path.isdir("/proc/self"):  # where the ranks can be found (Linux); else torchrun's handling stays
        names = {s.name for s in PASSED_ON}
        args.signals_to_handle = ",".join(n for n in args.signals_to_handle.split(",") if n.strip() not in names)
        for sig in PASSED_ON:
            signal.signal(sig, pass_on)
    try:
        run(args)
    except SignalException as e:  # torchrun stopped the ranks (SIGINT, SIGHUP, or a signal before they started)
        print(f"tessera: the launcher got {e.sigval.name}; the ranks were stopped", file=sys.stderr)
        return 128 + e.sigval
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        ours = isinstance(failure.error_file_data, dict) and failure.error_file_data.get("tessera")
        if ours:
            print(f"tessera: {failure.message}", file=sys.stderr)
        elif failure.exitcode < 0:
            print(f"tessera: rank {rank} was killed by {failure.signal_name()} (out of memory, or stopped from "
                  f"outside)", file=sys.stderr)
        else:
            print(f"tessera: rank {rank} failed with exit status {failure.exitcode}; its output says why "
                  f"(LOG_RANK={rank} shows it under run_train.sh)", file=sys.stderr)
        # The first failure's status; one ended by torchrun's SIGTERM after another rank's end, that rank's; ranks
        # killed by a signal, 128 + its number, as a shell says it (SIGTERM during start-up, before the ranks
        # handle it: 143, which requeues).
        statuses = [failure.exitcode] + sorted((f.exitcode for f in e.failures.values()), reverse=True)
        return next((code for code in statuses if code > 0), 128 - failure.exitcode if failure.exitcode < 0 else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
