"""The ``sglang`` extra's bound in pyproject.toml and the versions the SGLang plugin accepts
(`TESTED_SGLANG`, `check_sglang_version`) say the same, read as pip reads the bound (PEP 440)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from mmkey.integrations.sglang._store_settings import TESTED_SGLANG, SGLangConfigError, check_sglang_version

ROOT = Path(__file__).parents[2]

VERSIONS = [
    *("0.5.22", "0.5.22.post3", "0.5.23.dev0", "0.5.23a1", "0.5.23rc1", "0.5.23rc1.post1", "0.5.23-rc.2"),
    *("0.5.23", "0.5.23.0", "0.5.23+cu128", "0.5.23.post1", "0.5.23-1", "0.5.23.post1.dev0", "0.5.23.1"),
    *("0.5.24.dev0", "0.5.24rc1", "0.5.24", "0.6.0", "1.0.0", "v0.5.23", "0.5.23.dev0+g1a2b3c"),
]
"""Around both ends of the range: pre-, post-, development and local releases."""


def sglang_extra() -> Requirement:
    """The one requirement of pyproject.toml's ``sglang`` extra."""
    toml: Any = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    with (ROOT / "pyproject.toml").open("rb") as f:
        extras = toml.load(f)["project"]["optional-dependencies"]
    [requirement] = extras["sglang"]
    return Requirement(requirement)


def dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def test_the_extras_bound_is_the_tested_range() -> None:
    requirement = sglang_extra()
    low, high = TESTED_SGLANG
    assert requirement.name == "sglang"
    assert requirement.specifier == SpecifierSet(f">={dotted(low)},<{dotted(high)}")


@pytest.mark.parametrize("version", VERSIONS)
def test_the_plugin_accepts_the_versions_the_extra_allows(version: str) -> None:
    # pip's bound, pre-releases included: an installed 0.5.23.post1.dev0 satisfies it
    allowed = sglang_extra().specifier.contains(Version(version), prereleases=True)
    if allowed:
        check_sglang_version(version)
    else:
        with pytest.raises(SGLangConfigError, match=f"SGLang {re.escape(version)} is outside"):
            check_sglang_version(version)
