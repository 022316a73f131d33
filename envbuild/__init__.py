"""envbuild: declarative, content-addressed environment builds for agent-training sandboxes.

The public API is re-exported here; implementation lives in subpackages.
"""

from envbuild._version import __version__
from envbuild.errors import (
    BlobNotFound,
    BuildError,
    CorruptLayerError,
    DefinitionError,
    DigestMismatch,
    EnvbuildError,
    LayerError,
    PlanError,
    Problem,
    RefNotFound,
    RuntimeShimError,
    SettingsError,
    SourceError,
    StepFailed,
    StoreError,
    StoreUnavailable,
    UnsafeLayerError,
    UnsupportedFormatError,
)
from envbuild.settings import Settings

__all__ = [
    "BlobNotFound",
    "BuildError",
    "CorruptLayerError",
    "DefinitionError",
    "DigestMismatch",
    "EnvbuildError",
    "LayerError",
    "PlanError",
    "Problem",
    "RefNotFound",
    "RuntimeShimError",
    "Settings",
    "SettingsError",
    "SourceError",
    "StepFailed",
    "StoreError",
    "StoreUnavailable",
    "UnsafeLayerError",
    "UnsupportedFormatError",
    "__version__",
]
