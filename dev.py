#!/usr/bin/env python3
"""Set up lanekit in a virtual environment of its own (.venv) and run its checks and tests.

    python3 dev.py check [ARGS]     lanekit check ARGS: every op on every lane, against its oracle
    python3 dev.py test [ARGS]      the test suite: pytest ARGS (e.g. -k attention, -n 2, -x)
    python3 dev.py lanekit ARGS     any lanekit command, e.g. `lanekit matrix`
    python3 dev.py setup            only create or update .venv

The first run creates .venv and installs into it: torch first, at the version constraints.txt pins
(torch==2.13.0, a CPU build on the project's machines, where an unpinned torch would pull a
multi-GB CUDA build), then `pip install -c constraints.txt -e .[test,models]`. A stamp (a hash of
pyproject.toml and constraints.txt) lets later runs skip installing until either file changes.
Needs only Python 3.10+ with pip and venv: this file uses the standard library alone.
"""

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent
VENV = REPO / ".venv"
STAMP = VENV / ".lanekit-installed"
PYTHON = VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
INPUTS = ("pyproject.toml", "constraints.txt")


def main(argv):
    if sys.version_info < (3, 10):
        sys.exit(f"dev.py: lanekit needs Python 3.10 or newer; this is {sys.version.split()[0]}")
    if not argv or argv[0] not in ("check", "test", "lanekit", "setup"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    setup()
    command, args = argv[0], argv[1:]
    if command == "setup":
        return 0
    if command == "check":
        return run([str(PYTHON), "-m", "lanekit", "check", *args])
    if command == "lanekit":
        return run([str(PYTHON), "-m", "lanekit", *args])
    return run([str(PYTHON), "-m", "pytest", *args])


def setup():
    """Create .venv if needed, and install lanekit into it unless the stamp says it is current."""
    stamp = hashlib.sha256(b"".join((REPO / name).read_bytes() for name in INPUTS)).hexdigest()
    if _runs(PYTHON) and STAMP.exists() and STAMP.read_text().strip() == stamp:
        return
    if not _runs(PYTHON):
        if VENV.exists():
            say(f"{VENV} has no working Python; creating it again")
            shutil.rmtree(VENV)
        say(f"creating {VENV}")
        check([sys.executable, "-m", "venv", str(VENV)],
              "could not create the venv (on Debian and Ubuntu: apt-get install python3-venv)")
    torch = _pin("torch")
    say(f"installing {torch} first (the CPU build on the project's machines), then lanekit's dependencies")
    pip = [str(PYTHON), "-m", "pip", "install", "--disable-pip-version-check"]
    check(pip + [torch], f"could not install {torch}")
    check(pip + ["-c", "constraints.txt", "-e", ".[test,models]"], "could not install lanekit")
    STAMP.write_text(stamp + "\n")
    say("the venv is ready")


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
