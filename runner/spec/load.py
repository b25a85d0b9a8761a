"""Reading a config: YAML with line numbers, ``key=value`` overrides and ``${...}`` interpolation.

``load`` is the one entry point: read, override, interpolate, then validate (``runner.spec.validate``).
"""

from __future__ import annotations

import ast
import copy
import hashlib
import json
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from runner import redaction
from runner.errors import ConfigError
from runner.rundir import RunDir
from runner.spec import parallel, program_copy, split, validate
from runner.spec.schema import BLOCK, PROGRAM, PROGRAM_TRAINER, SCHEMA, SCHEMA_PROGRAM, SHARDING
from runner.spec.typed import RunConfig, view
from runner.spec.validate import Problems, Said

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}
_INTERP = validate.INTERP
# OmegaConf's resolver syntax, ${name:args} (${oc.env:HOME}, ESPnet3's ${self_name:}): the program's to resolve.
_BUILTIN = re.compile(r"\$\{\s*(run_dir|program_config|container_python)\s*\}")
_RESOLVER = re.compile(r"\$\{\s*[A-Za-z_][\w.\-]*\s*:[^{}]{0,40}\}?")


@dataclass
class Config:
    """A validated, fully resolved config plus where it came from."""

    data: RunConfig
    path: Path
    lines: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # warnings from validation (printed, recorded in the manifest)
    takes_dataloader: bool | None = None  # whether data._target_ takes `dataloader` (None: not known statically)
    # Program mode: the program's config (program/<config name>): the file as written, after the overrides, never
    # interpolated (the program resolves its ${...}), without the runner: block; with program_copy: resolved
    # (LightningCLI) its keys and trainer: alone, interpolated (runner.spec.program_copy). None in runner's own mode.
    document: dict[str, Any] | None = None

    @property
    def program_mode(self) -> bool:
        """The config names a command (program mode) instead of runner's own model/data."""
        return self.data.get("command") is not None

    @property
    def name(self) -> str:
        return str(self.data["name"])

    @property
    def world_size(self) -> int:
        return int(self.data["num_nodes"]) * int(self.data["num_device"])

    @property
    def local_batch(self) -> int | None:
        """Per-rank batch; None in program mode (the program's own, as are the two below)."""
        if self.program_mode:
            return None
        batch = self.data["dataloader"]["train"]["batch_size"]
        return None if batch is None else int(batch)

    @property
    def accumulate(self) -> int | None:
        return None if self.program_mode else int(self.data["trainer"]["accumulate_grad_batches"])

    @property
    def global_batch(self) -> int | None:
        local, acc = self.local_batch, self.accumulate
        return None if local is None or acc is None else local * self.world_size * acc

    def hash(self) -> str:
        """Hash of everything that determines the training trajectory.

        The node count, the scheduler, the watchdog and alert settings are left out so that a run can resume on other
        capacity (accumulation is re-derived to keep the global batch) without being called a new config. In
        program mode the command and the program's keys are in (the program's config decides its trajectory); how
        its copy is written (``program_copy``) is not: the program reads the same values either way.
        """
        d: dict[str, Any] = copy.deepcopy(dict(self.data))
        if not self.program_mode:  # runner's own mode hashes as it did before program mode existed
            d.pop("command", None)
            d.pop(PROGRAM, None)
        for key in ("name", "num_nodes", "num_device", "scheduler", "run_root", "slurm", "alerts", "preflight",
                    "resume", "env", "network", "container", "parallel", "watchdog", "program_copy"):
            d.pop(key, None)
        if not (d.get("fsdp") or {}).get("blocks"):  # the default: configs hash as before the key existed
            d.pop("fsdp", None)
        for key in ("devices", "num_nodes", "accumulate_grad_batches"):
            d["trainer"].pop(key, None)
        for loader in d["dataloader"].values():
            if isinstance(loader, dict):
                loader.pop("dist_world_size", None)
        d["global_batch"] = self.global_batch
        return hashlib.sha256(json.dumps(_str_keys(d), sort_keys=True).encode()).hexdigest()[:16]


def _str_keys(value: Any) -> Any:
    """JSON-ready: a program's mapping may have integer keys (YAML allows them), which sort_keys cannot mix."""
    if isinstance(value, dict):
        return {str(k): _str_keys(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_str_keys(v) for v in value]
    return value


def _line_map(node: yaml.Node, prefix: str = "", out: dict[str, int] | None = None) -> dict[str, int]:
    """Map each dotted key path to its 1-based line in the YAML file (the graph was bounded by ``_check_graph``)."""
    out = {} if out is None else out
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            path = f"{prefix}.{k.value}" if prefix else str(k.value)
            out.setdefault(path, k.start_mark.line + 1)
            _line_map(v, path, out)
    return out


# Bounds on what a config may make the loader do: a few KB of aliases must not expand to millions of nodes.
MAX_BYTES = 1 << 20
MAX_NODES = 100_000
MAX_DEPTH = 64
MAX_INT = 1 << 63  # Slurm, torch and JSON readers all stop at 64 bits
_INT_RE = re.compile(r"[-+]?[0-9]+|0x[0-9a-fA-F]+|0o[0-7]+")
_FLOAT_RE = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)")


class _Loader(yaml.SafeLoader):
    """YAML 1.2 core-schema scalars: ``2:00:00`` stays a string (YAML 1.1 reads base-60 7200), ``on``/``yes``
    stay strings, ``010`` is ten, dates stay strings; integers are bounded; nesting stops at MAX_DEPTH while
    composing (before Python's recursion limit)."""

    depth = 0

    def fetch_flow_collection_start(self, token_class: Any) -> None:
        """Refuse deep ``[[[[...`` while scanning: the scanner's look-ahead is quadratic in the flow depth."""
        if self.flow_level >= MAX_DEPTH:
            raise _Bound(None, None, f"found nesting deeper than {MAX_DEPTH} levels; expected a shallow config",
                         self.get_mark())
        super().fetch_flow_collection_start(token_class)

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
                raise _Bound(None, None, f"found nesting deeper than {MAX_DEPTH} levels; expected a shallow config",
                             mark)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


_Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if not tag.endswith((":bool", ":int", ":float", ":timestamp"))]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)\Z"),
                              list("tTfF"))
_Loader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(rf"^(?:{_INT_RE.pattern})\Z"),
                              list("-+0123456789"))
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(rf"^(?:{_FLOAT_RE.pattern})\Z"),
                              list("-+0123456789."))


class _Bound(yaml.MarkedYAMLError):
    """A value the loader refuses (not a syntax error): its message is the whole line."""


def _scalar_error(node: yaml.Node, what: str) -> yaml.MarkedYAMLError:
    return _Bound(None, None, what, node.start_mark)


def _construct_bool(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> bool:
    text = str(loader.construct_scalar(node)).lower()
    if text not in ("true", "false"):
        raise _scalar_error(node, f"found {text[:20]!r} tagged as a boolean; expected true or false")
    return text == "true"


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = str(loader.construct_scalar(node))
    if len(text) > 25 or not _INT_RE.fullmatch(text):
        raise _scalar_error(node, f"found integer {text[:20]!r}{'...' if len(text) > 20 else ''}; expected an "
                                  f"integer below 2**63")
    value = int(text[2:], {"x": 16, "o": 8}[text[1]]) if text[:2] in ("0x", "0o") else int(text, 10)
    if abs(value) >= MAX_INT:
        raise _scalar_error(node, f"found integer {text[:20]!r}; expected an integer below 2**63")
    return value


def _construct_float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float:
    text = str(loader.construct_scalar(node))
    if len(text) > 40 or not _FLOAT_RE.fullmatch(text):
        raise _scalar_error(node, f"found number {text[:20]!r}; expected a decimal number like 0.5")
    low = text.lower().lstrip("+")
    return {".inf": float("inf"), "-.inf": float("-inf"), ".nan": float("nan")}.get(low) or float(text)


def _construct_refused(loader: yaml.SafeLoader, node: yaml.Node) -> None:
    raise _scalar_error(node, f"found a {node.tag.rpartition(':')[2]!r} value; expected plain YAML (mappings, lists, "
                              "strings, numbers, true/false, null)")


for _tag in ("set", "binary", "timestamp", "omap", "pairs"):  # nothing in a config needs them; JSON cannot hold them
    _Loader.add_constructor(f"tag:yaml.org,2002:{_tag}", _construct_refused)
_Loader.add_constructor("tag:yaml.org,2002:bool", _construct_bool)
_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)


class _Dumper(yaml.SafeDumper):
    """Quotes every string that either YAML 1.1 (the job's reader) or runner's 1.2 loader would read as something
    else, so a written config reads back the same with both (``1e3`` and ``0o17`` stay strings). A value used
    twice (a YAML alias, a ``${key}`` of a mapping) is written out twice: no anchors for a reader to follow."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


for _ch, _resolvers in _Loader.yaml_implicit_resolvers.items():
    for _tag, _rx in _resolvers:
        _Dumper.add_implicit_resolver(_tag, _rx, [_ch])


def dump(data: Any) -> str:
    """YAML text of a config (``config.yaml`` in a run directory, ``runner validate``'s output)."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False)


def _check_graph(root: yaml.Node) -> tuple[int, str] | None:
    """Why the composed document is unsafe to build (alias bomb, recursion, depth, duplicate key), or None.

    Aliases make the node graph a DAG: sizes are memoised per node, so the check is linear in the file.
    """
    size: dict[int, int] = {}
    active: set[int] = set()
    aliased = False  # a node met twice: the document uses aliases

    def walk(node: yaml.Node, depth: int) -> int:
        nonlocal aliased
        if id(node) in size:
            aliased = True
            return size[id(node)]
        line = node.start_mark.line + 1
        if id(node) in active:
            raise _Stop(line, "found a recursive alias (a node that contains itself); expected a tree")
        if depth > MAX_DEPTH:
            raise _Stop(line, f"found nesting deeper than {MAX_DEPTH} levels; expected a shallow config")
        active.add(id(node))
        total = 1
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, int] = {}
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                    if k.value in first:
                        raise _Stop(k.start_mark.line + 1, f"key {str(k.value)[:60]!r} is given twice "
                                    f"(first at line {first[k.value]}); expected each key once. hint: keep one")
                    first[k.value] = k.start_mark.line + 1
                total += walk(k, depth + 1) + walk(v, depth + 1)
        elif isinstance(node, yaml.SequenceNode):
            total += sum(walk(v, depth + 1) for v in node.value)
        active.discard(id(node))
        if total > MAX_NODES and aliased:
            raise _Stop(line, f"found aliases that expand to more than {MAX_NODES} values; expected a "
                        "plain config. hint: remove the nested aliases")
        if total > MAX_NODES:
            raise _Stop(line, f"found more than {MAX_NODES} keys and values; expected a config of fewer. hint: "
                        "keep data (lists of files, vocabularies) in files the config names")
        size[id(node)] = total
        return total

    try:
        walk(root, 0)
    except _Stop as e:
        return e.line, e.what
    return None


class _Stop(Exception):
    def __init__(self, line: int, what: str):
        super().__init__(what)
        self.line, self.what = line, what


def parse_yaml(text: str, where: str) -> tuple[Any, yaml.Node | None]:
    """Parse YAML text with the bounded 1.2-style loader; every failure is one ConfigError line."""
    if len(text) > MAX_BYTES:
        raise ConfigError([f"{where}: found {len(text)} bytes; expected a config under {MAX_BYTES} bytes"])
    if "\0" in text:
        line = text.count("\n", 0, text.index("\0")) + 1
        raise ConfigError([f"{where}:{line}: found a NUL byte; expected text. hint: is this a binary file?"])
    loader: _Loader | None = None
    try:
        loader = _Loader(text)  # the reader refuses control characters here already
        node = loader.get_single_node()
        if node is None:
            return None, None
        bad = _check_graph(node)
        if bad:
            raise ConfigError([f"{where}:{bad[0]}: {bad[1]}"])
        return loader.construct_document(node), node
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        at = f":{mark.line + 1}" if mark else ""
        problem = " ".join(str(e.problem or e.context or "syntax error").split())
        if isinstance(e, _Bound):
            raise ConfigError([f"{where}{at}: {problem}"]) from None
        raise ConfigError([f"{where}{at}: YAML syntax error: {problem}. hint: check indentation and quoting"]) \
            from None
    except yaml.YAMLError as e:
        raise ConfigError([f"{where}: YAML error: {' '.join(str(e).split())[:200]}"]) from None
    except RecursionError:
        raise ConfigError([f"{where}: found nesting too deep to read; expected a shallow config"]) from None
    finally:
        if loader is not None:
            loader.dispose()


def read_text(path: Path, what: str = "config", limit: int = MAX_BYTES) -> str:
    """A small regular text file, checked before it is opened: a FIFO, a device or a directory is refused (reading
    one would hang or never end), and so is a file over ``limit`` bytes (never read whole)."""
    from runner.rundir import Unreadable, read_regular

    try:
        data = read_regular(path, limit)
    except Unreadable as e:
        raise ConfigError([f"{path}: {e.found}; expected a {what} file under {limit} bytes. hint: {e.hint}"]) \
            from None
    except OSError as e:
        raise ConfigError([f"{path}: cannot read {what}: {e.strerror or type(e).__name__}. hint: check the path"]) \
            from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError([f"{path}: found bytes that are not UTF-8; expected a text file"]) from None


def read_yaml(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """Parse a YAML mapping, turning every problem into one-line ConfigErrors with a line number."""
    text = read_text(path)
    data, node = parse_yaml(text, str(path))
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: found {type(data).__name__} at top level; expected a mapping of keys"])
    return data, _line_map(node) if node else {}


def _set(d: dict[str, Any], dotted: str, value: Any) -> None:
    if dotted.count(".") >= MAX_DEPTH:
        raise ConfigError([f"override {dotted[:60]}...: found a key {dotted.count('.') + 1} levels deep; expected at "
                           f"most {MAX_DEPTH}. hint: check the key path"])
    *parents, last = dotted.split(".")
    for p in parents:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ConfigError([f"override {dotted}: {p} is not a mapping. hint: check the key path"])
    d[last] = value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> None:
    """Apply ``key.path=value`` overrides; values are parsed as YAML scalars (so 2 is an int)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError([f"override {item!r}: found no '='; expected key.path=value. hint: trainer.max_steps=10"])
        try:
            value = parse_yaml(raw, f"override {key}")[0] if raw else ""
        except ConfigError as e:
            if "YAML syntax error" not in str(e):
                raise
            value = raw  # not YAML (e.g. an unbalanced bracket): the text itself
        _set(data, key.strip(), value)


MAX_INTERP_WORK = 10_000  # ${...} evaluations per config
MAX_STRING = 1 << 16  # characters an interpolated string may grow to
MAX_PROBLEMS = 50  # lines printed for one config; the rest are counted
MAX_CHAIN = 150  # ${a} -> ${b} -> ... (each link is a few Python frames; the recursion limit is 1000)


class _Interp:
    """``${...}`` resolution, memoised per key (a chain of 20 references is 20 evaluations, not 2**20) and
    bounded: a cycle, a string or number that grows without bound, or too much work is one problem line."""

    def __init__(self, root: dict[str, Any], builtins: dict[str, Any]):
        self.root, self.builtins = root, builtins
        self.memo: dict[str, Any] = {}
        self.active: set[str] = set()
        self.failed: dict[str, _InterpError] = {}
        self.work = 0

    def key(self, dotted: str) -> Any:
        if dotted in self.builtins:
            return self.builtins[dotted]
        if dotted in self.memo:
            return self.memo[dotted]
        if dotted in self.active:
            raise _InterpError(f"a reference that does not lead back to itself (${{{dotted}}} does)")
        cur: Any = self.root
        for part in dotted.split("."):
            if not isinstance(cur, dict) or part not in cur:
                raise _InterpError("an interpolation of an existing key (e.g. ${num_device})")
            cur = cur[part]
        if dotted in self.failed:
            raise self.failed[dotted]
        if len(self.active) >= MAX_CHAIN:
            raise _InterpError(f"a chain of fewer than {MAX_CHAIN} references")
        self.active.add(dotted)
        try:
            self.memo[dotted] = value = self.value(cur)
        except _InterpError as e:
            self.failed[dotted] = e
            raise
        finally:
            self.active.discard(dotted)
        return value

    def value(self, value: Any) -> Any:
        if not isinstance(value, str) or "${" not in value:
            return value
        resolver = _RESOLVER.search(value)
        if resolver:
            raise _Resolver(resolver.group(0))
        whole = _INTERP.fullmatch(value.strip())
        if whole:
            return self.expr(whole.group(1))
        out = _INTERP.sub(lambda m: str(self.expr(m.group(1))), value)
        if len(out) > MAX_STRING:
            raise _InterpError(f"an interpolated string under {MAX_STRING} characters")
        return out

    def word(self, word: str) -> str | list[str]:
        """One word of a command written as a string (``validate.split_command``), each ``${...}`` replaced by its
        value's text, whole: spaces, quotes, ``$`` or nothing, it stays inside this one word. A word that is one
        ``${...}`` of a list is one word per item, as ``"$@"`` in a shell (``--stages ${stages}``, ESPnet3's)."""
        if "${" not in word:
            return word
        resolver = _RESOLVER.search(word)
        if resolver:
            raise _Resolver(resolver.group(0))
        whole = _INTERP.fullmatch(word)
        if whole and isinstance(items := self.expr(whole.group(1)), list):
            return [_one_argument(item) for item in items]
        out = _INTERP.sub(lambda m: _one_argument(self.expr(m.group(1))), word)
        if len(out) > MAX_STRING:
            raise _InterpError(f"an interpolated string under {MAX_STRING} characters")
        return out

    def expr(self, expr: str) -> Any:
        """``a.b`` or small integer arithmetic like ``num_nodes * num_device`` (no calls, no attributes)."""
        self.work += 1
        if self.work > MAX_INTERP_WORK or len(expr) > 200:
            raise _InterpError(f"interpolations within the work limit ({MAX_INTERP_WORK} evaluations)")
        try:
            tree = ast.parse(expr.strip(), mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            raise _InterpError("an interpolation of an existing key (e.g. ${num_device})") from None
        return self.node(tree)

    def node(self, n: ast.AST) -> Any:
        if isinstance(n, ast.Constant) and type(n.value) is int:
            return n.value
        if isinstance(n, (ast.Name, ast.Attribute)):
            return self.key(ast.unparse(n))
        if isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            left, right = self.node(n.left), self.node(n.right)
            if type(left) is not int or type(right) is not int:
                raise _InterpError("integers on both sides of + - * //")
            if isinstance(n.op, ast.FloorDiv) and right == 0:
                raise _InterpError("a non-zero divisor")
            result = _OPS[type(n.op)](left, right)
            if abs(result) >= MAX_INT:
                raise _InterpError("a result below 2**63")
            return result
        raise _InterpError("an interpolation of an existing key (e.g. ${num_device})")


def _one_argument(value: Any) -> str:
    """A value's text inside a command's word; a list or mapping is no one argument (a list is several, as a word
    of its own: ``word``)."""
    if isinstance(value, (dict, list)):
        raise _InterpError("a value that is one argument (a string or a number), not a "
                           + ("mapping" if isinstance(value, dict) else "list (a list is a word of its own: "
                                                                         "--flag ${key})"))
    return str(value)


class _InterpError(Exception):
    pass


class _Words(list[str]):
    """A command written as a string, split as written (``validate.split_command``): resolved word by word."""


class _Resolver(_InterpError):
    """An OmegaConf resolver in a value runner reads: runner runs none."""


def _resolve_all(node: Any, interp: _Interp, problems: Problems, path: str,
                 theirs: Callable[[str], bool] = lambda path: False) -> Any:
    """Interpolate every value; where ``theirs(path)`` (a key runner does not read), a ``${...}`` that does not
    resolve here is left as written: the program resolves it."""
    if isinstance(node, dict):
        return {k: _resolve_all(v, interp, problems, f"{path}.{k}" if path else str(k), theirs)
                for k, v in node.items()}
    if isinstance(node, _Words):
        words = [_resolve_leaf(w, interp.word, problems, path, theirs) for w in node]
        return [one for w in words for one in (w if isinstance(w, list) else [w])]
    if isinstance(node, list):
        return [_resolve_all(v, interp, problems, path, theirs) for v in node]
    return _resolve_leaf(node, interp.value, problems, path, theirs)


def _resolve_leaf(node: Any, resolve: Callable[[Any], Any], problems: Problems, path: str,
                  theirs: Callable[[str], bool]) -> Any:
    try:
        return resolve(node)
    except _Resolver as e:
        if not theirs(path):
            problems.failed.add(path)
            problems.add(path, Said(f"an OmegaConf resolver {e}"), "a value runner can read",
                         "runner reads this key itself and runs no resolvers: write the value here (resolvers are "
                         "fine in your program's keys)")
        return node
    except _InterpError as e:
        if not theirs(path):
            problems.failed.add(path)
            problems.add(path, node, str(e), "check the key inside ${...}")
        return node


def fill_builtins(value: Any, builtins: dict[str, str]) -> Any:
    """``${run_dir}``, ``${program_config}`` and ``${container_python}`` written out in the program's config: they
    are runner's names, which the program cannot resolve; every other ``${...}`` stays for the program."""
    if isinstance(value, dict):
        return {k: fill_builtins(v, builtins) for k, v in value.items()}
    if isinstance(value, list):
        return [fill_builtins(v, builtins) for v in value]
    if isinstance(value, str) and "${" in value:
        return _BUILTIN.sub(lambda m: builtins[m.group(1)], value)
    return value


def _resolver(interp: _Interp) -> Callable[[Any], Any]:
    """One value of the program's copy resolved as runner resolves its own keys (``program_copy.resolved``)."""
    def resolve(value: Any) -> Any:
        try:
            return interp.value(value)
        except _InterpError:
            raise program_copy.Unresolved from None
    return resolve


def _programs(path: str) -> bool:
    """Program mode: a key under trainer: or dataloader: that runner does not read (it is the program's)."""
    parts = path.split(".")
    if parts[0] == "trainer":
        return len(parts) > 1 and parts[1] not in PROGRAM_TRAINER
    return parts[0] == "dataloader" and not (len(parts) == 3 and parts[2] in SHARDING)


def load(path: str | Path, overrides: list[str] | None = None, run_dir: str = "${run_dir}",
         files: bool = True, kind: str = "train", start: bool = True) -> Config:
    """Read, override, interpolate and validate a config; raise ConfigError listing every problem.

    ``files``: check paths the config names on this machine (``container.code`` next to the config, ``run_root``);
    False for a run directory's own resolved config, which was checked when it was submitted.
    ``start``: also check what starting the run from here needs, as ``runner submit`` would (its scheduler takes its
    runtime, sbatch reads its run directory, its command starts in this directory); False for ``runner build``,
    which builds a local config's image for another scheduler.
    ``kind="parallel"`` (``runner parallel``) checks only what a Dask workload reads (``SCHEMA_PARALLEL``):
    its ``data`` then holds no training sections, and the training properties of Config do not apply.
    ``${...}`` names keys as the file does (``${runner.seed}`` under a runner: block); ``${run_dir}`` is
    ``run_dir`` and ``${program_config}`` the program's config in it (``RunDir.program_config``: ``program/`` and
    the config file's own name).
    """
    path = Path(path)
    data, lines = read_yaml(path)
    apply_overrides(data, overrides or [])
    document = copy.deepcopy(data)  # the program's config: as written, after the overrides, never interpolated
    problems = Problems(path, lines)
    validate.check_text(data, problems)
    validate.check_parallel(data, problems)
    if kind == "train" and parallel.only_parallel(data):
        raise ConfigError([f"{path}: found only a parallel: block (a Dask workload); expected a training config "
                           f"(trainer:, model:, data:). hint: run it with `runner parallel {path}`"])
    settings = data[BLOCK] if isinstance(data.get(BLOCK), dict) else data
    settings.setdefault("name", None)
    parts = split.split(data, problems)
    program = kind == "train" and parts.own.get("command") is not None
    # ${container_python} needs the image: `runner submit` writes it out (render.program_python); kept until then.
    builtins = {"run_dir": run_dir, "program_config": str(RunDir(Path(run_dir)).program_config(path.name)),
                "container_python": "${container_python}"}
    mine = parts.own
    if program and isinstance(mine["command"], str):  # split as written; each word's ${...} substituted inside it
        words = validate.split_command(mine["command"], problems)
        if words is None:
            problems.failed.add("command")  # said once; the schema check leaves it BAD
        else:
            mine = {**mine, "command": _Words(words)}
    own = _resolve_all(mine, _Interp(data, builtins), problems, "", _programs if program else lambda p: False)
    if own.get("name") is None:
        own["name"] = re.sub(r"[^A-Za-z0-9_.\-]", "-", path.stem)[:100] or "run"
    base = path.resolve().parent
    takes = None
    if kind == "train":
        for key in ("model", "data"):
            if program and key in own:
                problems.add(key, Said(f"both command and {key}"), "one of them",
                             f"model: and data: are runner's own training, command: your program: remove one; if "
                             f"{key}: is your program's, put runner's settings in a runner: block")
                del own[key]
        written = validate.runtime_written(own)
        copy_written = program_copy.KEY in own
        validate.check_schema(own, SCHEMA_PROGRAM if program else SCHEMA, problems)
        validate.default_runtime(own, written)
        validate.check_command(own, problems)
        if program:
            program_copy.choose(own, copy_written, parts.own.get("command"), builtins["program_config"], problems)
        validate.check_rules(own, problems, base if files else None, program)
        if files and start:
            validate.check_where_it_runs(own, problems)
        if files and start and program:
            validate.check_command_start(own, problems, Path.cwd())
        takes = validate.check_targets(own, problems, base)
        own[PROGRAM] = copy.deepcopy(parts.program)
    else:
        validate.check_schema(own, parallel.SCHEMA_PARALLEL, problems)
        if not problems.items:
            parallel.check(own["parallel"], problems, need_workload=True)
            validate.check_env(own["env"], problems)
        validate.check_targets(own, problems, base)
    if problems.items:
        shown, more = problems.items[:MAX_PROBLEMS], len(problems.items) - MAX_PROBLEMS
        raise ConfigError(shown + ([f"{path}: ... and {more} more problems like these"] if more > 0 else []))
    doc = {k: fill_builtins(v, builtins) for k, v in document.items() if k != BLOCK} if program else None
    if program and own[program_copy.KEY] == program_copy.RESOLVED:
        doc, left = program_copy.resolved(document, list(parts.program), _resolver(_Interp(data, builtins)),
                                          own["num_nodes"], own["num_device"])
        if left:
            problems.note(f"{problems.name(program_copy.KEY)}: resolved: {', '.join(left)} left as written (a "
                          "${...} runner cannot resolve: an OmegaConf resolver or a key it does not have)")
    redaction.remember_config(own)  # whatever this process writes for the run from now on: without its webhook URL
    return Config(data=view(own), path=path, lines=lines, notes=problems.notes, takes_dataloader=takes,
                  document=doc)


def from_dict(data: dict[str, Any], path: Path) -> Config:
    """Rebuild a Config from an already resolved dict (as stored in a run directory)."""
    return Config(data=view(data), path=path)

