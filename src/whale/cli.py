"""Command line: ``whale <command> ...``.

Only parsing lives here; each subcommand calls into the library. Subcommands register themselves in
:func:`build_parser` through an ``add_<name>`` function that sets ``func``. ``whale plan`` imports only the
planning side (no :mod:`whale.runtime`, no :mod:`whale.parallel`); ``whale launch`` imports the launcher when
it runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from whale.checkpoint_cli import add_checkpoint
from whale.plan_cli import add_plan
from whale.simulate_cli import add_simulate

_LAUNCH_EPILOG = """\
examples:
  one machine, 4 workers:
    whale launch -n 4 examples/gpt/train.py --steps 200
  two machines, 2 workers each (run on both, with --node-rank 0 on the master host and 1 on the other):
    whale launch -n 2 --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500 train.py
  elastic rendezvous through a c10d store:
    whale launch -n 8 --nnodes 2 --rdzv-backend c10d --rdzv-endpoint node0:29400 --rdzv-id job1 train.py

Without any rendezvous flag the job is single-machine (torchrun --standalone). Everything after the script
path is passed to the script untouched. Workers get OMP_NUM_THREADS=1 unless it is set (or --threads), and
WHALE_CLUSTER=<absolute path> with --cluster.
"""


def _add_launch(sub: argparse._SubParsersAction) -> None:
    """Register ``whale launch``."""
    p = sub.add_parser(
        "launch",
        help="run a training script on N processes per node (wraps torchrun)",
        description="Run a training script on N worker processes per node through torchrun.",
        epilog=_LAUNCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # so that a script argument like "--node" is never taken for "--node-rank"
    )
    p.add_argument("-n", "--nproc-per-node", dest="nproc", type=int, default=1, metavar="N",
                   help="worker processes on this node (default: 1)")
    p.add_argument("--cluster", metavar="SPEC.yaml",
                   help="cluster spec; exported to the workers as WHALE_CLUSTER")
    p.add_argument("--threads", type=int, metavar="T",
                   help="OMP_NUM_THREADS for each worker (default: inherited, else 1)")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command and exit")
    g = p.add_argument_group("multi-node (torchrun rendezvous; any of these disables --standalone)")
    g.add_argument("--nnodes", metavar="N|MIN:MAX", help="number of nodes")
    g.add_argument("--node-rank", type=int, metavar="R", help="rank of this node (static rendezvous)")
    g.add_argument("--master-addr", metavar="HOST", help="address of node 0 (static rendezvous)")
    g.add_argument("--master-port", type=int, metavar="PORT", help="port on node 0 (static rendezvous)")
    g.add_argument("--rdzv-backend", metavar="NAME", help="rendezvous backend, e.g. c10d")
    g.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="rendezvous endpoint")
    g.add_argument("--rdzv-id", metavar="ID", help="job id shared by all nodes")
    g.add_argument("--rdzv-conf", metavar="K=V,...", help="rendezvous options, e.g. last_call_timeout=5")
    g.add_argument("--node-name", dest="node", metavar="NAME",
                   help="the cluster spec node this agent is (WHALE_NODE; elastic jobs)")
    g.add_argument("--max-restarts", type=int, metavar="K", help="restarts of the worker group on failure")
    p.add_argument("script", help="training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script, passed untouched")
    p.set_defaults(func=_cmd_launch, subparser=p)


def _cmd_launch(ns: argparse.Namespace) -> int:
    """Run ``whale launch``; invalid arguments become an argparse-style error (exit code 2)."""
    from whale.runtime.launch import LaunchError, launch  # CLI start-up: other commands must not load whale.runtime

    rdzv = {k: getattr(ns, k) for k in ("nnodes", "node_rank", "master_addr", "master_port",
                                         "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "max_restarts")}
    try:
        return launch(ns.nproc, ns.script, ns.script_args, cluster=ns.cluster, threads=ns.threads, node=ns.node,
                      dry_run=ns.dry_run, **rdzv)
    except LaunchError as e:
        ns.subparser.error(str(e))


def build_parser() -> argparse.ArgumentParser:
    """The ``whale`` parser with one subparser per command."""
    parser = argparse.ArgumentParser(
        prog="whale",
        description="Whale for PyTorch: hybrid data / operator-sharded / pipeline parallel training.",
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    _add_launch(sub)
    add_plan(sub)
    add_simulate(sub)
    add_checkpoint(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``whale`` console script; returns the process exit code."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command is None:
        parser.print_help(sys.stderr)
        return 2
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
