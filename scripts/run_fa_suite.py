"""Run FlashAttention's own test suite (its tests/test_flash_attn.py, unmodified) against lanekit,
through the ``flash_attn`` alias of :mod:`lanekit.compat`.

    python scripts/run_fa_suite.py --tests PATH/test_flash_attn.py [--sample 8] [--seed 0]
                                   [--json OUT.json] [-- extra pytest arguments]

The suite needs a CUDA/ROCm GPU (it builds its tensors on "cuda"), pytest and einops. Its file
comes from FlashAttention's repository (https://github.com/Dao-AILab/flash-attention, BSD-3):
lanekit does not ship it. Before collection, ``lanekit.compat.install()`` makes ``import
flash_attn`` give lanekit's FlashAttention-2 API, so the suite's own imports reach lanekit.

Cases left out (deselected, and counted as such):
  * the dropout mask-decoding cases (dropout_p > 0 in test_flash_attn_qkvpacked,
    test_flash_attn_varlen_qkvpacked, test_flash_attn_output, test_flash_attn_varlen_output):
    they decode the dropout pattern from the probabilities FlashAttention's CUDA kernels return
    with ``return_attn_probs=True`` (signs and block maxima of its own tiles), which lanekit does
    not materialize (it returns None there);
  * test_flash_attn_generator_arg_must_be_none: it calls the raw entry points of FlashAttention's
    compiled CUDA extension (``flash_attn_gpu.fwd`` ...), not the Python API.
``--sample N`` then keeps N cases of each test function, drawn with ``--seed`` (the full suite
is about 509,000 cases, 414,000 after the deselection; 8 a function, about 110 cases, is meant to
fit a GPU run of a few minutes, most of it compiling the kernels' specializations).

It prints one summary line, ``fa suite: P passed, F failed, S skipped, D deselected (of T
collected)``, lists the failures, and exits 0 when nothing failed. ``--json`` records the counts,
the failing case ids and the selection. Setting LANEKIT_CHECK_INDICES=1 (the default here) makes
index values (block tables, cache lengths) checked on the host at each call, so
test_flash_attn_kvcache_paged_block_table_bounds sees its RuntimeError at the call, as it
expects; ``--lazy-index-checks`` leaves lanekit's default.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections import defaultdict
from pathlib import Path

import pytest

DROPOUT_DECODING = ("test_flash_attn_qkvpacked", "test_flash_attn_varlen_qkvpacked", "test_flash_attn_output",
                    "test_flash_attn_varlen_output")
C_EXTENSION = ("test_flash_attn_generator_arg_must_be_none",)


def left_out(name: str, params: dict) -> str | None:
    """Why the case of test function ``name`` with these parameters is deselected (None: it runs)."""
    if name in DROPOUT_DECODING and params.get("dropout_p", 0.0) > 0.0:
        return "dropout mask decoding (return_attn_probs' encoded probabilities are not materialized)"
    if name in C_EXTENSION:
        return "calls FlashAttention's compiled CUDA extension directly"
    return None


class Selection:
    """A pytest plugin: deselects the cases above, samples N per test function, counts outcomes.

    The selection is made where pytest forms each function's parameter grid
    (``pytest_generate_tests``, after the suite's parametrize marks are applied), so that the
    half a million cases of the full grid are never built as test items (collecting them all takes
    minutes). Each function's cases are drawn with its own ``random.Random(f"{seed} {name}")``."""

    def __init__(self, sample: int | None, seed: int):
        self.sample, self.seed = sample, seed
        self.collected = 0
        self.deselected: dict[str, int] = defaultdict(int)
        self.outcomes: dict[str, str] = {}

    def _keep(self, name: str, cases: list, params) -> list:
        self.collected += len(cases)
        kept = []
        for case in cases:
            reason = left_out(name, params(case))
            if reason:
                self.deselected[reason] += 1
            else:
                kept.append(case)
        if self.sample is not None and len(kept) > self.sample:
            rng = random.Random(f"{self.seed} {name}")
            chosen = set(rng.sample(range(len(kept)), self.sample))
            self.deselected[f"not sampled (--sample {self.sample})"] += len(kept) - self.sample
            kept = [case for i, case in enumerate(kept) if i in chosen]
        return kept

    @pytest.hookimpl(trylast=True)
    def pytest_generate_tests(self, metafunc):
        calls = getattr(metafunc, "_calls", None)
        if calls:   # pytest's private list of the grid's cases (CallSpec2, each with .params)
            metafunc._calls = self._keep(metafunc.function.__name__, calls, lambda c: c.params)
        else:       # an unparametrized test: one case
            if not self._keep(metafunc.function.__name__, [None], lambda c: {}):
                metafunc.function.__lanekit_left_out__ = True

    def pytest_collection_modifyitems(self, session, config, items):
        drop = [i for i in items if getattr(getattr(i, "function", None), "__lanekit_left_out__", False)]
        if drop:
            items[:] = [i for i in items if i not in drop]
            config.hook.pytest_deselected(items=drop)

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.outcomes[report.nodeid] = "failed"
        elif report.skipped and self.outcomes.get(report.nodeid) != "failed":
            self.outcomes[report.nodeid] = "skipped"
        elif report.when == "call" and report.passed and report.nodeid not in self.outcomes:
            self.outcomes[report.nodeid] = "passed"

    def counts(self) -> dict[str, int]:
        found = defaultdict(int)
        for outcome in self.outcomes.values():
            found[outcome] += 1
        return {k: found[k] for k in ("passed", "failed", "skipped")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", default=os.environ.get("FLASH_ATTN_TESTS"),
                        help="FlashAttention's tests/test_flash_attn.py (default: $FLASH_ATTN_TESTS)")
    parser.add_argument("--sample", type=int, default=None, help="cases kept per test function")
    parser.add_argument("--seed", type=int, default=0, help="the sampling's seed")
    parser.add_argument("--json", default=None, help="write the counts and failing ids here")
    parser.add_argument("--lazy-index-checks", action="store_true",
                        help="do not set LANEKIT_CHECK_INDICES=1 (index values then checked lazily)")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    if not args.tests or not Path(args.tests).is_file():
        parser.error(f"--tests: expected FlashAttention's tests/test_flash_attn.py, got {args.tests!r} (fetch "
                     "https://github.com/Dao-AILab/flash-attention and pass its tests/test_flash_attn.py)")
    if args.sample is not None and args.sample < 1:
        parser.error(f"--sample: expected an int >= 1, got {args.sample}")
    if not args.lazy_index_checks:
        os.environ.setdefault("LANEKIT_CHECK_INDICES", "1")

    import lanekit.compat

    lanekit.compat.install()
    tests = Path(args.tests).resolve()
    selection = Selection(args.sample, args.seed)
    code = pytest.main([str(tests), "--rootdir", str(tests.parent), "-p", "no:cacheprovider", "-q",
                        "-o", "addopts=", *args.pytest_args], plugins=[selection])
    counts = selection.counts()
    deselected = sum(selection.deselected.values())
    print(f"fa suite: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped, "
          f"{deselected} deselected (of {selection.collected} collected)")
    for reason, n in sorted(selection.deselected.items()):
        print(f"  deselected {n}: {reason}")
    failing = sorted(n for n, o in selection.outcomes.items() if o == "failed")
    for nodeid in failing:
        print(f"  FAILED {nodeid}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "tests": str(tests), "sample": args.sample, "seed": args.seed, "collected": selection.collected,
            **counts, "deselected": dict(selection.deselected), "failed_ids": failing,
        }, indent=2))
    if code not in (0, 1, 5):   # 1: some failed (counted above); 5: nothing collected
        return int(code)
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
