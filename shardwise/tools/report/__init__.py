"""Stage-independent views of a plan for people and tools: ``plan_data`` (JSON-ready dict),
``brief`` (a screenful of text), ``write_html`` (one self-contained page with charts).

    from . import plan_data, brief, write_html
    data = plan_data(pm.plan, title="my model"); print(brief(data)); write_html(data, "plan.html")
"""
from .data import SCHEMA, plan_data
from .html import render as render_html, write as write_html
from .text import brief

__all__ = ["SCHEMA", "plan_data", "brief", "render_html", "write_html"]
