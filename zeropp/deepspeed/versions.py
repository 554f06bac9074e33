"""The DeepSpeed releases ``zeropp.deepspeed`` supports, and the checks ``install()`` makes before importing it.

The patches replace DeepSpeed internals by name (closures, module attributes, private methods), so each supported
release is one whose source the patches were written from and whose tests (tests/deepspeed) passed. A release
not listed is refused rather than patched blindly.
"""

from __future__ import annotations

from importlib import metadata

SUPPORTED_VERSIONS: tuple[str, ...] = ("0.19.8",)
"""DeepSpeed releases the patches were written from and tested with."""

INSTALL_HINT = f"DS_BUILD_OPS=0 pip install deepspeed=={SUPPORTED_VERSIONS[-1]}"


class UnsupportedDeepSpeedVersion(RuntimeError):
    """The installed DeepSpeed is not one of ``SUPPORTED_VERSIONS``."""


def installed_version() -> str:
    """The installed DeepSpeed's version, read from its package metadata (DeepSpeed is not imported).

    Raises:
        ImportError: DeepSpeed is not installed.
    """
    try:
        return metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        raise ImportError(
            f"zeropp.deepspeed needs DeepSpeed, which is not installed: {INSTALL_HINT} "
            f"(supported: {', '.join(SUPPORTED_VERSIONS)}; DS_BUILD_OPS=0 builds no op, zeropp needs none)"
        ) from None


def check_version(version: str) -> None:
    """Raise ``UnsupportedDeepSpeedVersion`` unless ``version`` is one of ``SUPPORTED_VERSIONS``."""
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedDeepSpeedVersion(
            f"zeropp.deepspeed supports DeepSpeed {', '.join(SUPPORTED_VERSIONS)}, and DeepSpeed {version} is "
            f"installed: {INSTALL_HINT}"
        )
