"""Validation of a loaded config against the schema and the cross-field rules.

Every problem is collected and reported at once, one line each, in the form
``FILE:LINE: key.path: found X; expected Y. hint: Z`` so that a user fixes a config in one pass.
"""

from __future__ import annotations

import copy
import difflib
import math
import os
import re
import shlex
from pathlib import Path
from typing import Any

from runner.spec import parallel, targets
from runner.spec.schema import (
    ABS_PATH,
    APT_PACKAGE,
    CONTROL,
    ENV_NAME,
    EVENTS,
    GPU_ONLY,
    MAX_NUMBER,
    NONE,
    PROGRAM_TRAINER,
    PYTHON_SWITCHES,
    REQUIRED,
    RESERVED_ENV,
    RESERVED_ENV_PREFIXES,
    RUNS_CHANGER_PREFIXES,
    RUNS_CHANGERS,
    SBATCH_SAFE,
    SCHEDULER_RUNTIMES,
    SCHEMA,
    SHARDING,
    TIME,
    TRAINER_KEYS,
    TRAINER_OBJECTS,
    F,
)
from runner.world import fabric_run

BLOCK = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")  # fsdp.blocks: Class or module.Class


class Problems:
    def __init__(self, path: Path, lines: dict[str, int], moved: tuple[str, ...] = ()):
        self.path, self.lines = path, lines
        self.moved = moved  # top-level keys the file holds under `runner:` (named runner.KEY, as the user wrote)
        self.items: list[str] = []
        self.notes: list[str] = []  # warnings: not errors, printed by validate and recorded by submit
        self.failed: set[str] = set()  # keys whose ${...} failed: said once, then skipped like a BAD leaf

    def note(self, text: str) -> None:
        self.notes.append(text)

    def name(self, key: str) -> str:
        """A key path of the validated dict as the config file spells it."""
        return f"runner.{key}" if key.split(".")[0].split("[")[0] in self.moved else key

    def add(self, key: str, found: Any, expected: str, hint: str = "") -> None:
        key = self.name(key)
        item = key.split("[")[0]  # command[1]: the list's line
        line = self.lines.get(key) or self.lines.get(item) or self.lines.get(item.rsplit(".", 1)[0]) or 0
        where = f"{self.path}:{line}" if line else str(self.path)
        msg = f"{where}: {key}: found {_show(found)}; expected {expected}"
        self.items.append(msg + (f". hint: {hint}" if hint else ""))


class Said(str):
    """A ``found`` that is already words (``found both command and model``), not a value to quote."""


def _show(v: Any) -> str:
    if isinstance(v, Said):
        return str(v)
    if isinstance(v, str):
        return repr(v) if len(v) < 60 else repr(v[:57] + "...")
    return "nothing" if v is REQUIRED else repr(v)



BAD = object()  # a leaf that failed its schema check: cross-field rules skip it instead of tripping over it


def _type_ok(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool) and bool not in types:
        return False
    if float in types and isinstance(value, int):
        return True
    return isinstance(value, types)


def _type_name(types: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true/false", list: "a list",
             NONE: "null", dict: "a mapping"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def _leaf_problem(value: Any, spec: F) -> tuple[str, str] | None:
    """What is wrong with one leaf value, as (expected, hint), or None."""
    if not _type_ok(value, spec.types):
        hint = ""
        if str in spec.types and isinstance(value, (int, float)) and not isinstance(value, bool):
            hint = f"quote it: YAML reads {value!r} as a number"
        elif bool in spec.types and isinstance(value, str) and value.lower() in ("yes", "no", "on", "off"):
            hint = "write true or false (YAML 1.2: yes/no/on/off are strings)"
        return spec.expect or _type_name(spec.types), hint
    if isinstance(value, float) and not math.isfinite(value):
        return "a finite number", "infinite and NaN values are not allowed"
    if spec.choices and value not in spec.choices:
        return "one of " + ", ".join(map(str, spec.choices)), ""
    if spec.min is not None and isinstance(value, (int, float)) and value < spec.min:
        return f"a value >= {spec.min:g}", "counts and sizes must be positive"
    top = MAX_NUMBER if spec.max is None else spec.max
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > top:
        return f"a value <= {top:.0f}", "" if spec.max is not None else "runner's numbers stay below 2**31"
    if spec.pattern and isinstance(value, str) and not spec.pattern.fullmatch(value):
        return spec.expect or f"a value matching {spec.pattern.pattern}", ""
    return None


def check_schema(data: dict[str, Any], schema: dict[str, Any], problems: Problems, prefix: str = "") -> None:
    """Check types and unknown keys, filling defaults in place; a bad leaf becomes ``BAD``."""
    free = schema.get("*")
    for key in list(data):
        path = f"{prefix}{key}"
        if key in schema and key != "*":
            continue
        if free is True or (isinstance(free, tuple) and key in free):
            continue
        known = list(dict.fromkeys([k for k in schema if k != "*"] + (list(free) if isinstance(free, tuple) else [])))
        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f"did you mean {problems.name(prefix + close[0])}?" if close else f"known keys: {', '.join(known)}"
        problems.add(path, key, "a known key", hint)
    for key, spec in schema.items():
        if key == "*":
            continue
        path = f"{prefix}{key}"
        if isinstance(spec, dict):
            sub = data.setdefault(key, {})
            if sub is None:
                sub = data[key] = {}
            if not isinstance(sub, dict):
                problems.add(path, sub, "a mapping")
                sub = data[key] = {}
                check_schema(sub, spec, Problems(problems.path, {}), path + ".")  # defaults only, for the rules
                continue
            check_schema(sub, spec, problems, path + ".")
            continue
        if path in problems.failed:
            data[key] = BAD
            continue
        if key not in data:
            if spec.default is REQUIRED:
                problems.add(path, REQUIRED, _type_name(spec.types), f"add {path} to the config")
                data[key] = BAD
            else:
                data[key] = copy.deepcopy(spec.default)
            continue
        wrong = _leaf_problem(data[key], spec)
        if wrong:
            problems.add(path, data[key], *wrong)
            data[key] = BAD


def _ints(*values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def check_rules(d: dict[str, Any], problems: Problems, base: Path | None = None, program: bool = False) -> None:
    """Cross-field rules, run even after schema errors (a ``BAD`` value is skipped): the ESPnet3 sharding rules,
    devices/num_nodes agreement, batch arithmetic, accelerator-dependent choices, and every string that reaches a
    script. ``base``: the config's directory, for ``container.code`` and ``run_root`` (None: not checked).
    ``program``: program mode (``command:``): the Trainer and the loaders are the program's, so only what runner
    reads is checked (``_check_program``)."""
    nodes, ndev, tr = d["num_nodes"], d["num_device"], d["trainer"]
    world = nodes * ndev if _ints(nodes, ndev) else None
    if program:
        _check_program(d, problems)
    if world is not None and _ints(tr["devices"]) and tr["devices"] != ndev:
        problems.add("trainer.devices", tr["devices"], f"{ndev} (= num_device)", "set trainer.devices: ${num_device}")
    if world is not None and _ints(tr["num_nodes"]) and tr["num_nodes"] != nodes:
        problems.add("trainer.num_nodes", tr["num_nodes"], f"{nodes} (= num_nodes)",
                     "set trainer.num_nodes: ${num_nodes}")
    for split, loader in _loaders(d["dataloader"], program, problems):
        # runner's own loaders: unset sharding is derived, so a block the user did not write never fails. A program's
        # keys are checked only where its file has them: runner invents none (ESPnet3 reads neither key from its
        # config; its sharded datasets carry their own, and its loader needs total_shards % world == 0).
        if not program and loader.get("dist_world_size") is None and world is not None:
            loader["dist_world_size"] = world
        if not program and loader.get("total_shards") is None:
            loader["total_shards"] = loader.get("dist_world_size")
        dws: Any = loader.get("dist_world_size")  # absent when the world is unknown (a bad num_device)
        shards: Any = loader.get("total_shards")
        if world is None:
            continue
        if _ints(dws) and dws != world:
            # A program's config goes to the program as written: a hint it can read (OmegaConf, ESPnet3's, has no
            # arithmetic in its interpolations), where runner's own resolves ${num_nodes * num_device} itself.
            problems.add(f"dataloader.{split}.dist_world_size", dws, f"{world} (= num_nodes x num_device)",
                         f"set dist_world_size: {world}" if program else
                         "set dist_world_size: ${num_nodes * num_device}")
        elif _ints(shards) and shards % world:  # dist_world_size, where given, is the world here
            up = -(-shards // world) * world
            problems.add(f"dataloader.{split}.total_shards", shards, f"a multiple of dist_world_size={world}"
                         if _ints(dws) else f"a multiple of {world} (= num_nodes x num_device)",
                         f"use total_shards: {up}")
    _check_time(d["slurm"]["time"], problems)
    _check_signing(d["container"], problems, base)
    if not program:
        _check_trainer_numbers(tr, problems)
        _check_batch(d, world, problems)
        for key in ("max_steps", "max_epochs"):
            if tr[key] == 0 and _ints(tr[key]):
                problems.add(f"trainer.{key}", 0, "-1 (no limit) or a value >= 1", "0 trains nothing")
        if tr["max_steps"] == -1 and tr["max_epochs"] is None:
            problems.add("trainer.max_steps", None, "trainer.max_steps or trainer.max_epochs",
                         "set trainer.max_steps")
    if tr["accelerator"] == "cpu":
        for key, gpu_only in GPU_ONLY.items():
            value = tr[key.split(".")[1]]
            if program and key.split(".")[1] not in PROGRAM_TRAINER:
                continue  # the program's setting
            if value in gpu_only and value is not BAD:
                problems.add(key, value, "a value that runs on accelerator: cpu",
                             "bf16-mixed or 32-true on CPU" if "precision" in key else "use ddp on CPU, or "
                             "accelerator: gpu")
    _check_strings(d, problems, base, program)


def runtime_written(d: dict[str, Any]) -> bool:
    """Whether the config (after overrides) names ``container.runtime``."""
    return isinstance(d.get("container"), dict) and "runtime" in d["container"]


def default_runtime(d: dict[str, Any], written: bool) -> None:
    """After the schema: a ``container.runtime`` the user did not write is the scheduler's first
    (``SCHEDULER_RUNTIMES``): ``none`` for a local run, whose ranks start outside any image (a runtime that needs one
    would always be refused there), ``apptainer`` on Slurm. A written runtime always wins."""
    runtimes = SCHEDULER_RUNTIMES.get(d["scheduler"]) if isinstance(d["scheduler"], str) else None
    if not written and runtimes:
        d["container"]["runtime"] = runtimes[0]


def check_where_it_runs(d: dict[str, Any], problems: Problems) -> None:
    """What ``runner submit`` would refuse on this machine, said by ``runner validate`` too (one checking path): a
    local run of a runtime that needs an image, a run directory whose path sbatch cannot read."""
    from runner.image import SPEC  # inside a runner image a local run is in its image already

    runtime, sched = d["container"]["runtime"], d["scheduler"]
    runtimes = SCHEDULER_RUNTIMES.get(sched) if isinstance(sched, str) else None
    if runtimes and runtime is not BAD and runtime not in runtimes and not SPEC.is_file():
        problems.add("container.runtime", Said(f"{runtime} with scheduler: {sched}"), f"{' or '.join(runtimes)}: a "
                     f"{sched} run starts its ranks with this machine's Python, outside any image", "set "
                     "container.runtime: none (or pass container.runtime=none) to run it here, or run it in its image "
                     "on Slurm: `runner build CONF`, then scheduler: slurm")
    root = d["run_root"]
    if isinstance(root, str) and root and not SBATCH_SAFE.match(str(Path(root).resolve())):
        problems.add("run_root", root, "a path of letters, digits and _.-/ (sbatch reads the run directory in "
                     "#SBATCH lines)", "set run_root to such a path")


def _check_signing(c: dict[str, Any], problems: Problems, base: Path | None) -> None:
    """``sign_key``/``verify_key``: Apptainer's SIF signatures, so an Apptainer runtime; a signed image is verified."""
    keys = [(k, c[k]) for k in ("sign_key", "verify_key") if isinstance(c[k], str)]
    if keys and c["runtime"] not in ("apptainer", "singularity") and c["runtime"] is not BAD:
        problems.add(f"container.{keys[0][0]}", keys[0][1], "container.runtime: apptainer or singularity",
                     "only a SIF carries signatures; remove the key for this runtime")
    if isinstance(c["sign_key"], str) and c["verify_key"] is None:
        problems.add("container.verify_key", None, "the public key of container.sign_key (a PEM file)",
                     f"openssl pkey -in {c['sign_key']} -pubout -out {c['sign_key']}.pub")
    for key, value in keys:
        if base is not None and not Path(value).is_file():  # relative to where runner runs, as build and submit read it
            problems.add(f"container.{key}", value, "a PEM key file",
                         "check the path" if key == "verify_key" else "openssl genpkey -algorithm ed25519 -out KEY")


def slurm_seconds(value: str | int) -> int:
    """Slurm's time formats (minutes, M:S, H:M:S, D-H, D-H:M, D-H:M:S) in seconds."""
    if isinstance(value, int):
        return value * 60
    days, _, rest = value.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        parts += [0] * (3 - len(parts))
        h, m, sec = parts
    elif len(parts) == 1:
        h, m, sec = 0, parts[0], 0
    elif len(parts) == 2:
        h, m, sec = 0, *parts
    else:
        h, m, sec = parts
    return ((int(days or 0) * 24 + h) * 60 + m) * 60 + sec


def _check_time(value: Any, problems: Problems) -> None:
    """``slurm.time``: at least a minute (Slurm rounds a shorter limit up to one; 0 is no limit at some sites)."""
    if value is BAD or not isinstance(value, (str, int)) or isinstance(value, bool):
        return
    if isinstance(value, str) and not TIME.fullmatch(value):
        return  # the schema said what is wrong
    if slurm_seconds(value) < 60:
        problems.add("slurm.time", value, "a time limit of at least 1 minute", "write e.g. 00:10:00 or 10 (minutes)")


# Lightning Trainer arguments that runner's own training divides by or counts with: (smallest value, None allowed).
_TRAINER_INTS = {"log_every_n_steps": (1, False), "check_val_every_n_epoch": (1, True),
                 "num_sanity_val_steps": (-1, False), "min_steps": (-1, True), "min_epochs": (-1, True)}


def _check_trainer_numbers(tr: dict[str, Any], problems: Problems) -> None:
    for key, (low, nullable) in _TRAINER_INTS.items():
        value = tr.get(key, low)
        if value is BAD or (value is None and nullable):
            continue
        if not _ints(value) or not low <= value <= MAX_NUMBER:
            problems.add(f"trainer.{key}", value, f"an integer from {low} to {MAX_NUMBER}" +
                         (" or null" if nullable else ""), "0 steps between logs would divide by zero"
                         if key == "log_every_n_steps" else "")
    clip = tr.get("gradient_clip_val")
    if isinstance(clip, float) and not math.isfinite(clip):
        return  # said with every other non-finite number
    if clip is not None and clip is not BAD and (isinstance(clip, bool) or not isinstance(clip, (int, float))
                                                 or not 0 <= clip <= MAX_NUMBER):
        problems.add("trainer.gradient_clip_val", clip, "a number >= 0, or null")


def _loaders(dataloader: dict[str, Any], program: bool, problems: Problems) -> list[tuple[str, dict[str, Any]]]:
    """The loaders whose sharding runner checks. Runner's own mode: train and valid (the schema refused any other
    key). Program mode: train, valid and any other mapping under dataloader: that names total_shards or
    dist_world_size (its other keys, such as ESPnet3's iter_factory, are the program's)."""
    if not program:
        return [(split, dataloader[split]) for split in ("train", "valid")]
    out = []
    for split, loader in dataloader.items():
        if not isinstance(loader, dict) or not (split in ("train", "valid") or "total_shards" in loader
                                                or "dist_world_size" in loader):
            continue
        for key in SHARDING:
            wrong = _leaf_problem(loader.get(key), SHARDING[key])
            if wrong:
                problems.add(f"dataloader.{split}.{key}", loader[key], *wrong)
                loader[key] = BAD
        out.append((str(split), loader))
    return out


def _check_program(d: dict[str, Any], problems: Problems) -> None:
    """Program mode: the program's Trainer and loaders hold what runner does not read. The keys the typed view
    declares are filled (schema defaults; devices and num_nodes from the layout) so that readers never miss one;
    runner derives no batch arithmetic for a program."""
    tr, loaders = d["trainer"], d["dataloader"]
    if tr["devices"] is None:
        tr["devices"] = d["num_device"]
    if tr["num_nodes"] is None:
        tr["num_nodes"] = d["num_nodes"]
    for key in ("precision", "max_steps", "max_epochs"):
        tr.setdefault(key, SCHEMA["trainer"][key].default)
    if tr.get("accumulate_grad_batches") is None:
        tr["accumulate_grad_batches"] = 1
    if d["global_batch_size"] not in (None, BAD):
        problems.add("global_batch_size", d["global_batch_size"], "none when the config names a command",
                     "runner cannot derive a program's accumulation: set the batch size and "
                     "trainer.accumulate_grad_batches in your program")
    for split in ("train", "valid"):
        loader = loaders.setdefault(split, {})
        if isinstance(loader, dict):
            loader.setdefault("batch_size", None)  # the program's own
            loader.setdefault("num_workers", SCHEMA["dataloader"]["train"]["num_workers"].default)
            for key in SHARDING:  # only what its file has is checked (``check_rules``); none is invented
                loader.setdefault(key, None)


# ``${...}`` as runner resolves it (runner.spec.load); a command's words keep each one whole while it is split.
INTERP = re.compile(r"\$\{([^{}]+)\}")
_HIDDEN = re.compile(r"\x00(\d+)\x00")  # an INTERP span while the command is split (a command has no NUL: CONTROL)


def split_command(cmd: str, problems: Problems) -> list[str] | None:
    """``command:`` written as a string: its words as the user wrote them (``shlex``: quotes group, no expansion),
    before any ``${...}`` is substituted. Each ``${...}`` stays whole inside its word (``${num_nodes * num_device}``
    is one), and ``runner.spec.load`` substitutes word by word: a value stays inside its word (a config file named
    ``my prog.yaml`` is one argument, an apostrophe in a value is no quote, an empty value an empty argument); only a
    word that is one ``${...}`` of a list becomes one word per item. None, said, when it cannot be split."""
    if CONTROL.search(cmd):
        problems.add("command", cmd, "a command on one line without control characters",
                     "write it on one line, or as a list of arguments")
        return None
    spans: list[str] = []

    def hide(m: re.Match[str]) -> str:
        spans.append(m.group(0))
        return f"\x00{len(spans) - 1}\x00"

    try:
        words = shlex.split(INTERP.sub(hide, cmd))
    except ValueError as e:
        problems.add("command", cmd, "a command line with balanced quotes", f"{str(e).lower()}: close it, or "
                     "write the command as a list of arguments")
        return None
    return [_HIDDEN.sub(lambda m: spans[int(m.group(1))], word) for word in words]


def check_command(d: dict[str, Any], problems: Problems) -> None:
    """``command:``: the argv every rank runs. A string is split like a shell line (``split_command``: the loader
    splits it before its ``${...}`` are substituted, so here it is a list of words); a list is the argv itself (an
    integer item, such as ``${num_device}``, becomes its digits)."""
    cmd = d["command"]
    if cmd is None or cmd is BAD:
        return
    argv: list[str] = []
    if isinstance(cmd, str):
        words = split_command(cmd, problems)
        if words is None:
            d["command"] = BAD
            return
        cmd = words
    for i, item in enumerate(cmd):
        if isinstance(item, bool) or not isinstance(item, (str, int)):
            problems.add(f"command[{i}]", item, "a string",
                         "quote it" + (f": YAML reads {item!r} as a number" if isinstance(item, float) else ""))
        elif CONTROL.search(str(item)):
            problems.add(f"command[{i}]", item, "an argument without control characters")
        else:
            argv.append(str(item))
    if len(argv) < len(cmd):
        d["command"] = BAD
        return
    if not argv or not argv[0]:
        problems.add("command", cmd, "the command every rank runs", "e.g. command: python train.py --config "
                     "${program_config}")
        d["command"] = BAD
        return
    d["command"] = argv


_PYTHON = re.compile(r"python(\d+(\.\d+)?)?\Z")
_SHELLS = ("sh", "bash", "dash", "zsh", "ksh")
_PY_ARG = "WX"  # python options that take a value: -W action, -X option (attached, or the next argument)


def _python_target(argv: list[str]) -> tuple[str, str]:
    """What ``python ...`` runs, as the interpreter reads its options: ("script", path), ("module", name),
    ("code", ""), ("stdin", why) or ("info", "") (``--version``)."""
    interactive, i = False, 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-":
            return "stdin", "`python -` reads its program from stdin"
        if arg == "--":
            i += 1
            break
        if not arg.startswith("-"):
            break
        if arg.startswith("--"):
            if arg in ("--help", "--help-all", "--help-env", "--help-xoptions", "--version"):
                return "info", ""
            i += 2 if arg == "--check-hash-based-pycs" else 1
            continue
        for j, flag in enumerate(arg[1:], 1):
            if flag in "cm":
                kind = "code" if flag == "c" else "module"
                return ("stdin", "`python -i` reads the prompt's input from stdin") if interactive else (kind, "")
            if flag in _PY_ARG:
                i += 0 if arg[j + 1:] else 1
                break
            if flag in "hV?":
                return "info", ""
            interactive = interactive or flag == "i"
        i += 1
    if i >= len(argv):
        return "stdin", "python with no script reads its program from stdin"
    if interactive:
        return "stdin", "`python -i` reads the prompt's input from stdin"
    return "script", argv[i]


def _fabric_run(d: dict[str, Any], argv: list[str], problems: Problems) -> list[str]:
    """``fabric run [OPTIONS] SCRIPT``: runner starts the ranks (``runner.world.fabric_run``), so its ``--devices``
    and ``--num-nodes`` must be runner's world; SCRIPT is then checked as ``python SCRIPT``'s."""
    fabric = fabric_run(argv)
    if fabric is None:
        return argv
    for option, value, want in fabric.disagrees(d["num_device"], d["num_nodes"]) if _ints(d["num_device"]) and \
            _ints(d["num_nodes"]) else []:
        layout = "num_device" if option == "--devices" else "num_nodes"
        problems.add("command", Said(f"{option} {value}"), f"{want} (= {layout}: runner starts the ranks)",
                     f"write {option} ${{{layout}}}, or leave it out")
    return ["python", *fabric.script]


def check_command_start(d: dict[str, Any], problems: Problems, cwd: Path) -> None:
    """Program mode, on the machine ``runner submit`` runs on: a command that cannot start, or that would wait on
    stdin, found before any rank starts (on Slurm: before the queue). The ranks start in ``cwd`` (the directory
    ``runner submit`` runs in, bound into the container) with stdin from /dev/null. Checked: ``python SCRIPT``'s
    script, a relative ``./tool``, and ``python``, ``python -``, ``python -i`` or a shell that reads stdin; a
    module (``python -m``) and a command on PATH are the image's, checked by each rank before the program starts."""
    argv = d["command"]
    if not isinstance(argv, list) or not argv:
        return
    argv = _fabric_run(d, argv, problems)
    head = argv[0]
    name, local = os.path.basename(head), d["container"]["runtime"] == "none"
    hint = "check the path, or run runner submit in the directory the command is relative to"
    found = Said(f"{shlex.join(d['command'])!r}")
    if _PYTHON.fullmatch(name):
        kind, what = _python_target(argv)
        if kind == "stdin":
            problems.add("command", found, "a program that reads no stdin (ranks get /dev/null)",
                         f"{what}: name the script, e.g. python train.py")
        elif kind == "script" and (local or not os.path.isabs(what)) and not (cwd / what).is_file():
            problems.add("command", found, f"a script that exists where the ranks start ({cwd}, where runner runs)",
                         f"no script {what!r} in {cwd}: {hint}")
    elif name in _SHELLS and (len(argv) == 1 or "-s" in argv[1:] or all(a.startswith("-") for a in argv[1:])) \
            and "-c" not in argv[1:]:
        problems.add("command", found, "a program that reads no stdin (ranks get /dev/null)",
                     f"{name} with no script reads its commands from stdin: name the script, e.g. {name} run.sh")
    elif "/" in head and (local or not os.path.isabs(head)) and not (cwd / head).is_file():
        problems.add("command", found, f"a command that exists where the ranks start ({cwd}, where runner runs)",
                     f"no command {head!r} in {cwd}: {hint}")


def _check_batch(d: dict[str, Any], world: int | None, problems: Problems) -> None:
    tr = d["trainer"]
    local, acc, glob = d["dataloader"]["train"]["batch_size"], tr["accumulate_grad_batches"], d["global_batch_size"]
    if world is None or not _ints(local) or acc is BAD or glob is BAD:
        return
    if glob is not None:
        per_step = local * world
        if glob % per_step:
            problems.add("global_batch_size", glob, f"a multiple of batch_size x world size = {per_step}",
                         "change global_batch_size or dataloader.train.batch_size")
        elif acc is not None and acc != glob // per_step:
            problems.add("trainer.accumulate_grad_batches", acc, f"{glob // per_step} (derived from global_batch_size)",
                         "remove accumulate_grad_batches when global_batch_size is set")
        else:
            tr["accumulate_grad_batches"] = glob // per_step
    elif acc is None:
        tr["accumulate_grad_batches"] = 1


# Sections whose strings reach the sbatch script, the Dockerfile or the Apptainer definition.
_SCRIPT_SECTIONS = ("name", "run_root", "container", "slurm", "env", "network", "alerts", "preflight")


def _walk(value: Any, path: str) -> Any:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _walk(v, f"{path}[{i}]")
    else:
        yield path, value


def _check_strings(d: dict[str, Any], problems: Problems, base: Path | None, program: bool = False) -> None:
    for section in _SCRIPT_SECTIONS:
        for path, value in _walk(d.get(section), section):
            if isinstance(value, str) and CONTROL.search(value):
                problems.add(path, value, "a single line without control characters", "remove the newline or tab")
    theirs = ("model", "data", "trainer", "dataloader") if program else ("model", "data")  # the program's values
    for path, value in _walk({k: v for k, v in d.items() if k not in theirs}, ""):
        if isinstance(value, float) and not math.isfinite(value):
            problems.add(path.lstrip("."), value, "a finite number", "infinite and NaN values are not allowed")
    slurm = d["slurm"]
    for i, flag in enumerate(slurm["extra_flags"] if isinstance(slurm["extra_flags"], list) else []):
        if not isinstance(flag, str) or not flag.startswith("--") or not SBATCH_SAFE.fullmatch(flag):
            problems.add(f"slurm.extra_flags[{i}]", flag, "an sbatch flag like --mail-type=END (no spaces/quotes)")
    check_env(d["env"], problems)
    c = d["container"]
    item_patterns = {"apt": (APT_PACKAGE, "a Debian package name like htop or pkg=1.2"),
                     "binds": (ABS_PATH, "an absolute path like /shared/data (no spaces, : or ,)"),
                     "pip": (None, ""), "code": (None, "")}
    for key, (pattern, expect) in item_patterns.items():
        for i, item in enumerate(c[key] if isinstance(c[key], list) else []):
            if not isinstance(item, str) or not item:
                problems.add(f"container.{key}[{i}]", item, "a non-empty single-line string")
            elif CONTROL.search(item):
                continue  # reported once, with every other string that reaches a script
            elif pattern and not pattern.fullmatch(item):
                problems.add(f"container.{key}[{i}]", item, expect)
            elif key == "code" and base is not None:
                _check_code(item, f"container.code[{i}]", base, problems)
    for i, path in enumerate(d["preflight"]["paths"] if isinstance(d["preflight"]["paths"], list) else []):
        if not isinstance(path, str) or not path:
            problems.add(f"preflight.paths[{i}]", path, "a path")
    for i, block in enumerate(d["fsdp"]["blocks"] if isinstance(d["fsdp"]["blocks"], list) else []):
        if not isinstance(block, str) or not BLOCK.fullmatch(block):  # a class name: matched, never imported
            problems.add(f"fsdp.blocks[{i}]", block, "a module class name like Block or mypkg.layers.Block",
                         "name the class of the blocks to shard (its __name__, or module.Class)")
    for i, event in enumerate(d["alerts"]["events"] if isinstance(d["alerts"]["events"], list) else []):
        if event not in EVENTS:
            problems.add(f"alerts.events[{i}]", event, "one of " + ", ".join(EVENTS))
    image = d["container"]["image"]
    if isinstance(image, str) and (Path(image).name in ("", ".", "..") or not Path(os.path.abspath(image)).name):
        problems.add("container.image", image, "the path of an image file, like images/train.sif",
                     "name the file, not a folder")
    for key, value in (("run_root", d["run_root"]), ("container.image_dir", d["container"]["image_dir"]),
                       ("container.image", d["container"]["image"]), ("container.wheelhouse",
                                                                      d["container"]["wheelhouse"]),
                       ("alerts.url_file", d["alerts"]["url_file"])):
        if isinstance(value, str) and not _unencodable(value) and (part := long_component(value)):
            problems.add(key, value, f"path components of at most {NAME_MAX} bytes",
                         f"{part[:20]}... has {len(os.fsencode(part))}")
    if base is not None and isinstance(d["run_root"], str) and d["run_root"] and not long_component(d["run_root"]):
        blocker = not_a_directory(Path(d["run_root"]))  # relative to where runner runs, as submit resolves it
        if blocker:
            problems.add("run_root", d["run_root"], "a directory (or a path that can be created)",
                         f"{blocker} is a file")
    parallel.check(d["parallel"], problems, need_workload=False)


def _unencodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_text(data: Any, problems: Problems, path: str = "") -> None:
    """Every key and string is text that can be written (a lone surrogate, from a command line of bytes that are
    not UTF-8, validates as a str and then fails every write)."""
    if isinstance(data, dict):
        for k, v in data.items():
            sub = f"{path}.{k}" if path else str(k)
            if isinstance(k, str) and _unencodable(k):
                problems.add(path or "(top level)", Said(ascii(k)), "a key that is UTF-8 text",
                             "the command line held bytes that are not UTF-8")
                continue
            check_text(v, problems, sub)
    elif isinstance(data, list):
        for i, v in enumerate(data):
            check_text(v, problems, f"{path}[{i}]")
    elif isinstance(data, str) and _unencodable(data):
        problems.add(path, Said(ascii(data)[:80]), "UTF-8 text", "the command line held bytes that are not UTF-8")


def check_env(env: dict[str, Any], problems: Problems) -> None:
    """``env:`` lands in export lines of job scripts: names must be names the script does not own, values
    scalars."""
    for key, value in env.items():
        if not ENV_NAME.fullmatch(str(key)):
            problems.add(f"env.{key}", key, "an environment variable name", "use letters, digits and _")
        elif key in RESERVED_ENV or str(key).startswith(RESERVED_ENV_PREFIXES):
            problems.add(f"env.{key}", key, "a name the batch script, Slurm or runner do not own",
                         f"{key} is set by the batch script or Slurm; names starting with "
                         f"{', '.join(RESERVED_ENV_PREFIXES)} are reserved")
        elif (key in RUNS_CHANGERS or str(key).startswith(RUNS_CHANGER_PREFIXES)) and key not in PYTHON_SWITCHES:
            problems.add(f"env.{key}", key, "a name that does not change how the batch script or its Python run",
                         f"{key} would reach the host-side hooks too (bash, Python, the dynamic loader); set it in "
                         "the image, or put your code next to the config (container.code) instead of a path variable")
        elif not isinstance(value, (str, int, float, bool)):
            problems.add(f"env.{key}", value, "a string or number")
        elif key == "PYTHONHASHSEED" and not re.fullmatch(r"random|\d{1,10}", str(value)) or \
                key == "PYTHONHASHSEED" and str(value).isdigit() and int(str(value)) > 4294967295:
            problems.add(f"env.{key}", value, "random or an integer from 0 to 4294967295",
                         "Python refuses to start with any other value")


def _check_code(entry: str, key: str, base: Path, problems: Problems) -> None:
    """``container.code``: ``runner`` (this package) or a path relative to the config's directory, inside it."""
    if entry == "runner":
        return
    rel = Path(entry)
    if rel.is_absolute() or ".." in rel.parts:
        problems.add(key, entry, "a path relative to the config's directory, inside it",
                     "copy or link the code next to the config")
    elif not (base / rel).exists():
        problems.add(key, entry, f"an existing file or directory under {base}", "check the path")
    elif (outside := escapes(base, base / rel)) is not None:
        problems.add(key, entry, f"code inside {base.resolve()} (symlinks followed)",
                     f"{outside} leads outside it; copy that code next to the config instead of linking it")


def escapes(base: Path, entry: Path) -> str | None:
    """The first path under ``entry`` (itself included) whose symlinks lead outside ``base``, or None: what the build
    context copies must be the project's own code, never a link to ~/.ssh."""
    root = base.resolve()

    def outside(p: Path) -> bool:
        try:
            return not p.resolve().is_relative_to(root)
        except (OSError, RuntimeError):  # a symlink loop: nothing that could be copied
            return True

    if outside(entry):
        return str(entry.relative_to(base))
    if not entry.is_dir():
        return None
    for dirpath, dirnames, filenames in os.walk(entry):  # symlinked folders are checked, not entered
        for name in [*dirnames, *filenames]:
            p = Path(dirpath) / name
            if p.is_symlink() and outside(p):
                return str(p.relative_to(base))
    return None


def not_a_directory(path: Path) -> Path | None:
    """The first existing part of ``path`` that is not a directory (so that mkdir -p would fail), or None."""
    for p in (path, *path.parents):
        if os.path.lexists(p):  # never raises: a name too long to stat is said by check_rules
            return None if os.path.isdir(p) else p
    return None


NAME_MAX = 255  # bytes in one path component (Linux, and most filesystems)


def long_component(path: str) -> str | None:
    """The first component of ``path`` longer than a filesystem takes, or None."""
    return next((part for part in path.split("/") if len(os.fsencode(part)) > NAME_MAX), None)


def check_targets(d: dict[str, Any], problems: Problems, base: Path) -> bool | None:
    """Each ``_target_`` found statically (``runner.spec.targets``), never imported: a name that is surely not
    there is a problem; a module that is not on this host is a note (the job checks it in the image).

    Returns whether the data module takes ``dataloader`` (None: not known statically)."""
    takes = None
    par = d.get("parallel") or {}
    pairs: list[tuple[str, Any, str | None]] = [(f"{s}._target_", (d.get(s) or {}).get("_target_"), s)
                                                for s in ("model", "data")]
    pairs += [("parallel.provider._target_", (par.get("provider") or {}).get("_target_"), None),
              ("parallel.forward", par.get("forward"), None), ("parallel.reduce", par.get("reduce"), None)]
    if d.get("command") is None:  # runner's own Trainer: its object arguments are built in the job
        pairs += [(f"{key}._target_", target, None) for key, target in trainer_objects(d.get("trainer"), problems)]
    for key, target, section in pairs:
        if not isinstance(target, str):
            continue
        found = targets.resolve(target, base)
        if key == "parallel.forward":
            found = parallel.forward_of(found)
        elif key == "parallel.provider._target_":
            found = parallel.provider_of(found)
        if found.status == "invalid":
            problems.add(key, target, found.detail)
        elif found.status == "missing_name":
            problems.add(key, target, "a class or function that exists", f"{found.detail}; check the spelling")
        elif found.status == "missing_module":
            problems.note(f"{key}: {target} cannot be checked here ({found.detail}); the job imports it in the "
                          "image before training")
        elif found.status == "unknown":
            problems.note(f"{key}: {target} could not be checked statically ({found.detail}); the job imports it "
                          "before training")
        elif section == "data" and targets.accepts(found.node, "dataloader") is False:
            problems.note(f"data._target_: {target} does not take `dataloader`: dataloader.train/valid (batch_size, "
                          "shards, workers) are not applied and the global batch is the data module's own")
        if found.status != "found" or section is None:
            continue
        known = targets.params(found.node)
        if known is not None:
            for arg in [k for k in d[section] if k != "_target_" and k not in known]:
                problems.add(f"{section}.{arg}", arg, f"an argument of {target} ({', '.join(sorted(known)) or 'none'})",
                             "remove it or check the spelling")
        if section == "data":
            takes = targets.accepts(found.node, "dataloader")
    return takes


def trainer_objects(trainer: Any, problems: Problems) -> list[tuple[str, str]]:
    """The ``_target_`` of each object argument of the Trainer (``trainer.callbacks`` ...: a mapping with ``_target_``
    or a list of them; ``logger`` may also be true/false, ``profiler`` a name), as (key, target); a wrong shape is a
    problem."""
    found: list[tuple[str, str]] = []
    for name in TRAINER_OBJECTS:
        value = trainer.get(name) if isinstance(trainer, dict) else None
        if value is None or (name == "logger" and isinstance(value, bool)) or (name == "profiler" and
                                                                               isinstance(value, str)):
            continue
        items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            key = f"trainer.{name}" + (f".{i}" if i is not None else "")
            if isinstance(item, dict) and isinstance(item.get("_target_"), str):
                found.append((key, item["_target_"]))
            else:
                problems.add(key, item, "a mapping with _target_ (module.Class) and its arguments",
                             f"e.g. trainer.{name}: [{{_target_: lightning.pytorch.callbacks.Timer}}]")
    return found


def check_parallel(data: dict[str, Any], problems: Problems) -> None:
    """ESPnet3's ``parallel`` block is for Dask workloads; trainer settings there are a classic mistake."""
    par = data.get("parallel")
    if not isinstance(par, dict):
        return
    options: dict[str, Any] = par["options"] if isinstance(par.get("options"), dict) else {}
    misplaced = [k for k in TRAINER_KEYS if k in par or k in options]
    if misplaced:
        hint = "`parallel` is for Dask workloads in ESPnet3; DDP settings go under trainer:"
        problems.add("parallel", ", ".join(misplaced), "trainer settings under trainer:", hint)
    for key in misplaced:  # said once, here
        par.pop(key, None)
        options.pop(key, None)
