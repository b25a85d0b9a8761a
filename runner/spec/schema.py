"""The config schema: every key, its type, default and constraints, as data.

Validation (``runner.spec.validate``) walks it; the typed view (``runner.spec.typed``) mirrors it.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

from runner.ledger import ALERT_EVENTS

# The run events an alert can be sent for (alerts.events picks; runner.alerts renders them).
EVENTS: tuple[str, ...] = ALERT_EVENTS

REQUIRED = object()
# Characters allowed in values that land in ``#SBATCH`` lines (sbatch parses those lines itself, so shell
# quoting cannot protect them): reject anything else instead of guessing how sbatch would read it.
# Patterns end in \Z, never $ ($ also matches before a trailing newline); validation uses fullmatch.
SBATCH_SAFE = re.compile(r"[A-Za-z0-9_.:,=@/+%\-\[\]]*\Z")
NGC_TAG = re.compile(r"\d{2}\.(0[1-9]|1[0-2])\Z")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
TIME = re.compile(r"(\d+-)?\d{1,2}(:\d{2}){0,2}\Z")
NAME = re.compile(r"[A-Za-z0-9_.\-]{1,100}\Z")  # the run directory is NAME-YYYYmmdd-HHMMSS[-N]: well under 255
# Values written unquoted into the Dockerfile (ARG, COPY, ENV, WORKDIR) and the Apptainer definition.
IMAGE_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-/:@]{0,254}\Z")
ABS_PATH = re.compile(r"/[A-Za-z0-9_.\-/+@%]{0,254}\Z")
COMMAND = re.compile(r"[A-Za-z0-9_.\-/+]{1,255}\Z")
APT_PACKAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9+.:=~/\-]{0,127}\Z")  # never an option (-o ...)
# No value that reaches a script may carry a control character (C0, DEL, C1 such as NEL) or a Unicode line
# separator: newline included, and nothing another tool might read as one.
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# Strategies runner can launch (a subset of Lightning 2.6's StrategyRegistry; tests/test_spec_hardening.py checks
# it against the installed Lightning). The login node never imports Lightning, so these are data.
TARGET = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+\Z")
PARALLEL_ENVS = ("local", "local_gpu", "slurm")
STRATEGIES = ("ddp", "ddp_find_unused_parameters_true", "fsdp")
# Every value Lightning 2.6 accepts for Trainer(precision=...) (_PRECISION_INPUT), aliases included.
PRECISIONS: tuple[str | int, ...] = (
    "transformer-engine", "transformer-engine-float16", "16-true", "16-mixed", "bf16-true", "bf16-mixed",
    "32-true", "64-true", "64", "32", "16", "bf16", 64, 32, 16)
# fsdp runs on CPU too (runner's fsdp is FSDP2 through Lightning's ModelParallelStrategy; gloo on CPU).
GPU_ONLY = {"trainer.precision": ("16-mixed", "16", 16, "transformer-engine", "transformer-engine-float16")}
# Environment names the batch script or Slurm own: a config that sets them would break the job or be ignored.
RESERVED_ENV = ("RUN_DIR", "RUNNER_PY", "IFS", "PATH", "BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "CDPATH",
                "GLOBIGNORE", "PS4", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "owner", "rc", "hook",
                "step_pid", "got_signal")
RESERVED_ENV_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "RUNNER_", "BASH_FUNC_")
# Environment names that change how the batch script's bash, its Python (the host-side hooks and the ranks) or the
# dynamic loader run: `EXECIGNORE='*'` hides scontrol and srun, `PYTHONHOME` stops every Python, `LD_PRELOAD` loads
# code into each. Refused in `env:` (which reaches the whole script), except the few Python switches below.
RUNS_CHANGERS = ("EXECIGNORE", "POSIXLY_CORRECT", "FUNCNEST", "TMOUT", "GCONV_PATH", "LOCPATH", "HOSTALIASES",
                 "MALLOC_CHECK_", "MALLOC_PERTURB_", "GLIBC_TUNABLES")
RUNS_CHANGER_PREFIXES = ("BASH", "LD_", "PYTHON")
PYTHON_SWITCHES = ("PYTHONUNBUFFERED", "PYTHONFAULTHANDLER", "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED")
MAX_NUMBER = 2 ** 31 - 1  # every number runner uses (counts, seconds, sizes) stays below it, unless its field says
MAX_TIMEOUT_S = 2 ** 31 - 1  # the largest process-group timeout torch takes (gloo and NCCL, as a timedelta)
TRAINER_KEYS = (
    "accelerator", "strategy", "devices", "num_nodes", "precision", "max_epochs", "min_epochs", "max_steps",
    "min_steps", "max_time", "limit_train_batches", "limit_val_batches", "val_check_interval",
    "check_val_every_n_epoch", "num_sanity_val_steps", "log_every_n_steps", "enable_progress_bar",
    "enable_model_summary", "accumulate_grad_batches", "gradient_clip_val", "gradient_clip_algorithm",
    "deterministic", "benchmark", "inference_mode", "detect_anomaly", "sync_batchnorm",
) + ("callbacks", "logger", "plugins", "profiler")
# Lightning Trainer arguments that are objects: a `_target_` mapping (or a list of them; logger may be true/false,
# profiler a name like "simple"), built in the job and passed to the Trainer beside runner's own callback and plugins.
TRAINER_OBJECTS = ("callbacks", "logger", "plugins", "profiler")


@dataclass(frozen=True)
class F:
    """One leaf of the schema: its type(s), default and constraints."""

    types: tuple[type, ...]
    default: Any = REQUIRED
    choices: tuple[Any, ...] | None = None
    min: float | None = None
    max: float | None = None
    pattern: re.Pattern[str] | None = None
    expect: str = ""


def _f(types: type | tuple[type, ...], default: Any = REQUIRED, **kw: Any) -> F:
    return F(types if isinstance(types, tuple) else (types,), default, **kw)


NONE = type(None)
POS_INT = {"min": 1}
_LOADER = {
    "total_shards": _f((int, NONE), None, **POS_INT),  # None: derived (= dist_world_size)
    "dist_world_size": _f((int, NONE), None, **POS_INT),  # None: derived (= num_nodes x num_device)
    "batch_size": _f(int, 8, **POS_INT),
    "num_workers": _f(int, 0, min=0),
}

# The schema: dicts are sections, F are leaves, "*" means free-form (kwargs passed through).
RUNTIMES = ("apptainer", "singularity", "podman", "pyxis", "none")
SIF_COMPRESSIONS = ("gzip", "zstd")
# The runtimes each scheduler's ranks can start in, the first the one a config gets when it writes none: a local run's
# ranks start with this machine's Python, outside any image (inside a runner image a local run is in it already).
SCHEDULER_RUNTIMES = {"local": ("none",), "slurm": RUNTIMES}

SCHEMA: dict[str, Any] = {
    "name": _f((str, NONE), None, pattern=NAME, expect="1 to 100 letters, digits, _ . -"),
    "num_nodes": _f(int, 1, **POS_INT),
    "num_device": _f(int, 1, **POS_INT),
    "seed": _f(int, 0, min=0, max=2 ** 31),  # rank r uses seed + r; Lightning replaces seeds beyond 2**32 - 1
    "scheduler": _f(str, "local", choices=("local", "slurm")),
    "run_root": _f(str, "runs", pattern=SBATCH_SAFE, expect="a path without spaces or shell characters"),
    "global_batch_size": _f((int, NONE), None, **POS_INT),
    "command": _f((str, list, NONE), None),  # program mode: the argv every rank runs (a string is split like a shell)
    # program mode: the program's copy of the config (program/NAME) as written (ESPnet3, OmegaConf) or resolved
    # (LightningCLI); unwritten: resolved for a LightningCLI command line, else as_written (runner.spec.program_copy)
    "program_copy": _f(str, "as_written", choices=("as_written", "resolved")),
    "trainer": {
        "accelerator": _f(str, "cpu", choices=("cpu", "gpu", "cuda", "auto")),
        "devices": _f(int, REQUIRED, **POS_INT),
        "num_nodes": _f(int, REQUIRED, **POS_INT),
        "strategy": _f(str, "ddp", choices=STRATEGIES),
        "precision": _f((str, int), "32-true", choices=PRECISIONS),
        "max_steps": _f(int, -1, min=-1),
        "max_epochs": _f((int, NONE), None, min=-1),
        "accumulate_grad_batches": _f((int, NONE), None, **POS_INT),
        "*": TRAINER_KEYS,
    },
    "model": {"_target_": _f(str), "*": True},
    "data": {"_target_": _f(str), "*": True},
    "dataloader": {"train": dict(_LOADER), "valid": dict(_LOADER)},
    "container": {
        "ngc_tag": _f(str, "24.10", pattern=NGC_TAG, expect="an NGC release tag like 24.10 (YY.MM)"),
        "base_image": _f((str, NONE), None, pattern=IMAGE_REF, expect="an image reference like "
                         "nvcr.io/nvidia/pytorch:24.10-py3"),
        "apt": _f(list, []),  # items: APT_PACKAGE
        "pip": _f(list, []),
        "nccl_tests": _f(bool, False),
        "perftest": _f(bool, False),
        "install_lightning": _f(bool, True),
        "runtime": _f(str, "apptainer", choices=RUNTIMES),  # unwritten: the scheduler's first (SCHEDULER_RUNTIMES)
        "builder": _f(str, "auto", choices=("auto", "docker", "podman")),
        "image_dir": _f(str, "images"),
        "image": _f((str, NONE), None),
        "allow_missing_image": _f(bool, False),
        "binds": _f(list, []),
        "python": _f(str, "python", pattern=COMMAND, expect="a command or path like python3 (no spaces)"),
        "workdir": _f(str, "/workspace", pattern=ABS_PATH, expect="an absolute path like /workspace (no spaces)"),
        "code": _f(list, ["runner"]),
        "wheelhouse": _f((str, NONE), None, pattern=SBATCH_SAFE, expect="a directory path without spaces"),
        # Apptainer's own signatures (PEM keys): runner build signs the SIF with sign_key (private); every job
        # verifies the SIF with verify_key (public) before its ranks start, and refuses it (exit 77) if it fails.
        "sign_key": _f((str, NONE), None, pattern=SBATCH_SAFE, expect="a PEM private key path without spaces"),
        # The SIF's squashfs: gzip is Apptainer's default and mounts everywhere; zstd builds many times faster at
        # the same size and needs zstd in the squashfuse or kernel that mounts it (README: runner build).
        "sif_compression": _f(str, "gzip", choices=SIF_COMPRESSIONS),
        "verify_key": _f((str, NONE), None, pattern=SBATCH_SAFE, expect="a PEM public key path without spaces"),
    },
    "slurm": {
        "partition": _f((str, NONE), None, pattern=SBATCH_SAFE),
        "account": _f((str, NONE), None, pattern=SBATCH_SAFE),
        "qos": _f((str, NONE), None, pattern=SBATCH_SAFE),
        "constraint": _f((str, NONE), None, pattern=SBATCH_SAFE),
        "time": _f((str, int), "01:00:00", pattern=TIME, min=1,
                   expect="Slurm time like 01:00:00, 2-00:00:00 or minutes"),
        "cpus_per_task": _f(int, 4, **POS_INT),
        "mem": _f((str, int, NONE), None, pattern=SBATCH_SAFE, min=0),
        "gpus_per_node": _f((int, NONE), None, min=0),
        "extra_flags": _f(list, []),
        "signal": _f(str, "USR2", choices=("USR1", "USR2", "TERM", "INT", "HUP", "URG")),
        "signal_lead_s": _f(int, 120, min=10),
        "requeue": _f(bool, True),
        # Nodes allocated beyond num_nodes: an in-job restart (resume.in_job) trains on one in place of a node named
        # bad, without leaving the job (--no-kill keeps the job alive when a node is lost).
        "spare_nodes": _f(int, 0, min=0),
    },
    "env": {"*": True},
    "network": {
        "ifname": _f((str, NONE), None, pattern=ENV_NAME, expect="an interface name like ib0 or eth0"),
        "ib_hca": _f((str, NONE), None, pattern=SBATCH_SAFE),
        "debug": _f(bool, False),
        "pg_timeout_s": _f(int, 300, min=10, max=MAX_TIMEOUT_S),
    },
    "checkpoint": {
        "every_n_steps": _f(int, 100, **POS_INT),
        "keep_last": _f(int, 3, **POS_INT),
        "exact_resume": _f(bool, True),
    },
    "resume": {
        "enabled": _f(bool, True),
        "max_restarts": _f(int, 3, min=0),
        "backoff_s": _f((int, float), 60, min=0),
        "force": _f(bool, False),
        "exclude_nodes_s": _f((int, float), 21600, min=0),
        "owner_check_every_n_steps": _f(int, 20, **POS_INT),  # how often the ranks check they still own the run
        "successor": _f(bool, False),  # queue the next attempt behind each job (afternotok) instead of requeueing
        "in_job": _f(bool, False),  # a crash or a hang restarts the training in the same job (srun again), not requeue
        # in_job: a step beside the training imports torch and Lightning, then becomes the next attempt's ranks
        "warm_standby": _f(bool, True),
    },
    "fsdp": {
        "blocks": _f(list, []),  # class names (or module.Class) sharded as units; none: each direct child
    },
    "nonfinite": {
        "action": _f(str, "stop", choices=("stop", "skip")),
        "max_skips": _f(int, 10, min=0),
    },
    "watchdog": {
        "enabled": _f(bool, True),
        "factor": _f((int, float), 10, min=2),
        # The shortest step limit: a hang is named within it and a few seconds (the reports) of the last step.
        "floor_s": _f((int, float), 5, min=1),
        "straggler_report_s": _f((int, float), 30, min=1),
        "first_step_s": _f((int, float), 900, min=1),  # from the start of fit to the first step (a hung loader)
        "phase_s": _f((int, float), 900, min=1),  # a validation's, checkpoint's, epoch end's pause: first time, at most
        "plain_floor_s": _f((int, float), 30, min=1),  # floor_s of a plain program: runner sees none of its phases
    },
    "alerts": {
        "enabled": _f(bool, True),
        "kind": _f(str, "slack", choices=("slack", "json")),
        "url_env": _f(str, "RUNNER_WEBHOOK_URL", pattern=ENV_NAME),
        "url_file": _f((str, NONE), None),
        "events": _f(list, list(EVENTS)),
        "timeout_s": _f((int, float), 5, min=0.1),
        "retries": _f(int, 3, min=0),
        "backoff_s": _f((int, float), 1.0, min=0),
    },
    # ESPnet3's helper workloads on Dask (`runner parallel`), apart from trainer: runner.spec.parallel.
    "parallel": {
        "env": _f(str, "local", choices=PARALLEL_ENVS),
        "n_workers": _f(int, 1, **POS_INT),
        "options": {"*": True},  # Dask's: threads_per_worker (local); dask-jobqueue's queue, cores, ... (slurm)
        "provider": {"*": True},  # _target_ + kwargs: builds each worker's environment once
        "forward": _f((str, NONE), None, pattern=TARGET, expect="module.function: forward(idx, **env)"),
        "reduce": _f((str, NONE), None, pattern=TARGET, expect="module.function: reduce(results)"),
        "items": _f((int, NONE), None, min=0),
        "chunk_size": _f(int, 100, **POS_INT),
        "retries": _f(int, 2, min=0),
    },
    "preflight": {
        "enabled": _f(bool, True),
        "min_busbw_gbps": _f((int, float, NONE), None, min=0),
        "fail_below_median": _f((int, float), 0.5, min=0),  # a node below this x the median node's busbw fails
        "warn_below_median": _f((int, float), 0.8, min=0),  # ... and below this warns
        "probe_mib": _f(int, 16, **POS_INT),
        "probe_budget_s": _f((int, float), 3, min=0.1),  # the bandwidth probe's time; a slow link is cut short
        "timeout_s": _f(int, 10, **POS_INT),
        "min_free_gb": _f((int, float), 1, min=0),
        "paths": _f(list, []),
        "fail_on_warn": _f(bool, False),
        "reuse_s": _f((int, float), 3600, min=0),
        "only": _f(bool, False),  # set by `runner preflight`: the checks alone, never training
    },
}

# A config shares its file with the program it runs (program mode, `command:`). runner reads these top-level keys,
# and so may the program; `command` (which makes it program mode) is always a top-level key too.
SHARED = ("num_nodes", "num_device", "trainer", "dataloader", "parallel")
TOP_LEVEL = ("command",)
# runner's own settings: at the top level, or all of them in one `runner:` block (then every other top-level key,
# ESPnet3's `scheduler:`, `seed:` and `model:` included, is the program's).
RUNNER_ONLY = tuple(k for k in SCHEMA if k not in SHARED and k not in TOP_LEVEL)
BLOCK = "runner"
PROGRAM = "program"  # the resolved config's copy of the program's top-level keys (a stored config reads it back)
# Program mode: the program builds its own Trainer and loaders. runner reads these Trainer keys and each loader's
# sharding (dataloader.<split>.total_shards/dist_world_size); every other key there is the program's.
PROGRAM_TRAINER: dict[str, Any] = {
    "accelerator": _f(str, "auto", choices=("cpu", "gpu", "cuda", "auto")),
    "devices": _f((int, NONE), None, **POS_INT),  # None: = num_device
    "num_nodes": _f((int, NONE), None, **POS_INT),  # None: = num_nodes
    "strategy": _f(str, "auto", choices=(*STRATEGIES, "auto")),
    "*": True,
}
SHARDING = {k: _LOADER[k] for k in ("total_shards", "dist_world_size")}  # what runner reads of a program's loader
SCHEMA_PROGRAM: dict[str, Any] = {**{k: v for k, v in SCHEMA.items() if k not in ("model", "data")},
                                  "trainer": PROGRAM_TRAINER, "dataloader": {"*": True},
                                  # ESPnet3 runs its own Dask from it: its other keys (allow_overwrite_lock) are its
                                  "parallel": {**SCHEMA["parallel"], "*": True}}


def fill_defaults(data: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """Give ``data`` (a validated config) every key of ``schema`` it lacks, at its default, in place; a required
    key stays missing. A run directory's config written before a key existed reads as if it had been written
    today, so no reader carries a default of its own."""
    for key, spec in schema.items():
        if key == "*":
            continue
        if isinstance(spec, dict):
            section = data.setdefault(key, {})
            if isinstance(section, dict):
                fill_defaults(section, spec)
        elif isinstance(spec, F) and spec.default is not REQUIRED and key not in data:
            data[key] = copy.deepcopy(spec.default)
    return data
