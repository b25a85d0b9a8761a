"""The program's copy of its config (``program/NAME``, ``${program_config}``): as written, or resolved.

ESPnet3 reads the file with OmegaConf: it resolves its own ``${...}`` (``${num_device}``, ``${self_name:}``) and
ignores the keys it does not know, so it gets the file as written (``as_written``). LightningCLI (jsonargparse)
resolves nothing and refuses every key it does not know: it gets ``resolved``, the program's keys and ``trainer:``
with every ``${...}`` runner can resolve filled in and the layout as integers. Unset, a LightningCLI command line
(``SCRIPT fit --config ${program_config}``) gets ``resolved`` and any other ``as_written``; a written value wins.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from runner.spec.validate import Problems

AS_WRITTEN, RESOLVED = "as_written", "resolved"
KEY = "program_copy"
SUBCOMMANDS = ("fit", "validate", "test", "predict")  # LightningCLI's, each with its own --config
CONFIG_FLAGS = ("--config", "-c")
LAYOUT = re.compile(r"\$\{[^}]*\b(num_nodes|num_device)\b")  # a ${...} that names the layout (a resize changes it)


def lightning_cli(argv: list[str], config: str) -> str | None:
    """The LightningCLI subcommand ``argv`` runs on the program's config, or None: ``python main.py fit --config
    CONFIG`` (``-c CONFIG``, ``--config=CONFIG``); the subcommand follows a word that is not an option (the script,
    ``-m``'s module), so ``--stage fit`` is not one."""
    for i, arg in enumerate(argv[1:], 1):
        if arg in SUBCOMMANDS and not argv[i - 1].startswith("-"):
            rest = argv[i + 1:]
            if any(a == f"--config={config}" or (a in CONFIG_FLAGS and rest[j + 1:j + 2] == [config])
                   for j, a in enumerate(rest)):
                return arg
            return None
    return None


def choose(own: dict[str, Any], written: bool, raw_command: Any, config: str, problems: Problems) -> None:
    """After the schema and ``check_command``: the setting where the config leaves it unset (``written`` False), and
    what a LightningCLI program would refuse. ``raw_command`` is the command as written (its ``${...}`` unresolved),
    ``config`` the program's config path as the resolved command names it."""
    argv = own.get("command")
    cli = lightning_cli(argv, config) if isinstance(argv, list) else None
    if not written:
        own[KEY] = RESOLVED if cli else AS_WRITTEN
    elif own[KEY] == AS_WRITTEN and cli:
        name = problems.name(KEY)
        problems.note(f"{name}: as_written, with a LightningCLI command ({cli} --config ${{program_config}}): "
                      f"jsonargparse refuses runner's keys in it and reads ${{...}} as text; hint: {name}: resolved")
    if own[KEY] == RESOLVED and argv is not None and LAYOUT.search(str(raw_command)):
        problems.add("command", raw_command, "the layout only in the program's config",
                     f"with {problems.name(KEY)}: resolved runner writes trainer.devices and trainer.num_nodes there "
                     f"(and rewrites them on `runner resume RUN num_device=M`): remove ${{num_nodes}}/${{num_device}} "
                     f"from the command")


class Unresolved(Exception):
    """A ``${...}`` runner cannot resolve (an OmegaConf resolver, a missing key): left as written."""


def resolved(document: dict[str, Any], keys: list[str], resolve: Callable[[Any], Any], num_nodes: int,
             num_device: int) -> tuple[dict[str, Any], list[str]]:
    """The resolved copy: ``trainer`` and the program's top-level ``keys`` of ``document`` (the file as written,
    after the overrides, without runner's keys: the ``runner:`` block, ``command``, ``num_nodes``, ``num_device``,
    ``dataloader``, ``parallel`` and runner's settings written at the top level), each string run through
    ``resolve`` (which raises ``Unresolved``), and ``trainer.devices``/``trainer.num_nodes`` the layout as integers.
    Returns it and the dotted paths left as written."""
    left: list[str] = []

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, dict):
            return {k: walk(v, f"{path}.{k}") for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(node)]
        try:
            return resolve(node)
        except Unresolved:
            left.append(path)
            return node

    out = {k: walk(document[k], str(k)) for k in document if k in keys or k == "trainer"}
    trainer = out.get("trainer")
    out["trainer"] = {**(trainer if isinstance(trainer, dict) else {}), "devices": num_device,
                      "num_nodes": num_nodes}
    return out, left
