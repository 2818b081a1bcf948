"""An elastic world between restarts: ``--min-np M --max-np N --host-discovery-script SCRIPT``
(Horovod Elastic's options; minidl_parallel/run.py).

Before every attempt the launcher runs the discovery script, which prints the hosts that can
take workers now, one ``host:slots`` per line (``host`` alone: one slot), as Horovod's does.
The attempt starts min(N, total slots) workers (the first attempt at most ``-n``) on those hosts,
through a hostfile the launcher writes; with fewer than M slots it waits, asking the script
again every DISCOVERY_INTERVAL_S seconds, and gives up after ``--elastic-timeout`` seconds.
A restart with another number of ranks resumes from the layout-independent checkpoint
(minidl/train/restart.py): data and optimizer-parallel slices are cut anew for the new world.
"""
import os
import subprocess
import time

__all__ = ["ElasticError", "ElasticWorld", "parse_hosts", "DISCOVERY_INTERVAL_S", "ELASTIC_TIMEOUT_S"]

DISCOVERY_INTERVAL_S = 1.0
DISCOVERY_TIMEOUT_S = 30.0  # one run of the script
ELASTIC_TIMEOUT_S = 600.0  # Horovod's default for --elastic-timeout


class ElasticError(RuntimeError):
    """The discovery script failed, or too few slots came within the elastic timeout."""

    status = None
    rank = None
    traceback = None


def parse_hosts(text, script):
    """[(host, slots)] from the script's output (``host:slots`` or ``host`` lines; blank lines skipped)."""
    hosts = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        host, sep, slots = line.partition(":")
        try:
            count = int(slots) if sep else 1
        except ValueError:
            count = -1
        if not host or count < 1:
            raise ElasticError(f"host discovery script {script}: line {number} is {line!r}; expected host:slots "
                               f"with slots an int >= 1 (or a host alone: one slot)")
        hosts.append((host, count))
    return hosts


class ElasticWorld:
    """Decides each attempt's number of workers and the hostfile that places them."""

    def __init__(self, script, start_np, min_np, max_np, folder, say, elastic_timeout=ELASTIC_TIMEOUT_S,
                 interval=DISCOVERY_INTERVAL_S):
        self.script, self.start_np, self.min_np, self.max_np = script, start_np, min_np, max_np
        self.folder, self.say, self.elastic_timeout, self.interval = folder, say, elastic_timeout, interval

    def discover(self):
        """The hosts the script names now."""
        try:
            done = subprocess.run([self.script], capture_output=True, text=True, timeout=DISCOVERY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise ElasticError(f"host discovery script {self.script} did not finish within "
                               f"{DISCOVERY_TIMEOUT_S:g} s") from None
        except OSError as exc:
            raise ElasticError(f"host discovery script {self.script} could not be run: {exc}") from None
        if done.returncode != 0:
            raise ElasticError(f"host discovery script {self.script} exited with status {done.returncode}: "
                               f"{done.stderr.strip()[-500:]}")
        return parse_hosts(done.stdout, self.script)

    def attempt(self, r):
        """(number of workers, hostfile) for attempt r, waiting for at least min_np slots."""
        start = time.monotonic()
        waited = False
        while True:
            hosts = self.discover()
            slots = sum(count for _, count in hosts)
            n = min(self.start_np if r == 0 else self.max_np, slots)
            if n >= self.min_np:
                break
            if time.monotonic() - start > self.elastic_timeout:
                raise ElasticError(f"only {slots} slot(s) on the discovered hosts "
                                   f"({', '.join(f'{h}:{c}' for h, c in hosts) or 'none'}), fewer than --min-np "
                                   f"{self.min_np}, for {self.elastic_timeout:g} s (--elastic-timeout)")
            if not waited:
                self.say(f"waiting for hosts: {slots} slot(s) discovered, --min-np is {self.min_np}")
                waited = True
            time.sleep(self.interval)
        path = os.path.join(self.folder, f"hostfile.{r}")
        # Open MPI's hostfile; MPI_Comm_spawn fills the hosts in this order.
        with open(path, "w") as f:
            f.writelines(f"{host} slots={count}\n" for host, count in hosts)
        return n, path
