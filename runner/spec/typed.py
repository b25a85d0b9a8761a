"""The typed view of a validated config: what every module reads after validation, checked by mypy.

These TypedDicts mirror ``runner.spec.schema.SCHEMA`` key for key (a test compares them), so a mistyped key
is found by mypy on a laptop, not by a job at 3 a.m. Free-form sections (``model``, ``data``, ``env``, extra
Lightning Trainer arguments) stay open mappings. In program mode (``command``) ``model`` and ``data`` are absent,
``trainer`` and ``dataloader`` also hold the program's own keys, and the keys declared here that the program did
not set are filled with the schema's defaults (a loader's ``batch_size`` is None: the program's own). At run time
the view is the plain dict that was validated (or read back from the run directory's ``config.yaml``): no copy,
no conversion.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypedDict, cast

import yaml


class Trainer(TypedDict):
    accelerator: str
    devices: int
    num_nodes: int
    strategy: str
    precision: str | int
    max_steps: int
    max_epochs: int | None
    accumulate_grad_batches: int  # derived during validation: never None after it


class Loader(TypedDict):
    total_shards: int | None  # None: a program's loader whose file does not name it (runner invents none)
    dist_world_size: int | None
    batch_size: int | None  # None in program mode
    num_workers: int


class Dataloader(TypedDict):
    train: Loader
    valid: Loader


class Container(TypedDict):
    ngc_tag: str
    base_image: str | None
    apt: list[str]
    pip: list[str]
    nccl_tests: bool
    perftest: bool
    install_lightning: bool
    runtime: str
    builder: str
    image_dir: str
    image: str | None
    allow_missing_image: bool
    binds: list[str]
    python: str
    workdir: str
    code: list[str]
    wheelhouse: str | None
    sign_key: str | None
    verify_key: str | None
    sif_compression: str


class Slurm(TypedDict):
    partition: str | None
    account: str | None
    qos: str | None
    constraint: str | None
    time: str | int
    cpus_per_task: int
    mem: str | int | None
    gpus_per_node: int | None
    extra_flags: list[str]
    signal: str
    signal_lead_s: int
    requeue: bool
    spare_nodes: int


class Network(TypedDict):
    ifname: str | None
    ib_hca: str | None
    debug: bool
    pg_timeout_s: int


class Checkpoint(TypedDict):
    every_n_steps: int
    keep_last: int
    exact_resume: bool


class Fsdp(TypedDict):
    blocks: list[str]


class Resume(TypedDict):
    enabled: bool
    max_restarts: int
    backoff_s: float
    force: bool
    exclude_nodes_s: float
    owner_check_every_n_steps: int
    successor: bool
    in_job: bool
    warm_standby: bool


class Alerts(TypedDict):
    enabled: bool
    kind: str
    url_env: str
    url_file: str | None
    events: list[str]
    timeout_s: float
    retries: int
    backoff_s: float


class Nonfinite(TypedDict):
    action: str
    max_skips: int


class Watchdog(TypedDict):
    enabled: bool
    factor: float
    floor_s: float
    straggler_report_s: float
    first_step_s: float
    phase_s: float
    plain_floor_s: float


class Preflight(TypedDict):
    enabled: bool
    min_busbw_gbps: float | None
    fail_below_median: float
    warn_below_median: float
    probe_mib: int
    probe_budget_s: float
    timeout_s: int
    min_free_gb: float
    paths: list[str]
    fail_on_warn: bool
    reuse_s: float
    only: bool


class Parallel(TypedDict):
    env: str
    n_workers: int
    options: dict[str, Any]
    provider: dict[str, Any]
    forward: str | None
    reduce: str | None
    items: int | None
    chunk_size: int
    retries: int


class RunConfig(TypedDict):
    name: str  # filled from the file name during validation: never None after it
    num_nodes: int
    num_device: int
    seed: int
    scheduler: str
    run_root: str
    global_batch_size: int | None
    command: list[str] | None  # program mode: the argv every rank runs; None: runner's own mode (model, data)
    program_copy: str  # program mode: "as_written" or "resolved" (the program's copy of the config)
    trainer: Trainer
    model: dict[str, Any]
    data: dict[str, Any]
    dataloader: Dataloader
    container: Container
    slurm: Slurm
    env: dict[str, Any]
    network: Network
    checkpoint: Checkpoint
    resume: Resume
    fsdp: Fsdp
    nonfinite: Nonfinite
    watchdog: Watchdog
    alerts: Alerts
    preflight: Preflight
    parallel: Parallel
    program: dict[str, Any]  # the top-level keys runner does not own, as written (never interpolated)


def view(data: dict[str, Any]) -> RunConfig:
    """The typed view of a dict that has passed validation (no check here: validation did it)."""
    return cast(RunConfig, data)


def read_resolved(path: Path) -> RunConfig:
    """A run directory's ``config.yaml``: written by ``runner submit`` after validation, read by the job,
    the hooks and cron; every key the schema has a default for is there (``schema.fill_defaults``), however old
    the run."""
    from runner.rundir import Unreadable, read_regular

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's loader: ~10x faster, same result
    try:
        data = yaml.load(read_regular(path, 16 << 20).decode("utf-8"), Loader=loader)  # noqa: S506 -- a safe loader
    except (ValueError, yaml.YAMLError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise Unreadable(path, f"found no YAML ({type(e).__name__})", "restore it from the config you submitted, "
                         "or move the run directory away", expected="the config runner wrote") from None
    if not _looks_resolved(data):
        raise Unreadable(path, "found a config of another shape (a section that is not a mapping)", "restore it "
                         "from the config you submitted, or move the run directory away",
                         expected="the config runner wrote")
    from runner import redaction

    redaction.remember_config(data, path.parent)  # what this process writes into the run: without its webhook URL
    if isinstance(data, dict):  # a run submitted before a key existed reads with the key at its default
        from runner.spec.schema import SCHEMA, SCHEMA_PROGRAM, fill_defaults

        fill_defaults(data, SCHEMA if data.get("command") is None else SCHEMA_PROGRAM)
        data.setdefault("program", {})  # the program's own keys (program mode): none before it existed
    return view(data)


_SECTIONS = ("trainer", "dataloader", "container", "slurm", "env", "network", "checkpoint", "resume", "watchdog",
             "alerts", "preflight")


def _looks_resolved(data: Any) -> bool:
    """The shape every reader of a resolved config relies on: a mapping whose sections are mappings (validation filled
    every one when it was written; a run from an older runner may lack the newer ones)."""
    return isinstance(data, dict) and all(isinstance(data[k], dict) for k in _SECTIONS if k in data) and \
        all(type(data[k]) is int for k in ("num_nodes", "num_device") if k in data) and \
        isinstance(data.get("name", ""), str)
