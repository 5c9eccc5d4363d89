"""``python <checkout>/harness.py ...`` typed in a test's shell, handed to the test process's forkserver
(tests/prefork.py, ``ForkService``): this client runs instead of the harness, with ``python -S -E`` (the
standard library alone: it starts in milliseconds), and exits as the forked harness did. Its stdout and
stderr are the harness's.

    python -S -E fork_client.py <checkout>/harness.py [args...]     # AGL_TEST_FORKS: the service's socket
"""

import json
import os
import signal
import socket
import sys


def main() -> None:
    harness, *args = sys.argv[1:]
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(os.environ["AGL_TEST_FORKS"])
        request = {"harness": harness, "args": args, "env": dict(os.environ), "cwd": os.getcwd(), "pid": os.getpid()}
        conn.sendall(json.dumps(request).encode() + b"\n")
        reply = json.loads(conn.makefile("rb").readline())
    if reply.get("fresh"):  # not forkable (tests/prefork.py, forkable): the harness itself
        os.execv(sys.executable, [sys.executable, harness, *args])
    code = reply["returncode"]
    if code < 0:  # killed by a signal: so is this process, as the shell would see the harness
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
