"""The run config: schema, loading with interpolation, validation, and its typed view.

Imports neither ``runner.host`` nor ``runner.job``: both sides read the same validated config.
"""

from runner.spec.load import Config, apply_overrides, dump, from_dict, load, read_yaml
from runner.spec.schema import EVENTS, SBATCH_SAFE

__all__ = ["EVENTS", "SBATCH_SAFE", "Config", "apply_overrides", "dump", "from_dict", "load", "read_yaml"]
