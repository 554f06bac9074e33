"""``add_config_arguments``: DeepSpeed's command-line arguments (also ``zeropp.add_config_arguments``)."""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's argument group to ``parser`` and return it: ``--deepspeed`` (a flag for the script, no
    effect), ``--deepspeed_config PATH`` (the JSON config ``zeropp.initialize(args=...)`` reads when given no
    ``config``), and the deprecated ``--deepscale`` / ``--deepscale_config PATH`` (read like ``--deepspeed_config``,
    with a warning), as DeepSpeed's ``add_config_arguments``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="Deprecated DeepSpeed json configuration file.")
    return parser
