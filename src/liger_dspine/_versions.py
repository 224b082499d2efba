"""The liger-kernel and transformers versions this package supports, checked when a patch is applied.

Policy: a version outside ``SUPPORTED`` is refused. A version inside it but newer than the newest one CI tests
(``NEWEST_TESTED``) is accepted with one warning: its modeling files may have changed under the patch.
"""

import logging
from importlib import metadata

from packaging.version import Version

logger = logging.getLogger(__name__)

SUPPORTED = {
    "liger-kernel": (Version("0.8.5"), Version("0.9")),
    "transformers": (Version("5.8.1"), Version("6")),
}
NEWEST_TESTED = {"liger-kernel": Version("0.8.5"), "transformers": Version("5.25.0")}
INSTALL_HINT = 'pip install "liger-kernel>=0.8.5,<0.9" "transformers>=5.8.1,<6"'
_warned: set[tuple[str, Version]] = set()


def require_supported_versions() -> None:
    """Raise ImportError naming the package, the version found and the supported range; warn once for a version
    newer than the newest tested."""
    for package, (low, high) in SUPPORTED.items():
        try:
            found = Version(metadata.version(package))
        except metadata.PackageNotFoundError:
            raise ImportError(
                f"liger-dspine: needs {package} >= {low}, < {high}, which is not installed: {INSTALL_HINT}"
            ) from None
        if not (low <= found < high):
            raise ImportError(f"liger-dspine: supports {package} >= {low}, < {high}; found {found}: {INSTALL_HINT}")
        newest = NEWEST_TESTED[package]
        if found.release[:3] > newest.release[:3] and (package, found) not in _warned:
            _warned.add((package, found))
            logger.warning(
                "liger-dspine: %s %s is newer than the newest version tested (%s); the patch applies, but check "
                "the loss and gradients against the unpatched model once (see the README's version policy)",
                package,
                found,
                newest,
            )
