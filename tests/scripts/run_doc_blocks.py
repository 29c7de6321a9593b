"""Runs the docs' code blocks that ``tests/test_docs_code.py`` hands it, in one interpreter.

Usage: ``run_doc_blocks.py BLOCKS.json RESULTS.json``, either as a plain script (one process: every ``python``
block, every ``>>>`` block, every ``whale ...`` command) or under ``whale launch -n N`` (every rank runs the
``python launch=N`` blocks; rank 0 writes the results). BLOCKS.json is a list of
``{"id", "file", "line", "kind", "text", "continues", "fails"}``: ``kind`` is ``python`` (exec'd in a fresh
namespace, or the previous block's when ``continues``), ``doctest`` (checked by :mod:`doctest`, output
included) or ``command`` (one ``whale ...`` command line, run through ``whale.cli.main`` in this interpreter:
the console script calls the same function; it must return 0, or non-zero when ``fails``).

Each block is compiled under its document's path with its own line numbers, so a traceback points at the line
of README.md or docs/*.md that failed. A failing block under a launcher ends its rank at once (``os._exit``), so
the launcher stops the others instead of leaving them waiting in a collective; in one process every block runs
and each failure is reported.
"""

from __future__ import annotations

import contextlib
import doctest
import io
import json
import os
import shlex
import sys
import time
import traceback
from pathlib import Path


def _compiled(block: dict):
    """The block's code under its document's name, at its document's line numbers."""
    return compile("\n" * block["line"] + block["text"], block["file"], "exec")


def seed_calibration(argv: list[str], path: str) -> None:
    """A calibration for the model of a ``whale simulate`` command line, so the command measures nothing.

    Every layer-unit type of the model gets the same made-up timing (1 ms + 2 ms fixed per call forward and
    backward, 0.1/0.2 ms per row), the engine fits are neutral and gloo's bandwidth is given: the simulator
    then runs its whole pipeline in a second instead of calibrating this machine for minutes. Its numbers say
    nothing about this machine (``tests/test_simulate.py`` checks the predictions; this checks the command).
    """
    import argparse

    from whale.frontend import hwplan
    from whale.frontend.unit_keys import unit_keys
    from whale.plan_cli import factory_kwargs, load_factory
    from whale.planner.calibration_cache import (
        MODEL_ENGINE_VERSION,
        Calibration,
        EngineTiming,
        UnitTiming,
        machine_key,
        model_signature,
        save,
    )

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model", required=True)
    p.add_argument("--args", nargs="*", default=[])
    ns, _ = p.parse_known_args(argv)
    factory = load_factory(ns.model)
    model, batch, loss = factory(**factory_kwargs(factory, [a.split("=", 1) for a in ns.args], ns.model))
    keys = unit_keys(model, batch, hwplan.profile(model, batch, loss_fn=loss), loss, tracked=True)
    units = {k: UnitTiming(1e-4, 2e-4, 1e-3, 2e-3) for k in keys.values()}
    save(Calibration(key=machine_key(), p2p_bandwidth=2e9, optimizer_seconds_per_element=1e-8, units=units,
                     engine=EngineTiming(),
                     model_engines={model_signature(keys): EngineTiming(version=MODEL_ENGINE_VERSION)}), Path(path))


def _command(block: dict) -> None:
    """Run one ``whale ...`` command line through the CLI's ``main``; raise unless its status is as expected."""
    from whale.cli import main

    argv = shlex.split(block["text"])
    assert argv[0] == "whale", argv
    if argv[1:2] == ["simulate"] and "--model-desc" not in argv and os.environ.get("WHALE_CALIBRATION"):
        # a described model is predicted from the step-time model alone: no calibration to seed
        seed_calibration(argv[2:], os.environ["WHALE_CALIBRATION"])
    try:
        rc = main(argv[1:])
    except SystemExit as exc:  # argparse's --help
        rc = exc.code or 0
    if bool(rc) != bool(block.get("fails")):
        raise AssertionError(f"`{block['text']}` exited {rc}" + (" (expected to fail)" if block.get("fails") else ""))


def _doctest(block: dict) -> None:
    """Check a ``>>>`` block with :mod:`doctest` (its printed output included)."""
    test = doctest.DocTestParser().get_doctest(block["text"], {"__name__": "__main__"}, block["id"], block["file"],
                                               block["line"])
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    out = io.StringIO()
    runner.run(test, out=out.write)
    if runner.failures:
        raise AssertionError(out.getvalue())


def run(blocks: list[dict], fail_fast: bool) -> list[dict]:
    """Every block in order; per block its id, whether it passed, its seconds, its stdout and its error."""
    results, ns = [], {}
    for block in blocks:
        if not block.get("continues"):
            ns = {"__name__": "__main__"}
        start, out, error = time.perf_counter(), io.StringIO(), None
        try:
            with contextlib.redirect_stdout(out):
                if block["kind"] == "python":
                    exec(_compiled(block), ns)  # noqa: S102 - the docs' own code blocks
                elif block["kind"] == "doctest":
                    _doctest(block)
                else:
                    _command(block)
        except BaseException:  # noqa: BLE001 - reported per block
            error = traceback.format_exc()
            if fail_fast:
                print(f"docs block {block['id']} failed on rank {os.environ.get('RANK', 0)}:\n{error}",
                      file=sys.stderr, flush=True)
                os._exit(1)
        results.append({"id": block["id"], "ok": error is None, "seconds": round(time.perf_counter() - start, 2),
                        "stdout": out.getvalue(), "error": error})
    return results


def main() -> None:
    """Read the blocks, run them, write rank 0's results."""
    with open(sys.argv[1]) as f:
        blocks = json.load(f)
    launched = "RANK" in os.environ
    results = run(blocks, fail_fast=launched)
    if int(os.environ.get("RANK", 0)) == 0:
        with open(sys.argv[2], "w") as f:
            json.dump(results, f)
    sys.stdout.flush()
    if launched:
        import whale as wh

        wh.init()  # the blocks' group (wh.init reuses it): end every rank here together before the teardown
        import torch.distributed as dist

        dist.barrier()


if __name__ == "__main__":
    main()
