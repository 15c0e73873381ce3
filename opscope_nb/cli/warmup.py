"""``opscope-nb warmup``: compile the kernels ahead of use (fill the on-disk cache).

The work is :func:`opscope_nb.warmup.warm`; this module parses the arguments,
prints one line per item as it finishes (flushed, so it streams through a pipe
or a CI log) and the total, and sets the exit status (1 if an item failed).
"""
from __future__ import annotations

import sys

from ._common import CliError

NAME = "warmup"


def add_parser(sub) -> None:
    from opscope_nb import warmup as wu
    p = sub.add_parser(NAME, help="compile the kernels now (fill the on-disk cache), "
                                  "so first runs load them instead of compiling")
    p.add_argument("--jobs", "-j", type=int, default=None, metavar="N",
                   help=f"worker processes (default: all cores, {wu.default_jobs()} here)")
    p.add_argument("--only", choices=wu.GROUPS, default=None,
                   help="one group: what `opscope-nb profile` calls, every "
                        "PackedLinear kind, or `python bench.py`'s sections")
    p.set_defaults(func=run)


def run(args) -> int:
    from opscope_nb.kernels import _jit as _config
    from opscope_nb import warmup as wu
    if args.jobs is not None and args.jobs < 1:
        raise CliError(f"--jobs must be >= 1; got {args.jobs}")
    todo = wu.items(args.only)
    n = len(todo)
    where = _config.STATE_DIR
    print(f"warming {n} items ({args.only or 'all groups'}) in "
          f"{args.jobs or wu.default_jobs()} processes; cache: {where}", flush=True)
    done = [0]

    def line(r):
        done[0] += 1
        status = f"FAILED: {r['error']}" if r["error"] else (
            f"compiled {r['compiled']}, loaded {r['loaded']}")
        print(f"[{done[0]:>{len(str(n))}}/{n}] {r['name']:<40} {r['seconds']:7.1f} s  "
              f"(cpu {r['cpu']:.1f} s; {status})", flush=True)

    out = wu.warm(args.only, args.jobs, on_result=line)
    res = out["results"]
    print(f"total {out['seconds']:.1f} s wall, {sum(r['cpu'] for r in res):.1f} s cpu in "
          f"{out['jobs']} processes; compiled {sum(r['compiled'] for r in res)}, "
          f"loaded {sum(r['loaded'] for r in res)}"
          + (f"; {len(out['failed'])} failed" if out["failed"] else ""), flush=True)
    if out["failed"]:
        print(f"failed: {', '.join(out['failed'])}", file=sys.stderr)
        return 1
    return 0
