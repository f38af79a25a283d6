#!/usr/bin/env python3
"""Set up lanekit in a virtual environment of its own (.venv) and run its checks and tests.

    python3 dev.py check [ARGS]     lanekit check ARGS: every op on every lane, against its oracle
    python3 dev.py test [ARGS]      the test suite: pytest ARGS (e.g. -k attention, -x), spread over
                                    the cores with pytest-xdist's -n auto unless ARGS choose
                                    (-n 2; -n 0 runs them in this process; --pdb does too)
    python3 dev.py lanekit ARGS     any lanekit command, e.g. `lanekit matrix`
    python3 dev.py setup            only create or update .venv

The first run creates .venv and installs into it: torch first, at the version constraints.txt pins
(torch==2.13.0, a CPU build on the project's machines, where an unpinned torch would pull a
multi-GB CUDA build), then `pip install -c constraints.txt -e .[test,models]`. A stamp (a hash of
pyproject.toml and constraints.txt) lets later runs skip installing until either file changes.
Needs only Python 3.10+ with pip and venv: this file uses the standard library alone.

    python3 dev.py --triton newest COMMAND [ARGS]    the same, under another Triton
    python3 dev.py --triton 3.7.1 COMMAND [ARGS]

run in a venv of their own (.venv-triton-newest, .venv-triton-3.7.1): the same torch first, then
`pip install -c <venv>/constraints.txt -e .[test]`, that file being constraints.txt without its
triton line, plus `triton==X` for a version; for `newest`, `--upgrade triton` too: the newest
release pip finds whenever it installs (in a fresh venv, as CI makes it, or when pyproject.toml
or constraints.txt changes). The models extra is left out (the tests that need transformers
skip). Setup says which triton and torch it installed.
"""

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent
INPUTS = ("pyproject.toml", "constraints.txt")


def main(argv):
    if sys.version_info < (3, 10):
        sys.exit(f"dev.py: lanekit needs Python 3.10 or newer; this is {sys.version.split()[0]}")
    triton = None
    if argv[:1] == ["--triton"] and len(argv) > 1:
        triton, argv = argv[1], argv[2:]
        if triton != "newest" and not re.fullmatch(r"\d+(\.\d+)*", triton):
            sys.exit(f"dev.py: --triton takes 'newest' or a release such as 3.7.1, not {triton!r}")
    if not argv or argv[0] not in ("check", "test", "lanekit", "setup"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    python = setup(triton)
    command, args = argv[0], argv[1:]
    if command == "setup":
        return 0
    if command == "check":
        return run([str(python), "-m", "lanekit", "check", *args])
    if command == "lanekit":
        return run([str(python), "-m", "lanekit", *args])
    return run([str(python), "-m", "pytest", *_parallel(python, args), *args])


def _parallel(python, args):
    """``-n auto`` (pytest-xdist: one worker per core) unless the arguments choose a number of
    workers, turn xdist off or debug (--pdb, --trace: one process), or the venv lacks
    pytest-xdist (the test extra installs it)."""
    chosen = any(a in ("-n", "--numprocesses", "--dist", "no:xdist", "--pdb", "--trace")
                 or a.startswith(("-n", "--numprocesses=")) for a in args)
    if chosen or subprocess.call([str(python), "-c", "import xdist"], cwd=REPO,
                                 stderr=subprocess.DEVNULL) != 0:
        return []
    return ["-n", "auto"]


def setup(triton=None):
    """Create the venv if needed (.venv, or .venv-triton-<triton> for another Triton), install
    lanekit into it unless its stamp says it is current, and return its Python."""
    venv = REPO / (".venv" if triton is None else f".venv-triton-{triton}")
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    stamp_file = venv / ".lanekit-installed"
    stamp = hashlib.sha256(b"".join((REPO / name).read_bytes() for name in INPUTS)
                           + str(triton).encode()).hexdigest()
    if _runs(python) and stamp_file.exists() and stamp_file.read_text().strip() == stamp:
        return python
    if not _runs(python):
        if venv.exists():
            say(f"{venv} has no working Python; creating it again")
            shutil.rmtree(venv)
        say(f"creating {venv}")
        check([sys.executable, "-m", "venv", str(venv)],
              "could not create the venv (on Debian and Ubuntu: apt-get install python3-venv)")
    torch = _pin("torch")
    say(f"installing {torch} first (the CPU build on the project's machines), then lanekit's dependencies")
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    check(pip + [torch], f"could not install {torch}")
    if triton is None:
        check(pip + ["-c", "constraints.txt", "-e", ".[test,models]"], "could not install lanekit")
    else:
        constraints = venv / "constraints.txt"
        kept = [line for line in (REPO / "constraints.txt").read_text().splitlines()
                if not re.match(r"triton\b", line)]
        constraints.write_text("\n".join(kept + ([] if triton == "newest" else [f"triton=={triton}"])) + "\n")
        say(f"{constraints}: constraints.txt without its triton line"
            + ("" if triton == "newest" else f", and triton=={triton}"))
        newest = ["--upgrade", "triton"] if triton == "newest" else []  # even in a venv made before
        check(pip + ["-c", str(constraints), "-e", ".[test]", *newest], "could not install lanekit")
        found = subprocess.run([str(python), "-c", "from importlib.metadata import version; "
                                "print('triton', version('triton') + ', torch', version('torch'))"],
                               cwd=REPO, capture_output=True, text=True).stdout.strip()
        say(f"{venv.name} has {found}")
    stamp_file.write_text(stamp + "\n")
    say(f"the venv is ready: {venv}")
    return python


def _pin(name):
    text = (REPO / "constraints.txt").read_text()
    found = re.search(rf"^{re.escape(name)}==(\S+)", text, flags=re.MULTILINE)
    if not found:
        sys.exit(f"dev.py: constraints.txt pins no version of {name} (expected a line '{name}==X.Y.Z')")
    return f"{name}=={found.group(1)}"


def _runs(python):
    return python.exists() and subprocess.call([str(python), "-c", "pass"], cwd=REPO) == 0


def check(cmd, failure):
    code = run(cmd)
    if code != 0:
        sys.exit(f"dev.py: {failure} (exit status {code}): {' '.join(cmd)}")


def run(cmd):
    say("$ " + " ".join(cmd))
    return subprocess.call(cmd, cwd=REPO)


def say(message):
    print(f"dev.py: {message}", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
