"""``make train-elastic``: two emulated nodes on 127.0.0.1 (node a: 2x V100, node b: 2x P100 of
examples/clusters/v100_p100_elastic.yaml), each one ``whale launch`` agent (torchrun's elastic agent, c10d
rendezvous). Node b is killed mid-run, node a continues on a new plan at world 2, node b comes back and the job
re-expands to world 4 (a's workers checkpoint after their current step on torchrun's SIGTERM). Prints each event
and the lines the job prints about it; the GPT is tiny, so the whole demo takes a few minutes on 2 cores.

    PYTHONPATH=src:. python examples/elastic/demo.py [--steps 300] [--kill-after 20] [--ckpt-every 10]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests import elastic_agents as ea  # noqa: E402

SHOW = ("Whale plan:", "elastic:", "resumed", "held-out loss:", "FAILED", "error:")


def _show(agent: ea.Agent, seen: int) -> int:
    """Print the agent's new lines that tell the story (plans, membership notes, resumes); returns lines seen."""
    for _, line in agent.lines[seen:]:
        if line.startswith(SHOW) or (line.startswith("step ") and line.split()[1].split("/")[0].endswith("0")):
            print(f"  [{agent.name}] {line.rstrip()}", flush=True)
    return len(agent.lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--kill-after", type=int, default=20, help="kill node b after this step")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--data-dir", default=str(ea.ROOT / "data/shakespeare"))
    args = p.parse_args()
    d = Path(tempfile.mkdtemp(prefix="whale-elastic-demo-"))
    port, t0 = ea.free_port(), time.monotonic()
    start = lambda node, host: ea.agent(node, port, d, args.steps, args.ckpt_every, args.data_dir, host=host)  # noqa: E731
    print(f"starting node a (2x V100, hosts the rendezvous) and node b (2x P100); checkpoints in {d}", flush=True)
    a, b = start("a", True), start("b", False)
    seen, phase, back = {"a": 0, "b": 0}, "both", None
    while a.proc.poll() is None and time.monotonic() - t0 < 900:
        for x in (a, b):
            seen[x.name] = _show(x, seen[x.name])
        steps = ea._steps(a.lines + b.lines)
        if phase == "both" and steps and steps[-1][1] >= args.kill_after:
            print(f"--- {time.monotonic() - t0:.0f} s: killing node b (SIGKILL to its agent and workers) after step "
                  f"{steps[-1][1]}", flush=True)
            b.kill()
            b.wait(10)
            phase, back = "alone", time.monotonic()
        elif phase == "alone" and "world 4 -> 2" in a.text() and time.monotonic() - back > 5:
            print(f"--- {time.monotonic() - t0:.0f} s: node b comes back", flush=True)
            b, seen["b"], phase = start("b", False), 0, "rejoined"
        time.sleep(0.05)
    rc = a.wait(60)
    rc_b = b.wait(60)
    for x in (a, b):
        _show(x, seen[x.name])
    print(f"--- done in {time.monotonic() - t0:.0f} s: node a exit {rc}, node b exit {rc_b}", flush=True)
    return 0 if rc == 0 and rc_b == 0 and phase == "rejoined" else 1


if __name__ == "__main__":
    sys.exit(main())
