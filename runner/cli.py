"""The ``runner`` command. It runs on the login node (or a laptop), never inside a job.

No logic lives here: each subcommand calls one module. Nothing on this path imports torch or lightning, so
``runner --help`` answers in a fraction of a second.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from runner import __version__, log, redaction
from runner.errors import ConfigError, RunnerError, refused_by_filesystem


def _validate(args: argparse.Namespace) -> int:

    from runner import spec

    cfg = spec.load(args.config, args.overrides)
    print(spec.dump(cfg.data), end="")
    for note in cfg.notes:
        logging.getLogger("runner.spec").warning("%s", note)
    if cfg.program_mode:
        print(f"# world size {cfg.world_size}; global batch: the program's own (program mode); config hash "
              f"{cfg.hash()}")
    elif cfg.takes_dataloader is False:  # runner's dataloader settings never reach it: no number of runner's holds
        print(f"# world size {cfg.world_size}; global batch: the data module's own (it does not take runner's "
              f"dataloader settings; the job measures it at the first step); config hash {cfg.hash()}")
    else:
        print(f"# world size {cfg.world_size}; global batch {cfg.global_batch} = {cfg.local_batch} (batch_size) x "
              f"{cfg.world_size} (ranks) x {cfg.accumulate} (accumulate_grad_batches); config hash {cfg.hash()}")
    return 0


def _submit(args: argparse.Namespace) -> int:
    from runner.host import submit

    plan = submit.plan(args.config, args.overrides, allow_missing_image=args.allow_missing_image)
    if args.dry_run:
        print(plan)
        return 0
    submit.warn(plan)
    return submit.execute(plan)


def _sweep(args: argparse.Namespace) -> int:
    from runner.host import submit, sweep

    if args.resume:
        if args.config or args.overrides or args.points:
            raise ConfigError(["runner sweep --resume: found a config or values beside it; expected the sweep's id "
                               "alone (its points are recorded). hint: runner sweep --resume ID [--root DIR]"])
        return sweep.drive(sweep.find(args.resume, Path(args.root)), args.parallel)
    if args.config is None:
        raise ConfigError(["runner sweep: found no config; expected CONF key=v1,v2,... or --resume ID. hint: "
                           "runner sweep conf/quickstart.yaml model.lr=0.01,0.1"])
    plan = sweep.plan(args.config, args.overrides, args.points, args.parallel, args.allow_missing_image)
    if args.dry_run:
        print(plan)
        return 0
    submit.warn(plan.plans[0])
    return sweep.execute(plan)


def _build(args: argparse.Namespace) -> int:
    from runner.host import build

    return build.main(args)


def _status(args: argparse.Namespace) -> int:
    from runner.host import status

    if args.ranks:
        if not args.run:
            raise ConfigError(["runner status --ranks: found no run; expected one run's name or directory. "
                               "hint: runner status RUN --ranks"])
        print(status.ranks(status.find_run(args.run, Path(args.root))))
        return 0
    from runner.host import sweep

    rows = status.collect(args.run, Path(args.root))
    grouped = sweep.table if any(r.get("sweep") for r in rows) else status.stages_table  # sweeps, or recipes' stages
    print(json.dumps(rows, indent=2) if args.json else grouped(rows))
    return 0


def _logs(args: argparse.Namespace) -> int:
    from runner.host import status

    run = status.find_run(args.run, Path(args.root))
    if not args.batch and not run.attempts() and any(run.logs.glob("rank-*.log")):
        raise RunnerError(f"run {run.name} predates per-attempt logs: found {run.logs}/rank-*.log, expected "
                          f"{run.logs}/attempt-N/. hint: read those files directly")
    _remember_secrets(run)
    shown = redaction.Scrubbed(sys.stdout, hold=True)  # a log holds what the program printed: no secret runner knows
    sys.stdout = shown
    try:
        return status.logs(run, None if args.batch else args.rank, args.follow, attempt=args.attempt)
    finally:
        sys.stdout = shown.out
        shown.close()


def _remember_secrets(run: Any) -> None:
    """The secrets of a run this host knows (``runner.redaction``): the webhook URL its variables hold here, its
    ``alerts.url_file`` and ``env:``, its ``secret.env``; a damaged config leaves the default variable's."""
    from runner.spec.typed import read_resolved

    try:
        read_resolved(run.config)
    except (RunnerError, OSError):
        redaction.remember_config({}, run.root)


def _cancel(args: argparse.Namespace) -> int:
    from runner.host import status

    return status.cancel(status.find_run(args.run, Path(args.root)))


def _resume(args: argparse.Namespace) -> int:
    from runner.host import status, submit

    return submit.resume_any(status.find_run(args.run, Path(args.root)), args.overrides, force=args.force)


def _cron(args: argparse.Namespace) -> int:
    from runner.host import cron
    from runner.spec.validate import not_a_directory

    roots = [Path(r) for r in (args.root or ["runs"])]
    for root in roots:
        if blocker := not_a_directory(root):
            raise ConfigError([f"--root {root}: {blocker} is a file; expected a directory of runs. hint: pass "
                               "the run root, e.g. --root runs"])
    if args.install:
        return cron.install(roots, args.yes, report=args.report)
    return cron.run_once(roots, report=args.report)


def _report(args: argparse.Namespace) -> int:
    from runner.host import report, status

    root = Path(args.root)
    if args.sweep is not None or (args.run and any((d / "sweep.json").is_file()
                                                   for d in (Path(args.run), root / "sweeps" / args.run))):
        from runner.host import sweep, sweep_report

        if args.sweep is not None and args.run:
            raise ConfigError([f"runner report --sweep {args.sweep}: found a run beside it ({args.run}); expected "
                               "one of them. hint: runner report --sweep ID, or runner report RUN"])
        path = sweep_report.write(sweep.find(args.sweep or args.run, root), args.out)
    elif args.run:
        try:
            run = status.find_run(args.run, root)
        except RunnerError as e:  # bad input: exit 2, as for a config
            raise ConfigError([str(e)]) from None
        path = report.write(run, args.out)
    else:
        if not root.is_dir():
            raise ConfigError([f"--root {root}: found no directory; expected a directory of runs. hint: pass the "
                               "run root, e.g. --root runs, or a run's name"])
        path = report.index(root, args.out)
    print(path)
    if args.open and (why := report.open_page(path)):
        logging.getLogger("runner.report").warning("%s", why)
    return 0


def _nodes(args: argparse.Namespace) -> int:
    from runner.host import nodes

    root = Path(args.root)
    if args.clear:
        forgot = nodes.clear(root, args.clear)
        print(f"{args.clear}: {'forgotten' if forgot else 'was not remembered'}")
        return 0
    bad = nodes.remembered(root, args.forget_after_s)
    print(json.dumps(bad, indent=2) if args.json else nodes.table(bad))
    return 0


def _preflight(args: argparse.Namespace) -> int:
    from runner.host import preflight

    return preflight.cli(args.config, args.overrides, args.wait)


def _parallel(args: argparse.Namespace) -> int:
    from runner.host import parallel as run

    plan = run.plan(args.config, args.overrides)
    if args.dry_run:
        print(plan)
        return 0
    return run.execute(plan)


def _dev_cluster(args: argparse.Namespace) -> int:
    from runner.dev import devcluster

    if args.action == "up":
        cluster = devcluster.up(nodes=args.nodes)
        print(f"cluster up: {', '.join(cluster.nodes)}")
        print(cluster.export_line())
    elif args.action == "status":
        print(devcluster.status())
    else:
        devcluster.down()
        print("cluster down")
    return 0


def _verbosity(default: Any) -> argparse.ArgumentParser:
    """-v/-q, accepted before the command and after it (``runner -v submit`` and ``runner submit -v``)."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_mutually_exclusive_group()
    g.add_argument("-v", "--verbose", dest="verbosity", action="store_const", const=1, default=default,
                   help="also show debug messages, among them every command runner runs (as RUNNER_VERBOSE=1)")
    g.add_argument("-q", "--quiet", dest="verbosity", action="store_const", const=-1, default=default,
                   help="show only warnings and errors on stderr")
    return p


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="runner", description="Reproducible multi-node Lightning training on Slurm.",
                                parents=[_verbosity(0)])
    p.add_argument("--version", action="version", version=f"runner {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    after_command = _verbosity(argparse.SUPPRESS)  # so a flag after the command overrides one before it

    def cmd(name: str, fn: Any, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help, parents=[after_command])
        sp.set_defaults(fn=fn)
        return sp

    def config_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("config", type=Path, help="run config (YAML)")
        sp.add_argument("overrides", nargs="*", metavar="key=value", help="override config values")

    sp = cmd("validate", _validate, "check a config and print it resolved, with the global batch")
    config_args(sp)
    sp = cmd("submit", _submit, "create a run directory and start the run (Slurm or local)")
    config_args(sp)
    sp.add_argument("--dry-run", action="store_true", help="print the plan and the rendered script; write nothing")
    sp.add_argument("--allow-missing-image", action="store_true",
                    help="submit even if the image is missing here or was built from a different spec")
    sp = cmd("sweep", _sweep, "run one config at many points, each an ordinary run of one sweep: the grid of "
             "key=v1,v2,... (every combination) and --points FILE; locally N at a time, on Slurm one job array")
    sp.add_argument("config", type=Path, nargs="?", help="run config (YAML)")
    sp.add_argument("overrides", nargs="*", metavar="key=v1,v2",
                    help="a key and its values, split at commas outside [] and quotes (one value: as an override)")
    sp.add_argument("--points", type=Path, metavar="FILE",
                    help="explicit points: a YAML list of {key.path: value} mappings, each combined with the grid")
    sp.add_argument("--parallel", type=int, metavar="N",
                    help="runs at a time (local: default 1; Slurm: the job array's %%N limit, default all)")
    sp.add_argument("--dry-run", action="store_true",
                    help="print every point's run directory and values (Slurm: the job array); write nothing")
    sp.add_argument("--allow-missing-image", action="store_true", help="as for runner submit")
    sp.add_argument("--resume", metavar="SWEEP", help="continue a sweep (its id or folder): start or resume each of "
                    "its runs that is not completed (Slurm: submit each that never got a job)")
    sp.add_argument("--root", default="runs", help="where run directories live, for --resume (default: runs)")
    sp = cmd("build", _build, "render the Dockerfile and Apptainer definition; build the image and the SIF")
    sp.add_argument("config", type=Path, nargs="?", help="run config (YAML)")
    sp.add_argument("overrides", nargs="*", metavar="key=value", help="override config values")
    sp.add_argument("--from-run", type=Path, metavar="RUN_DIR", help="rebuild the image a run was submitted with")
    sp.add_argument("--dry-run", action="store_true", help="render and print the build plan; build nothing")
    sp.add_argument("--force", action="store_true", help="rebuild even if the image for this spec exists")
    for name, fn, help in (("status", _status, "show runs: state, job id, last checkpoint, restarts"),
                           ("logs", _logs, "print a run's per-rank log"),
                           ("cancel", _cancel, "cancel a run's job; it will not be resubmitted"),
                           ("resume", _resume, "start a stopped run again from its newest complete checkpoint")):
        sp = cmd(name, fn, help)
        sp.add_argument("run", nargs="?" if name == "status" else None, help="run directory or name")
        sp.add_argument("--root", default="runs", help="where run directories live (default: runs)")
        if name == "status":
            sp.add_argument("--json", action="store_true", help="machine-readable output")
            sp.add_argument("--ranks", action="store_true",
                            help="the run's slowest ranks and nodes against the median, and its last hang")
        if name == "resume":
            sp.add_argument("overrides", nargs="*", metavar="num_nodes=N",
                            help="resume on other capacity (num_nodes / num_device); the global batch is kept")
            sp.add_argument("--force", action="store_true",
                            help="resume although Slurm cannot be asked whether the run's job ended (you know it "
                                 "did); a job Slurm reports alive is always refused: cancel it first")
        if name == "logs":
            sp.add_argument("--rank", type=int, default=0, help="which rank's log (default: 0)")
            sp.add_argument("--attempt", type=int, help="which attempt's log, 1 for the first (default: the latest)")
            sp.add_argument("--batch", action="store_true",
                            help="Slurm's output of the batch script (hooks, srun errors) instead of a rank's log")
            sp.add_argument("--follow", "-f", action="store_true", help="keep printing until the run ends")
    sp = cmd("cron", _cron, "resume every Slurm run that died (run it every minute from crontab)")
    sp.add_argument("--root", action="append", help="run root to watch (repeatable; default: runs)")
    sp.add_argument("--install", action="store_true", help="print the crontab line (with --yes: install it)")
    sp.add_argument("--yes", action="store_true")
    sp.add_argument("--report", action="store_true",
                    help="also rewrite each run's report page whose records changed, and ROOT/index.html")
    sp = cmd("report", _report, "write a run's report page (one HTML file, no network needed to view it), a "
             "sweep's page comparing its runs, or the index of a run root")
    sp.add_argument("run", nargs="?", help="run directory or name, or a sweep's id or folder (default: the index of "
                    "every run under --root)")
    sp.add_argument("--sweep", metavar="SWEEP", help="a sweep's id or folder: one page comparing its runs (their "
                    "varied values, state, last loss, steps, goodput), each linked to its own page, written too")
    sp.add_argument("--root", default="runs", help="where run directories live (default: runs)")
    sp.add_argument("--out", type=Path, help="write the page here (default: RUN/report.html, "
                    "ROOT/sweeps/SWEEP/report.html, ROOT/index.html)")
    sp.add_argument("--open", action="store_true", help="open the page in a browser, where there is one")
    sp = cmd("nodes", _nodes, "list the nodes kept out of this root's jobs (failed preflight, hang, NODE_FAIL)")
    sp.add_argument("--root", default="runs", help="run root (default: runs)")
    sp.add_argument("--clear", metavar="NODE", help="forget one node: the next jobs may use it again")
    sp.add_argument("--forget-after-s", type=float, default=21600,
                    help="list entries younger than this (default: resume.exclude_nodes_s's default, 6 h)")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp = cmd("preflight", _preflight, "run the preflight checks as a short job (or locally) and print the report")
    config_args(sp)
    sp.add_argument("--wait", type=float, default=600, help="seconds to wait for the report (default: 600)")
    sp = cmd("parallel", _parallel, "run a config's parallel: workload (ESPnet3 provider/forward) on Dask; "
             "a rerun skips done items")
    config_args(sp)
    sp.add_argument("--dry-run", action="store_true", help="print the plan (run directory, items left, workers)")
    sp = cmd("dev-cluster", _dev_cluster, "a local multi-node Slurm cluster for trying the sbatch path (root)")
    sp.add_argument("action", choices=("up", "status", "down"))
    sp.add_argument("--nodes", type=int, default=2)
    return p


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line; ``key=value`` overrides may come before, between or after the flags."""
    p = parser()
    args, extra = p.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and not any(e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    log.setup(args.verbosity)
    try:
        return int(args.fn(args))
    except RunnerError as e:
        red, reset = ("\033[31m", "\033[0m") if sys.stderr.isatty() else ("", "")
        for line in str(e).splitlines():
            print(f"{red}runner: error: {line}{reset}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # the file system refused (read-only, not this user's, full): the user's to fix
        if (refused := refused_by_filesystem(e)) is None:
            raise
        red, reset = ("\033[31m", "\033[0m") if sys.stderr.isatty() else ("", "")
        print(f"{red}runner: error: {refused}{reset}", file=sys.stderr)
        return refused.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `runner submit --dry-run ... | head`: the reader left, nothing is wrong
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 -- keeps Python's exit-time flush quiet
        return 0
