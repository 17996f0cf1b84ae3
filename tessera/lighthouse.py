"""`python -m tessera.lighthouse [--bind [::]:29510] [--min_replicas 1] [--join_timeout_ms 10000] ...`: torchft's
lighthouse (the quorum server of fault-tolerant replica groups) that outlives the groups' stop.

A scheduler that asks a job to stop signals all of it: SLURM's `--signal=TERM@300`, and its preemption, reach every
job step, the lighthouse's too. torchft's own `torchft_lighthouse` ends on that SIGTERM at once, while the groups
still need it: a group between its signal and its stop may be in a quorum (a semi-synchronous one at a sync), which
then fails instead of saving. This one says so in a line and serves on through the first SIGTERM; a second one,
SIGINT or SIGHUP ends it (ft_trainer.slurm sends it once every group has stopped), and SIGKILL as always.
"""

import argparse
import os
import signal
import sys
import time

ENDS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tessera.lighthouse", description=__doc__.split("\n\n")[1])
    p.add_argument("--bind", default="[::]:29510", help="address:port it serves at (port 0: any free one, printed)")
    p.add_argument("--min_replicas", type=int, default=1, help="groups a quorum needs at least (the trainer "
                   "refuses to commit below fault_tolerance.min_replica_size on its own)")
    p.add_argument("--join_timeout_ms", type=int, default=10000, help="how long a quorum waits for groups that are "
                   "starting")
    p.add_argument("--quorum_tick_ms", type=int, default=100, help="how often it looks for a quorum")
    p.add_argument("--heartbeat_timeout_ms", type=int, default=5000, help="a group without heartbeats this long is "
                   "dropped")
    a = p.parse_args(argv)
    os.environ.setdefault("RUST_LOG", "warn")  # torchft logs each quorum otherwise
    from torchft.coordination import LighthouseServer

    received: list[int] = []
    for sig in ENDS:  # before the server starts: a signal from now on is ours
        signal.signal(sig, lambda signum, frame: received.append(signum))
    try:
        server = LighthouseServer(bind=a.bind, min_replicas=a.min_replicas, join_timeout_ms=a.join_timeout_ms,
                                  quorum_tick_ms=a.quorum_tick_ms, heartbeat_timeout_ms=a.heartbeat_timeout_ms)
    except Exception as e:  # noqa: BLE001 - torchft's (Rust) errors: the address is taken or not one
        print(f"tessera.lighthouse: cannot serve at {a.bind}: {e}", file=sys.stderr)
        return 2
    print(f"tessera.lighthouse: serving at {server.address()} (pid {os.getpid()})", flush=True)
    said = False
    while received.count(signal.SIGTERM) < 2 and not set(received) - {signal.SIGTERM}:
        if received and not said:
            print("tessera.lighthouse: SIGTERM: serving on while the replica groups stop and save; a second SIGTERM "
                  "(or SIGINT) ends it", flush=True)
            said = True
        time.sleep(0.2)  # not signal.pause(): a signal between the test and the pause would be waited past
    server.shutdown()
    print(f"tessera.lighthouse: stopped on {signal.Signals(received[-1]).name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
