"""Cross-references of the API reference, checked against the code.

- A reference written the way the package's docstrings write them (``:class:`RolloutCollector```
  inside its module, ``:func:`rlhf_torchrl.collectors.make_generation_env``` through a package's
  re-export, ``:meth:`state_dict``` inside a class) is looked up in Python from where it is written
  and linked to where the object is documented. A name that exists in Python but has no entry in the
  reference (an undocumented method, a dataclass field) is shown as code without a link. A name that
  does not exist in Python stays a warning, so ``-n -W`` fails on it.
- A method without a docstring of its own is left out rather than shown with one inherited from
  torch or torchrl.
- Napoleon reads a data or attribute docstring ``"text: more text"`` as ``"type: description"``;
  the package's ``#:`` comments are prose, so napoleon only sees functions, classes and modules.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect

from sphinx.ext import napoleon
from sphinx.util.nodes import make_refnode


def _import_path(path: str):
    """The object a dotted path names, or None."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for j, attr in enumerate(parts[i:]):
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
                continue
            fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else ()
            if attr in fields and j == len(parts[i:]) - 1:
                return dataclasses.MISSING  # a dataclass field: real, but not a class attribute
            return None
        return obj
    return None


def _candidates(target: str, module: str | None, cls: str | None):
    """Where a name written in ``module`` (inside ``cls``) may live, nearest first."""
    seen = []
    if module and cls:
        seen.append(f"{module}.{cls}.{target}")
    parts = (module or "").split(".") if module else []
    for i in range(len(parts), 0, -1):
        seen.append(".".join(parts[:i]) + "." + target)
    seen.append(target)
    return seen


def _canonical(path: str, obj) -> list[str]:
    """The dotted names under which the object may be documented."""
    names = [path]
    if hasattr(obj, "__module__") and hasattr(obj, "__qualname__"):
        names.insert(0, f"{obj.__module__}.{obj.__qualname__}")
    owner, _, name = path.rpartition(".")
    owner_obj = _import_path(owner) if owner else None
    if isinstance(owner_obj, type):  # a method or attribute through a re-exported class
        names.append(f"{owner_obj.__module__}.{owner_obj.__qualname__}.{name}")
    return names


def resolve_missing(app, env, node, contnode):
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    if not target.startswith("rlhf_torchrl") and not node.get("py:module", "").startswith("rlhf_torchrl"):
        return None
    domain = env.get_domain("py")
    for path in _candidates(target, node.get("py:module"), node.get("py:class")):
        obj = _import_path(path)
        if obj is None:
            continue
        if obj is not dataclasses.MISSING:
            for name in _canonical(path, obj):
                entry = domain.objects.get(name)
                if entry is not None:
                    return make_refnode(app.builder, node["refdoc"], entry.docname, entry.node_id,
                                        contnode, name)
        return contnode  # real, but not in the reference: code without a link
    return None


def _process_docstring(app, what, name, obj, options, lines):
    if what not in ("data", "attribute", "property"):
        napoleon._process_docstring(app, what, name, obj, options, lines)


def _skip_member(app, what, name, obj, skip, options):
    """A package method without a docstring of its own is left out, rather than shown with the
    docstring autodoc would inherit (torch's ``Module.forward``, torchrl's hook base)."""
    if skip:
        return None
    if (inspect.isfunction(obj) and getattr(obj, "__module__", "").startswith("rlhf_torchrl")
            and obj.__doc__ is None and "." in getattr(obj, "__qualname__", "")):
        return True
    return None


def _init_signature(app, what, name, obj, options, signature, return_annotation):
    """A TensorDict module's class shows ``(*args, **kwargs)``: tensordict's metaclass defines
    ``__call__``, and autodoc reads that. Its ``__init__`` has the arguments a user passes."""
    if what != "class" or signature != "(*args, **kwargs)" or "__init__" not in vars(obj):
        return None
    try:  # the annotations as types, not strings ("from __future__ import annotations")
        init = inspect.signature(obj.__init__, eval_str=True)
    except (NameError, TypeError, SyntaxError):  # a name imported only for type checkers
        init = inspect.signature(obj.__init__)
    params = list(init.parameters.values())[1:]  # without self
    return str(inspect.Signature(params)), return_annotation


def setup(app):
    app.setup_extension("sphinx.ext.napoleon")
    for listener in list(app.events.listeners.get("autodoc-process-docstring", [])):
        if listener.handler is napoleon._process_docstring:
            app.disconnect(listener.id)
    app.connect("autodoc-process-docstring", _process_docstring)
    app.connect("missing-reference", resolve_missing)
    app.connect("autodoc-skip-member", _skip_member)
    app.connect("autodoc-process-signature", _init_signature)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
