"""The liger-kernel and transformers versions this package supports, checked when a patch is applied."""

from importlib import metadata

from packaging.version import Version

SUPPORTED = {
    "liger-kernel": (Version("0.8.5"), Version("0.9")),
    "transformers": (Version("5.8.1"), Version("6")),
}
INSTALL_HINT = 'pip install "liger-kernel>=0.8.5,<0.9" "transformers>=5.8.1,<6"'


def require_supported_versions() -> None:
    """Raise ImportError naming the package, the version found and the supported range."""
    for package, (low, high) in SUPPORTED.items():
        try:
            found = Version(metadata.version(package))
        except metadata.PackageNotFoundError:
            raise ImportError(
                f"liger-dspine: needs {package} >= {low}, < {high}, which is not installed: {INSTALL_HINT}"
            ) from None
        if not (low <= found < high):
            raise ImportError(f"liger-dspine: supports {package} >= {low}, < {high}; found {found}: {INSTALL_HINT}")
