"""Sphinx configuration of mmkey's documentation (``make docs``: warnings are errors)."""

from __future__ import annotations

import ast
import enum
import importlib
import inspect
import sys
import types
from pathlib import Path
from typing import cast

from docutils.nodes import Element
from sphinx.addnodes import pending_xref
from sphinx.application import Sphinx
from sphinx.domains.python import PythonDomain
from sphinx.environment import BuildEnvironment
from sphinx.util.nodes import make_refnode

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS))  # plot_benchmarks, run by the build below

import plot_benchmarks  # noqa: E402

project = "mmkey"
author = "the mmkey authors"
copyright = "2026, the mmkey authors"  # noqa: A001 (Sphinx's own setting name)

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "benchmarks/*.txt"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# single backticks in docstrings are checked cross-references: a name that does not resolve
# fails the build
default_role = "py:obj"
nitpicky = True

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_default_options = {"members": True, "show-inheritance": True}
autoclass_content = "class"
# the integrations subclass the stacks' own classes; the stacks are not installed in the dev
# environment (each has an environment of its own), so autodoc imports them as stand-ins
autodoc_mock_imports = ["vllm", "sglang"]


def _vllm_connector_stand_in() -> None:
    """Real classes for the vLLM names ``mmkey.integrations.vllm`` imports, with the hooks its
    import-time API check asks for (read from that module's source), so that autodoc can
    import it without vLLM. Nothing but the docs build imports them."""
    source = (DOCS.parent / "src" / "mmkey" / "integrations" / "vllm" / "_api.py").read_text()
    [hooks] = [
        ast.literal_eval(node.value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "_SCHEDULER_HOOKS" for t in node.targets)
    ]
    base = types.ModuleType("vllm.distributed.ec_transfer.ec_connector.base")
    metrics = types.ModuleType("vllm.distributed.ec_transfer.ec_connector.metrics")

    def hook(name: str, parameters: tuple[str, ...]) -> object:
        def method(self: object, *args: object) -> None:
            """A vLLM connector hook."""

        names = ("self", *parameters)
        method.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names]
        )
        method.__name__ = name
        return method

    connector_base = type("ECConnectorBase", (), {name: hook(name, p) for name, p in hooks.items()})
    role = enum.Enum("ECConnectorRole", ["SCHEDULER", "WORKER"])  # type: ignore[misc]
    for module, classes in (
        (
            base,
            (
                connector_base,
                type("ECConnectorMetadata", (), {}),
                type("ECConnectorWorkerMetadata", (), {}),
                role,
            ),
        ),
        (metrics, (type("ECConnectorStats", (), {}),)),
    ):
        for cls in classes:
            cls.__module__ = module.__name__
            setattr(module, cls.__name__, cls)
        sys.modules[module.__name__] = module


_vllm_connector_stand_in()


def _import_lazy_members() -> None:
    """The integration packages load each public name's module on first use, which for
    autodoc comes after its mocks of the stacks are gone: import those modules under the
    mocks now, so their names document as the package's."""
    from sphinx.ext.autodoc import mock

    with mock(autodoc_mock_imports):
        for package in ("mmkey.integrations.vllm", "mmkey.integrations.sglang"):
            for home in set(importlib.import_module(package)._HOMES.values()):
                importlib.import_module(f"{package}.{home}")


_import_lazy_members()
napoleon_google_docstring = False
napoleon_numpy_docstring = False

# No intersphinx: inventories (Python's, torch's, attrs') cannot be downloaded where the docs
# are built, so names from outside mmkey are not links. Each pattern below is one such family,
# with why it cannot resolve here.
nitpick_ignore_regex = [
    # the standard library and builtins: Python's inventory is not available offline
    (
        r"py:.*",
        r"(builtins\.)?(int|str|bytes|bytearray|memoryview|bool|float|object|type|None|True|False"
        r"|list|dict|tuple|set|frozenset|slice|BaseException|Exception|ValueError|TypeError"
        r"|KeyError|RuntimeError|OSError|TimeoutError|LookupError|NotImplemented|Ellipsis)",
    ),
    (
        r"py:.*",
        r"(typing|typing_extensions|collections|collections\.abc|abc|enum|os|pathlib"
        r"|subprocess|threading|concurrent\.futures|asyncio|datetime|logging|contextlib|types"
        r"|socket|signal|io|random|dataclasses|weakref)\..*",
    ),
    (
        r"py:.*",
        r"(Sequence|Mapping|MutableMapping|Iterable|Iterator|Callable|Awaitable"
        r"|Coroutine|AsyncIterator|Generator|Collection|Hashable|Any|Self|Literal|Final"
        r"|ClassVar|Protocol|TypeVar|ParamSpec|NewType|Path|Enum|IntEnum|StrEnum|Popen"
        r"|Thread|Event|Lock|Future|Executor|ThreadPoolExecutor|AbstractEventLoop|datetime"
        r"|timedelta|Logger|TracebackType|T|T_co|P|R|K|V)",
    ),
    # torch, numpy: their inventories are not available offline
    (r"py:.*", r"(torch|numpy|np)(\..*)?"),
    (r"py:.*", r"(Tensor|dtype|device|Stream|ndarray|DTypeLike)"),
    # attrs: its inventory is not available offline
    (r"py:.*", r"(attrs|attr)\..*"),
    # pytest, hypothesis, prometheus_client, click: inventories not available offline
    (r"py:.*", r"(_?pytest|hypothesis|prometheus_client|click)(\..*)?"),
    (
        r"py:.*",
        r"((st\.)?SearchStrategy|RuleBasedStateMachine|CollectorRegistry|Metric|MonkeyPatch"
        r"|FixtureRequest|Config)",
    ),
    # typing_extensions' Buffer (PEP 688) and blake3's hasher: no inventories offline
    (r"py:.*", r"(Buffer|blake3\.blake3|xxhash\..*)"),
    # mmkey's own private names where they show in a signature (``_Sealed``): not API, not
    # documented
    (r"py:.*", r"mmkey(\.\w+)*\._\w+(\.\w+)*"),
    # names of mmkey's private modules cited from another private module's docstring (Mooncake's
    # result codes of the fake store, the codec's layout constants, the lane's types): the
    # modules are not documented, so the names have no page to link to
    (
        r"py:.*",
        r"(INVALID_PARAMS|NOT_FOUND|TRANSFER_FAIL|RPC_FAIL|OBJECT_ALREADY_EXISTS|NO_AVAILABLE_HANDLE"
        r"|ILLEGAL_CLIENT|UNWRITTEN_BYTE|INVALID_REPLICA|HEADER_ALIGN|HAS_LEASE|DTYPE_CODES"
        r"|CacheParts|Outcome|Clock|ECConnectorOutput)",
    ),
    # mmkey.encoder's ``Device`` alias (``torch.device | str``): an alias autodoc leaves unexpanded
    (r"py:class", r"Device"),
    # vLLM and SGLang, whose classes the integrations implement: no inventories offline
    (r"py:.*", r"(vllm|sglang)\..*"),
    (
        r"py:.*",
        r"(VllmConfig|SchedulerOutput|Request|ECConnectorStats|EmbeddingStore"
        r"|ECConnectorMetadata|ECConnectorWorkerMetadata|ECConnectorBase|ECConnectorRole)",
    ),
    # the Mooncake binding (typed by stubs/, documented upstream only)
    (r"py:.*", r"(mooncake)(\..*)?"),
    (r"py:.*", r"(MooncakeDistributedStore|ReplicateConfig)(\..*)?"),
]

html_theme = "furo"
html_title = "mmkey"
templates_path: list[str] = []


def _home_name(target: str) -> str | None:
    """The defining module's name of an object re-exported elsewhere (``mmkey.EmbeddingKey``
    is ``mmkey.keys.EmbeddingKey``), or None where ``target`` does not import."""
    module_name, _, rest = target.partition(".")
    if module_name != "mmkey":
        return None
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attribute in parts[cut:]:
                obj = getattr(obj, attribute)
        except AttributeError:
            return None
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if module and qualname and f"{module}.{qualname}" != target:
            return f"{module}.{qualname}"
        return None
    return None


def _resolve_loosely(
    app: Sphinx, env: BuildEnvironment, node: pending_xref, contnode: Element
) -> Element | None:
    """Resolve a Python reference that Sphinx's exact lookup missed.

    Docstrings name mmkey's objects the way their readers import them: ``EmbeddingKey``
    from any module, ``mmkey.EmbeddingKey`` for the re-export of ``mmkey.keys.EmbeddingKey``.
    A name resolves when exactly one documented object matches it; anything else is still a
    warning (an error in ``make docs``).
    """
    if node.get("refdomain") != "py":
        return None
    domain = cast(PythonDomain, env.get_domain("py"))
    target = node["reftarget"]
    home = _home_name(target)
    if home is not None and home in domain.objects:
        entry = domain.objects[home]
        return make_refnode(app.builder, node["refdoc"], entry.docname, entry.node_id, contnode, home)
    found = domain.find_obj(env, node.get("py:module"), node.get("py:class"), target, node.get("reftype"), 1)
    # one object under its documented name and its defining module's (an alias such as
    # ``mmkey.cache.mooncake._cache.MooncakeCache``) is one match; a bare word never names a
    # module by its last part (``config`` is not ``mmkey.cache.mooncake.config``)
    matches = [
        (name, entry)
        for name, entry in found
        if not entry.aliased and not (entry.objtype == "module" and "." not in target)
    ]
    if len(matches) != 1:
        return None
    name, entry = matches[0]
    return make_refnode(app.builder, node["refdoc"], entry.docname, entry.node_id, contnode, name)


def _public_bases(app: Sphinx, name: str, obj: object, options: object, bases: list[type]) -> None:
    """Show a class's public bases only: a private base (``ManagedProcess``) is not API."""
    bases[:] = [
        base
        for base in bases
        if not any(part.startswith("_") for part in f"{base.__module__}.{base.__qualname__}".split("."))
    ]


def _plot(app: object) -> None:
    """Draw the speed tables of ``docs/benchmarks/*.txt`` into ``_generated`` before reading."""
    plot_benchmarks.plot_all(DOCS / "benchmarks", DOCS / "_generated")


def setup(app: Sphinx) -> None:
    """Plot the benchmarks at the start of every build; resolve names loosely (above)."""
    app.connect("builder-inited", _plot)
    app.connect("missing-reference", _resolve_loosely)
    app.connect("autodoc-process-bases", _public_bases)
