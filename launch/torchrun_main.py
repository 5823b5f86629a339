"""torchrun (`python -m torch.distributed.run`, the same arguments), ending on a stop signal the
way a process that the signal stopped ends. launch/torchrun.sh runs it.

On SIGTERM, SIGINT or SIGUSR1 torchrun forwards the signal to its workers and waits for them
(each train.py checkpoints its last completed step, says so in one line and exits 128 + signal),
then raises SignalException out of its main: a traceback and status 1, as if it had crashed.
Here that exception becomes status 128 + signal with nothing printed after the run's own line,
as `python train.py` ends. Any other failure stays torchrun's own report."""

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main

if __name__ == "__main__":
    try:
        main()
    except SignalException as e:
        sys.exit(128 + int(e.sigval))
