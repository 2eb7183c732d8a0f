"""Type completeness of mmkey as pyright users see it: ``pyright --verifytypes``.

Installs the package regularly (a wheel, not the editable install) into a scratch
directory, runs ``pyright --verifytypes mmkey --ignoreexternal`` against it and fails
unless every exported symbol has a declared type (a score of 100%) and every public
function and class has a docstring. Run with the interpreter of the dev environment:
``.venv/bin/python scripts/verify_types.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

NO_DOCSTRING_POSSIBLE = {
    # a NewType: pyright gives the class it makes of one no docstring; the one written
    # below `MMHash = NewType(...)` is what editors and the documentation show
    "mmkey.digest.MMHash": "No docstring found for class",
}
SYNTHESIZED = "__converterDescriptor_"
"""pyright makes a descriptor class, with no docstring, for each attrs field with a converter."""


def _run_pyright(site: Path, scratch: Path) -> dict[str, Any]:
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ)
    # pyright asks the first `python` on PATH for the import paths (not --pythonpath, in
    # this mode): the dev environment's, with the wheel's install in front of its own
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    # the stubs of the stacks the integrations subclass (vLLM, SGLang) and of Mooncake: the
    # types their users' checkers see from the stacks' own annotated packages
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT / "stubs")])
    env["PYRIGHT_PYTHON_IGNORE_WARNINGS"] = "1"
    done = subprocess.run(
        [str(bin_dir / "pyright"), "--verifytypes", "mmkey", "--ignoreexternal", "--outputjson"],
        # outside the repository, so that its pyrightconfig.json (src/ on the path) stays out
        cwd=scratch,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        report: dict[str, Any] = json.loads(done.stdout)
    except json.JSONDecodeError:
        sys.exit(f"pyright --verifytypes failed (exit {done.returncode}):\n{done.stdout}{done.stderr}")
    return report


def main() -> int:
    """Build, install, verify; print every gap and return 1 if there is one."""
    with tempfile.TemporaryDirectory(prefix="mmkey-verifytypes-") as tmp:
        scratch = Path(tmp)
        site = scratch / "site"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--no-compile",
                "--target",
                str(site),
                str(ROOT),
            ],
            check=True,
        )
        report = _run_pyright(site, scratch)
    completeness = report["typeCompleteness"]
    where = Path(completeness["packageRootDirectory"])
    if site not in where.parents:
        sys.exit(f"verified the wrong copy of mmkey: {where} (expected one under {site})")
    gaps = []
    for symbol in completeness["symbols"]:
        for diagnostic in symbol["diagnostics"]:
            message = diagnostic["message"].replace("\u00a0", " ")
            allowed = NO_DOCSTRING_POSSIBLE.get(symbol["name"])
            if allowed and message.startswith(allowed):
                continue
            if SYNTHESIZED in symbol["name"] and message.startswith("No docstring found for class"):
                continue
            place = ""
            if diagnostic["file"]:
                relative = Path(diagnostic["file"]).relative_to(site)
                place = f"{relative}:{diagnostic['range']['start']['line'] + 1}: "
            gaps.append(f"{symbol['name']}: {place}{diagnostic['severity']}: {message}")
    exported = completeness["exportedSymbolCounts"]
    score = completeness["completenessScore"]
    print(
        f"pyright {report['version']} --verifytypes mmkey --ignoreexternal (wheel install): "
        f"type completeness {score:.1%}, {sum(exported.values())} exported symbols "
        f"({exported['withAmbiguousType']} ambiguous, {exported['withUnknownType']} unknown), "
        f"{completeness['missingFunctionDocStringCount']} functions and "
        f"{completeness['missingClassDocStringCount']} classes without docstring "
        f"(allowed: {', '.join(sorted(NO_DOCSTRING_POSSIBLE))} and attrs converter descriptors)"
    )
    for gap in gaps:
        print(gap)
    if gaps or score < 1:
        print(f"{len(gaps)} gaps: declare the types and write the docstrings named above")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
