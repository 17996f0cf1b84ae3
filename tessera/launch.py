"""`python -m tessera.launch [torchrun options] -m tessera.train ...`: torchrun, reporting a failed job in one line.

torchrun wraps any failed worker in a ChildFailedError block of 20-40 lines. Here each Tessera rank leaves its
error line in its torchelastic error file (tessera/train.py: report), and this launcher prints the first
failure's line alone and exits with that rank's status: 2 for bad input, 1 for a fault (whose traceback the
rank printed itself).
"""

import logging
import os
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def main(argv: list[str]) -> int:
    os.environ["TESSERA_LAUNCHER"] = "1"  # the ranks leave the one line to us
    # The agent's own records of the failure (exit codes, SIGTERMs to the other ranks) restate what we print.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
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
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
