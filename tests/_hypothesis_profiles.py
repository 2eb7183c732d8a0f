"""The suite's hypothesis profiles, and which one a run loads.

``dev``, the default of a local run, draws new inputs each run (a failure found once is
replayed from the example database); ``ci`` is derandomized, so that CI's verdict is the
same on every run; ``quick`` is ``ci`` with fewer examples, for `make check`.
"""

from __future__ import annotations

from collections.abc import Mapping

from hypothesis import HealthCheck, settings

__all__ = ["PROFILE_ENV", "profile_for", "register_profiles"]

PROFILE_ENV = "HYPOTHESIS_PROFILE"
"""The variable that names the profile outright (``make test`` sets ``ci``)."""
_NOT_SET = ("", "0", "false", "no")


def register_profiles() -> None:
    """Register ``ci``, ``dev`` and ``quick`` (a loaded host: no deadline, slow data allowed)."""
    # from hypothesis's own defaults, whichever profile it loaded itself (its `ci` where `CI` is set)
    base = settings.get_profile("default")
    loaded_host = settings(base, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("ci", loaded_host, derandomize=True, print_blob=True)
    settings.register_profile("dev", loaded_host, max_examples=100)
    settings.register_profile("quick", settings.get_profile("ci"), max_examples=10)


def profile_for(environ: Mapping[str, str]) -> str:
    """The profile a run in ``environ`` loads: ``HYPOTHESIS_PROFILE`` when set, else ``ci``
    where the ``CI`` variable is set (CI sets ``CI=true``), else ``dev``."""
    named = environ.get(PROFILE_ENV, "")
    if named:
        return named
    return "dev" if environ.get("CI", "").strip().lower() in _NOT_SET else "ci"
