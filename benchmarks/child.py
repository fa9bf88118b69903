"""A benchmark's engine in a process of its own, spoken to in JSON lines: the driver's side of
benchmarks/quant_proc.py and benchmarks/llamacpp_peer.py.

`Child(name, cmd, log, timeout)` launches `cmd` with `--reply-fd N` added and reads its start-up reply
(`.started`); `.ask(cmd)` and `.close()` are engine_client.EngineProcess's (the same protocol as
benchmarks/engine_proc.py). Its stdout and stderr go to `log`, whose last lines are in the error when it
fails or replies {"error"}.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

try:  # run as a script: benchmarks/ is on sys.path
    import engine_client
except ImportError:
    from benchmarks import engine_client

ChildFailed = engine_client.EngineFailed


class Child(engine_client.EngineProcess):
    def __init__(self, name: str, cmd: list[str], log: Path, timeout: float):  # noqa: D107 - no super(): no engine
        self.spec, self.log, self.timeout = engine_client.EngineSpec(name, "child", False), log, timeout
        read_fd, write_fd = os.pipe()
        with open(log, "w") as out:
            self.proc = subprocess.Popen([*cmd, "--reply-fd", str(write_fd)], stdin=subprocess.PIPE, stdout=out,
                                         stderr=subprocess.STDOUT, text=True, pass_fds=(write_fd,),
                                         start_new_session=True)
        os.close(write_fd)
        self._replies = os.fdopen(read_fd, "rb")
        self._buffer = b""
        self.started = self._reply()
