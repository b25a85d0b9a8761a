"""Fuzzing the config path: hostile values, wrong types, aliases and odd YAML never end in a traceback.

Hypothesis generates configs (the quickstart with random keys set to random values, plus raw YAML fragments)
and command-line overrides; ``runner validate``, ``submit --dry-run`` and ``build --dry-run`` run in-process
(``runner.cli.main``) and must exit 0 or 2 without a traceback. What they render must pass ``bash -n`` (every
case), and on a sample shellcheck and hadolint; an Apptainer definition or Dockerfile never gains a section or
instruction that its template does not have. The seed is fixed (``derandomize``) and each test has a time budget,
so CI is reproducible and bounded. ``RUNNER_FUZZ_EXAMPLES`` and ``RUNNER_FUZZ_BUDGET`` scale the number of
cases and the time budget; ``RUNNER_FUZZ_COLLECT=1`` counts tracebacks by kind instead of stopping at the first
(to survey a branch).
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runner import cli
from runner.spec.schema import CONTROL, SCHEMA

pytestmark = pytest.mark.local

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = yaml.safe_load((REPO / "conf" / "quickstart.yaml").read_text())
SCALE = float(os.environ.get("RUNNER_FUZZ_EXAMPLES", "1"))
COLLECT = os.environ.get("RUNNER_FUZZ_COLLECT") == "1"  # count tracebacks by kind instead of stopping at one
BUDGET_S = {cmd: s * float(os.environ.get("RUNNER_FUZZ_BUDGET", "1"))
            for cmd, s in {"validate": 30.0, "submit": 25.0, "build": 20.0}.items()}
COUNTS: Counter[str] = Counter()
SAMPLES: dict[str, list[str]] = {"job.sbatch": [], "Dockerfile": []}


def _leaves(schema: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, sub in schema.items():
        if key == "*":
            continue
        out += _leaves(sub, f"{prefix}{key}.") if isinstance(sub, dict) else [f"{prefix}{key}"]
    return out


KEYS = _leaves(SCHEMA) + ["env.NCCL_X", "env.PATH", "env.SLURM_JOB_ID", "env.a-b", "model.dim", "model.lr",
                          "data.num_samples", "trainer.gradient_clip_val", "trainer.max_time", "dataloader.valid",
                          "dataloader", "container", "slurm", "env", "parallel", "trainer", "model", "unknown_key",
                          "model._target_", "data._target_", "dataloader.test", "trainer.x.y", "env.A.B"]
HOSTILE = st.sampled_from([
    "$(id)", "`id`", "a b", "x\ny", "x\r", "\t", "'", '"', "\\", ";rm -rf /", "${run_dir}", "${nope}",
    "${num_nodes * 1000000000000}", "${num_nodes * num_nodes * 99999999999}", "${seed}", "${name}${name}",
    "%post", "RUN id", "é", "\u2028", "a" * 300, "", " ", "-o", "--x", "*", "&a", "2:00:00", "yes", "on",
    "0x10", "1e400", ".inf", "-.inf", ".nan", "0o17", "1_000", "/etc", "../..", "runner",
    "lightning.pytorch.demos.BoringModel",
    "nowhere.Mod", "os.system", "runner.dev.example.TinyRegressor", "fsdp", "16-mixed", "gpu", "slurm", "\x00",
    "\x1b[31m", "null", "~", "[", "{", "}", "- a", "a: b", "#x", "!!python/object/apply:os.system ['id']",
]) | st.text(max_size=30)
SCALAR = st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.integers(-3, 70) | \
    st.floats(allow_nan=True, allow_infinity=True) | HOSTILE | st.dates() | st.binary(max_size=4) | \
    st.sets(st.integers(0, 3), max_size=2)
VALUE = st.recursive(SCALAR, lambda c: st.lists(c, max_size=3) | st.dictionaries(HOSTILE, c, max_size=3),
                     max_leaves=6)
FRAGMENTS = st.sampled_from([
    "", "seed: 1\n", "seed: 2:00:00\n", "num_nodes: &n 1\nnum_device: *n\n", "x: &a [*a]\n",
    "env: &e {A: 1}\nslurm: *e\n", "b: &b {p: 1}\nc: {<<: *b, q: 2}\n", "---\nseed: 1\n", "%YAML 1.1\n---\n",
    "seed: !!int '12'\n", "seed: !!float 1\n", "seed: !!binary aGk=\n", "seed: !!set {a, b}\n",
    "seed: !!timestamp 2020-01-01\n", "seed: !!python/name:os.system\n", "\tseed: 1\n", "seed: [1, 2\n",
    "trainer: {max_steps: 0x10}\n", "env: {X: 2020-01-01, Y: off, Z: 0o17}\n", "a: " + "[" * 70 + "]" * 70 + "\n",
    "slurm: {time: 90:00}\n", "name: " + "n" * 150 + "\n", "? [a, b]\n: c\n", "{a: 1, a: 2}\n",
    "seed: " + "9" * 5000 + "\n", "seed: 1\0\n", "container: {workdir: \"/w\\nRUN id\"}\n",
    "container: {python: \"python\\n%post\\n  id\"}\n", "container: {base_image: \"u\\nRUN id\"}\n",
    "env: {RUN_DIR: /tmp, IFS: x}\n", "run_root: /etc/passwd\n", "container: {code: [/etc, ../x]}\n",
    "bomb: &x [1, 1, 1, 1, 1, 1, 1, 1]\nb2: &y [*x, *x, *x, *x, *x, *x, *x, *x]\nb3: &z [*y, *y, *y, *y, *y, *y, *y]\n"
    "b4: [*z, *z, *z, *z, *z, *z, *z, *z, *z, *z, *z, *z, *z, *z, *z, *z, *z, *z, *z, *z]\n",
    # issue 30: numbers the job trips over, lone surrogates, env that changes how the script runs, long components
    "trainer: {log_every_n_steps: 0}\n", "network: {pg_timeout_s: 9223372036854775807}\n", "slurm: {time: '0'}\n",
    "slurm: {time: '0:30'}\n", 'env: {TOKEN: "a\\udcffb"}\n', '"\\udcfe": 1\n', "env: {EXECIGNORE: '*'}\n",
    "env: {PYTHONHOME: /nowhere, LD_PRELOAD: /x.so}\n", "run_root: /tmp/" + "r" * 300 + "/x\n",
    "container: {image: ../../..}\n", "container: {image: /}\n", "watchdog: {floor_s: 1.0e+300}\n",
    "extra:\n" + "".join(f"  k{i}: {i}\n" for i in range(200)),
])


def _set(d: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        if not isinstance(d.get(p), dict):
            d[p] = {}
        d = d[p]
    d[last] = value


# Values a valid config may hold that still reach a script: they must come out quoted, never as shell code.
PRINTABLE = st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF, blacklist_characters="\x7f",
                                  blacklist_categories=("Cc",)), max_size=40)
VALID_ISH = st.sampled_from([
    ("env.NCCL_X", PRINTABLE), ("env.MY_VAR", HOSTILE.filter(lambda v: not CONTROL.search(v))),
    ("container.pip", st.lists(PRINTABLE.filter(bool), max_size=3)),
    ("slurm.partition", st.from_regex(r"[A-Za-z0-9_.:,=@/+%\-\[\]]{1,20}", fullmatch=True)),
    ("name", st.from_regex(r"[A-Za-z0-9_.\-]{1,100}", fullmatch=True)),
    ("slurm.time", st.sampled_from(["2:00:00", "1-00:00:00", "90", 90, "00:30"])),
    ("container.python", st.from_regex(r"[A-Za-z0-9_.\-/+]{1,30}", fullmatch=True)),
    ("container.workdir", st.from_regex(r"/[A-Za-z0-9_.\-/+@%]{0,30}", fullmatch=True)),
    ("container.base_image", st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.\-/:@]{0,40}", fullmatch=True)),
    ("container.apt", st.lists(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9+.:=~/\-]{0,20}", fullmatch=True), max_size=3)),
    ("container.binds", st.lists(st.from_regex(r"/[A-Za-z0-9_.\-/+@%]{0,20}", fullmatch=True), max_size=2)),
    ("slurm.extra_flags", st.lists(st.from_regex(r"--[A-Za-z0-9_.:,=@/+%\-]{1,20}", fullmatch=True), max_size=2)),
    ("network.ifname", st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,14}", fullmatch=True)),
    ("trainer.precision", st.sampled_from(["bf16-mixed", "32-true", 32, "64"])),
    ("model.lr", st.floats(allow_nan=True, allow_infinity=True)),
])


@st.composite
def configs(draw: st.DrawFn) -> str:
    data = copy.deepcopy(QUICKSTART)
    if draw(st.booleans()):  # a mostly valid config whose values are odd but allowed
        for _ in range(draw(st.integers(1, 4))):
            key, values = draw(VALID_ISH)
            _set(data, key, draw(values))
        return yaml.safe_dump(data, sort_keys=False)
    for _ in range(draw(st.integers(0, 4))):
        _set(data, draw(st.sampled_from(KEYS) | HOSTILE.filter(lambda s: s and "." not in s)), draw(VALUE))
    text = yaml.safe_dump(data, sort_keys=False, allow_unicode=draw(st.booleans()))
    where = draw(st.sampled_from(["end", "start", "none"]))
    fragment = draw(FRAGMENTS)
    return {"end": text + fragment, "start": fragment + text, "none": text}[where]


def _flow(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10 ** 6).rstrip("\n").removesuffix("\n...")


OVERRIDES = st.lists(
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(KEYS) | HOSTILE, HOSTILE | VALUE.map(_flow))
    | st.sampled_from(["=", "novalue", "=x", "a..b=1", ".=1", "trainer.max_steps", "num_nodes=2", "-x", "--dry-run",
                       # issue 30: deep keys, lone surrogates (bytes that are not UTF-8 on a command line), long names
                       ".".join(["a"] * 5000) + "=1", ".".join(["env"] * 70) + "=1", "env.X=\udcff",
                       "env.\udcff=1", "run_root=/tmp/" + "r" * 300, "alerts.url_file=/tmp/" + "u" * 300,
                       "container.image=../../..", "trainer.log_every_n_steps=0", "slurm.time=0"]),
    max_size=3)


def call(argv: list[str]) -> tuple[int, str, str]:
    """``runner.cli.main`` in-process with captured output; argparse's own exit is an exit code too."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 2
    return rc, out.getvalue(), err.getvalue()


def section(out: str, name: str) -> str:
    m = re.search(rf"^--- {re.escape(name)} ---\n(.*?)(?=^--- \S+ ---$|\Z)", out, re.S | re.M)
    assert m, f"no {name} in the output"
    return m.group(1)


# A Dockerfile's instructions and an Apptainer definition's sections come only from the templates.
DOCKERFILE_MAX = {"ARG": 2, "FROM": 1, "SHELL": 1, "ENV": 2, "RUN": 5, "COPY": 2, "WORKDIR": 1, "LABEL": 99}
DEF_SECTIONS = ["%labels", "%environment", "%help", "%test"]


def check_rendered(cmd: str, out: str) -> None:
    if cmd == "submit":
        script = section(out, "job.sbatch")
        res = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr + script
        if len(SAMPLES["job.sbatch"]) < 6 and script not in SAMPLES["job.sbatch"]:
            SAMPLES["job.sbatch"].append(script)
    if cmd == "build":
        dockerfile = section(out, "Dockerfile")
        words = Counter(line.split()[0] for line in dockerfile.splitlines()
                        if line and not line.startswith((" ", "#")) and not line.startswith("\t"))
        assert all(DOCKERFILE_MAX.get(w, 0) >= n for w, n in words.items()), (words, dockerfile)
        definition = section(out, "apptainer.def")
        assert [ln for ln in definition.splitlines() if ln.startswith("%")] == DEF_SECTIONS, definition
        if len(SAMPLES["Dockerfile"]) < 6 and dockerfile not in SAMPLES["Dockerfile"]:
            SAMPLES["Dockerfile"].append(dockerfile)


def counted_call(kind: str, argv: list[str]) -> tuple[int, str, str] | None:
    """``call(argv)``, counted under ``kind``: its exit code, or (RUNNER_FUZZ_COLLECT=1) the traceback it raised by
    kind and place, then None."""
    COUNTS[f"{kind}: cases"] += 1
    try:
        rc, out, err = call(argv)
    except Exception as e:
        if not COLLECT:
            raise
        tb = traceback.extract_tb(e.__traceback__)[-1]
        COUNTS[f"{kind}: traceback {type(e).__name__} at {Path(tb.filename).name}:{tb.lineno}"] += 1
        return None
    COUNTS[f"{kind}: exit {rc}"] += 1
    return rc, out, err


def fuzz_once(cmd: str, text: str, overrides: list[str], tmp: Path, t0: float) -> None:
    if time.monotonic() - t0 > BUDGET_S[cmd]:
        COUNTS[f"{cmd}: over budget, not run"] += 1
        return
    conf = tmp / "fuzz.yaml"
    conf.write_text(text)
    flags = {"validate": [], "submit": ["--dry-run", "--allow-missing-image"], "build": ["--dry-run"]}[cmd]
    last = {"validate": [], "submit": [f"run_root={tmp}/runs"], "build": [f"container.image_dir={tmp}/images"]}[cmd]
    # the test's own overrides last, so that run_root/image_dir stay in the test's directory
    argv = [cmd, *flags, str(conf), *overrides, *last]
    answer = counted_call(cmd, argv)
    if answer is None:
        return
    rc, out, err = answer
    assert "Traceback" not in err + out, err
    assert rc in (0, 2), (rc, err)
    if rc == 2:
        assert err.strip(), "an exit 2 says why"
    else:
        check_rendered(cmd, out)


def _fuzz(cmd: str, examples: int) -> Any:
    @settings(max_examples=int(examples * SCALE), derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(text=configs(), overrides=OVERRIDES)
    def run(text: str, overrides: list[str], tmp: Path, t0: float) -> None:
        fuzz_once(cmd, text, overrides, tmp, t0)

    return run


@pytest.mark.parametrize(("cmd", "examples"), [("validate", 1500), ("submit", 600), ("build", 250)])
def test_fuzz_never_a_traceback(cmd: str, examples: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # relative run_root/image_dir land in the test's directory (and nothing is written)
    t0 = time.monotonic()
    _fuzz(cmd, examples)(tmp=tmp_path, t0=t0)
    print(f"fuzz {cmd}: {dict(sorted(COUNTS.items()))} in {time.monotonic() - t0:.1f} s")
    assert not [k for k in COUNTS if "traceback" in k]
    assert COUNTS[f"{cmd}: cases"] >= min(200, examples * SCALE)  # the budget never silently swallows it all
    assert not list(tmp_path.glob("runs*")) and not list(tmp_path.glob("images*"))


PROGRAM = {"num_nodes": 1, "num_device": 2, "stages": "train",
           "command": "python train.py --devices ${num_device} --num_nodes ${num_nodes} --config ${program_config}",
           "dataloader": {"train": {"batch_size": 4}}, "trainer": {"max_epochs": 2},
           "runner": {"name": "prog", "scheduler": "slurm", "container": {"runtime": "none"}}}
PROGRAM_KEYS = ["num_nodes", "num_device", "command", "stages", "dataloader", "dataloader.train",
                "dataloader.train.dist_world_size", "dataloader.train.total_shards", "trainer", "trainer.devices",
                "trainer.num_nodes", "runner", "runner.name", "runner.scheduler", "runner.container",
                "runner.container.runtime", "runner.container.image", "runner.slurm.time", "runner.env.X",
                "runner.alerts.url_env", "runner.checkpoint.every_n_steps", "runner.parallel", "parallel",
                "parallel.options.python", "runner.num_nodes", "runner.command", "seed", "runner.seed"]
COUNT_VALUES = st.sampled_from([None, 0, -1, 1, 2, 3, 1e309, -1e309, float("nan"), 2.0, 2.5, True, "2", "x", [1, 2],
                                {"a": 1}, 2 ** 70, "${num_nodes}", "${num_device * 2}", "${nope}"])


@st.composite
def program_configs(draw: st.DrawFn) -> str:
    """Program mode (``command:``, runner's settings in a ``runner:`` block): the counts and keys runner reads from
    the program's own config, odd, missing or hostile."""
    data = copy.deepcopy(PROGRAM)
    for key in ("num_nodes", "num_device"):
        if draw(st.booleans()):
            _set(data, key, draw(COUNT_VALUES))
    for _ in range(draw(st.integers(0, 3))):
        _set(data, draw(st.sampled_from(PROGRAM_KEYS)), draw(VALUE | COUNT_VALUES))
    if draw(st.booleans()):
        data.pop(draw(st.sampled_from(["num_nodes", "num_device", "command", "runner"])), None)
    return yaml.safe_dump(data, sort_keys=False) + draw(st.sampled_from(["", "", "seed: 1\n", "x: &a [*a]\n"]))


PROGRAM_OVERRIDES = st.lists(st.builds(lambda k, v: f"{k}={v}", st.sampled_from(PROGRAM_KEYS),
                                       (VALUE | COUNT_VALUES).map(_flow)), max_size=3)


@pytest.mark.parametrize(("cmd", "examples"), [("validate", 900), ("submit", 700), ("build", 400)])
def test_fuzz_program_mode_never_a_traceback(cmd: str, examples: int, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """2,000 program-mode configs and overrides (issue 39: a bad num_device gave KeyError 'dist_world_size')."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('train')\n")
    t0 = time.monotonic()
    flags = {"validate": [], "submit": ["--dry-run", "--allow-missing-image"], "build": ["--dry-run"]}[cmd]
    last = {"validate": [], "submit": [f"runner.run_root={tmp_path}/runs"],
            "build": [f"runner.container.image_dir={tmp_path}/images"]}[cmd]

    @settings(max_examples=int(examples * SCALE), derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(text=program_configs(), overrides=PROGRAM_OVERRIDES)
    def run(text: str, overrides: list[str]) -> None:
        if time.monotonic() - t0 > BUDGET_S[cmd]:
            COUNTS[f"program {cmd}: over budget, not run"] += 1
            return
        (tmp_path / "prog.yaml").write_text(text)
        answer = counted_call(f"program {cmd}", [cmd, *flags, "prog.yaml", *overrides, *last])
        if answer is None:
            return
        rc, out, err = answer
        assert "Traceback" not in err + out, err
        assert rc in (0, 2), (rc, err)
        # one line a problem: what was found, what was expected, a hint
        assert rc == 0 or all(line.startswith("runner: error: ") for line in err.strip().splitlines()), err

    run()
    print(f"fuzz program {cmd}: {dict(sorted(k for k in COUNTS.items() if k[0].startswith('program')))}")
    assert not [k for k in COUNTS if "traceback" in k]
    assert COUNTS[f"program {cmd}: cases"] >= min(200, examples * SCALE)
    assert not list(tmp_path.glob("runs*")) and not list(tmp_path.glob("images*"))


def _tool(name: str) -> str:
    exe = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    assert exe, f"{name} is a dev dependency (pip install -e .[dev])"
    return exe


def test_fuzz_samples_pass_shellcheck_and_hadolint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rendered samples the fuzz tests above kept (or, run alone, a short fuzz run) go through the slow linters."""
    monkeypatch.chdir(tmp_path)
    for cmd, name in (("submit", "job.sbatch"), ("build", "Dockerfile")):
        if not SAMPLES[name]:
            _fuzz(cmd, 60)(tmp=tmp_path, t0=time.monotonic())
        assert SAMPLES[name], f"no {name} rendered"
    conf = tmp_path / "hadolint.yaml"
    conf.write_text("failure-threshold: warning\n")
    for i, script in enumerate(SAMPLES["job.sbatch"]):
        f = tmp_path / f"job-{i}.sbatch"
        f.write_text(script)
        res = subprocess.run([_tool("shellcheck"), "-s", "bash", str(f)], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stdout + script
    for i, dockerfile in enumerate(SAMPLES["Dockerfile"]):
        f = tmp_path / f"Dockerfile-{i}"
        f.write_text(dockerfile)
        res = subprocess.run([_tool("hadolint"), "-c", str(conf), str(f)], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stdout + dockerfile


@pytest.mark.parametrize("text", ["seed: " + "9" * 5000 + "\n", "a: &a [*a]\n", "seed: 1\0\n",
                                  "x: &x [1,1,1,1,1,1,1,1,1,1]\n" + "".join(
                                      f"x{i}: &x{i} [{', '.join(['*x' if i == 0 else f'*x{i - 1}'] * 10)}]\n"
                                      for i in range(8))])
def test_real_process_one_line(text: str, tmp_path: Path) -> None:
    """A few through the real entry point (``python -m runner``): one line on stderr, exit 2, quickly."""
    conf = tmp_path / "c.yaml"
    conf.write_text(text)
    for cmd in (["validate"], ["submit", "--dry-run"], ["build", "--dry-run"]):
        res = subprocess.run([sys.executable, "-m", "runner", *cmd[:1], str(conf), *cmd[1:]], capture_output=True,
                             text=True, timeout=30, cwd=tmp_path)
        assert res.returncode == 2 and res.stdout == "", res.stderr
        assert res.stderr.count("\n") == 1 and res.stderr.startswith("runner: error: "), res.stderr
