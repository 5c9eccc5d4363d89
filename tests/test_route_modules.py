"""The route's modules talk through public interfaces (issue 55): none uses a ``_``-prefixed member of a class
defined in another file, and none imports ``server.py``, the app on top, not even for type checking (import-linter
skips ``TYPE_CHECKING`` imports, so its no-cycles contract cannot see such a circle; this test can)."""

from __future__ import annotations

import ast
import importlib.util
import textwrap
from pathlib import Path

import agl.route

ROUTE = Path(agl.route.__file__).parent
MODULES = sorted(ROUTE.glob("*.py"))
ATTRIBUTE_CALLS = ("getattr", "setattr", "hasattr", "delattr")


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def own_private_members(tree: ast.Module) -> set[str]:
    """The ``_``-prefixed members the module's own classes define: in their bodies (methods, class attributes), or
    assigned on ``self`` / ``cls`` in their methods."""
    names: set[str] = set()
    for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
        for node in cls.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(t.id for t in targets if isinstance(t, ast.Name))
        for node in ast.walk(cls):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                names.add(node.attr)
    return {name for name in names if is_private(name)}


def foreign_private_uses(source: str) -> list[str]:
    """``line: name`` for each use of a ``_``-prefixed member that no class of this source defines: ``x._name``
    (whoever ``x`` is, ``self`` included: an inherited member is another file's) or ``getattr(x, "_name")``."""
    tree = ast.parse(source)
    own = own_private_members(tree)
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ATTRIBUTE_CALLS
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            name = node.args[1].value
        else:
            continue
        if is_private(name) and name not in own:
            uses.append((node.lineno, name))
    return [f"{line}: {name}" for line, name in sorted(uses)]


def imports_of(source: str, package: str) -> set[str]:
    """The modules a source of ``package`` imports, absolute, wherever the import stands (``TYPE_CHECKING``
    blocks and functions included); ``from package import name`` counts as ``package.name``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def test_no_route_module_uses_a_private_member_of_another_file():
    used = {path.name: foreign_private_uses(path.read_text()) for path in MODULES}
    assert {name: uses for name, uses in used.items() if uses} == {}


def test_no_route_module_imports_the_server():
    importers = [path.name for path in MODULES if "agl.route.server" in imports_of(path.read_text(), "agl.route")]
    assert importers == []


def test_the_checks_see_what_they_forbid():
    """The checks above find what they forbid, in a sketch of the Responses endpoint as it was before issue 55."""
    endpoint = textwrap.dedent("""\
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from agl.route.server import ModelServer
        from .recording import Call

        class ResponsesEndpoint:
            def __init__(self, server: ModelServer):
                self.server = server
                self._stored = {}

            async def create(self, request):
                self.server._check_model(request.model)
                self._stored.clear()
                getattr(self.server, "_submit")(request)
                return self._inherited, self.server.__class__, self.server.policy, ModelServer._served_name
    """)
    assert foreign_private_uses(endpoint) == ["12: _check_model", "14: _submit", "15: _inherited", "15: _served_name"]
    assert {"agl.route.server", "agl.route.recording"} <= imports_of(endpoint, "agl.route")
    for form in ("import agl.route.server as app", "from . import server", "from .server import ModelServer"):
        assert "agl.route.server" in imports_of(form, "agl.route"), form
    assert "agl.route.server" not in imports_of("from .. import route\nfrom .chat_path import ChatPath", "agl.route")
