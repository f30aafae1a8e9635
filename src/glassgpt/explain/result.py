"""What every analysis returns: plain data that shows itself through the views registered for its type.

    VIEWS[Trace] == {"text": render_text, "picture": diagram.layout, "html": trace_html}

An analysis (trace.py, why.py, passage.py, compare.py, diff.py, verify.py) returns a `Result`;
views/__init__.py registers each result type's text, picture and notebook HTML in one place. A result
finds its view in `VIEWS` when it is asked for one, so no analysis imports a view: the views sit above
the analyses, and `import glassgpt.explain` registers them all before any result exists.
"""

from __future__ import annotations

from typing import Any, Callable

KINDS = ("text", "picture", "html")  # the terminal's text, a draw.Drawing (SVG or PNG), a notebook cell
VIEWS: dict[type, dict[str, Callable[..., Any]]] = {}


def register(result_type: type, **renderers: Callable[..., Any]) -> None:
    """Register `result_type`'s views by kind: register(Passage, text=passage_text, picture=..., html=...)."""
    assert set(renderers) <= set(KINDS), f"views are {KINDS}, not {sorted(set(renderers) - set(KINDS))}"
    VIEWS.setdefault(result_type, {}).update(renderers)


def view(result: Any, kind: str) -> Callable[..., Any]:
    """The renderer of `kind` registered for `result`'s type (or the nearest base type that has one)."""
    for cls in type(result).__mro__:
        if kind in VIEWS.get(cls, {}):
            return VIEWS[cls][kind]
    raise LookupError(f"no {kind} view is registered for {type(result).__name__} (explain/views/__init__.py)")


class Result:
    """A result of an analysis: its text, its picture and its notebook HTML come from its registered views."""

    def to_text(self, **options: Any) -> str:
        """The terminal view (`color=True` for ANSI colours where the view has them)."""
        return view(self, "text")(self, **options)

    def picture(self, **options: Any):
        """The picture, a draw.Drawing: `draw.to_svg(result.picture())`, or `draw.save_png(...)`."""
        return view(self, "picture")(self, **options)

    def _repr_html_(self) -> str:
        """Jupyter's view: the picture (SVG) and the key lines."""
        return view(self, "html")(self)
