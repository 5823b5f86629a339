"""Runs many command lines of the project's scripts, each in a process of its own, paying the
imports (torch, vLLM, transformers: most of a refused command's time) once (tests/test_bad_input.py).

    python tests/forked_entry_points.py <cases.json> <results.json>

cases.json is a list of argv lists ([script, *args], paths relative to the repository root).
This process first executes every script named there without running its main (so everything
they import is loaded), then forks one child per command line. The child is the script run as
`python <script> <args>` would run it: __main__, its argv, its directory first on sys.path, its
own stdout and stderr (files), and its exit status; a SystemExit with a message prints it to
stderr and exits 1, as the interpreter does, and the exit handlers the script registered run.
results.json gets [returncode, stdout, stderr] per case.
"""

import atexit
import json
import os
import runpy
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_child(argv: list) -> None:
    """In the forked child: run the script as __main__ and leave with its exit status, after the
    exit handlers it registered (the trainer releases its run lock in one), not the parent's."""
    atexit._clear()
    script = str(ROOT / argv[0])
    sys.argv = [script, *argv[1:]]
    sys.path[0] = str(Path(script).parent)
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no finalisers of the parent's libraries run in the child


def run_case(argv: list) -> list:
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            run_child(argv)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        return [os.waitstatus_to_exitcode(status), out.read(), err.read()]


def main(cases_path: str, results_path: str) -> None:
    cases = json.loads(Path(cases_path).read_text())
    for script in sorted({argv[0] for argv in cases}):  # load what each script imports
        sys.path[0] = str((ROOT / script).parent)
        runpy.run_path(str(ROOT / script), run_name="preloaded")
    results = [run_case(argv) for argv in cases]
    Path(results_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
