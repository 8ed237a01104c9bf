"""What the API reference shows of a class: its own constructor and public bases.

- A class whose signature comes out as ``(*args, **kwargs)`` (TensorDict modules: autodoc finds
  ``TensorDictModuleBase.__new__`` before the class's ``__init__``) is shown with its
  ``__init__``'s parameters and their types.
- A private base (``_Stateless``, ``_GroupBaseline``) is replaced by its public bases, so that
  "Bases:" names only what a reader can look up.
"""

from __future__ import annotations

import inspect


def _init_signature(app, what, name, obj, options, signature, return_annotation):
    if what != "class" or signature not in ("(*args, **kwargs)", "(*args: Any, **kwargs: Any)"):
        return None
    init = obj.__dict__.get("__init__") or next(
        (c.__dict__["__init__"] for c in obj.__mro__ if "__init__" in c.__dict__), None)
    if init is None:
        return None
    sig = inspect.signature(init)
    params = list(sig.parameters.values())[1:]  # without self
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty)), None


def _public_bases(app, name, obj, options, bases: list) -> None:
    def public(cls):
        if not cls.__name__.startswith("_"):
            return [cls]
        return [b for base in cls.__bases__ for b in public(base)]

    shown = []
    for base in bases:
        for b in public(base) if isinstance(base, type) else [base]:
            if b not in shown and b is not object:
                shown.append(b)
    # a class of its own keeps "Bases: object" (autodoc writes the line whatever the list holds)
    bases[:] = shown or [object]


def setup(app):
    app.connect("autodoc-process-signature", _init_signature)
    app.connect("autodoc-process-bases", _public_bases)
    return {"parallel_read_safe": True}
