"""Field checkers of the plan's data: each turns a JSON value into the value stored, or raises a
:class:`PlanError` naming the field's path, the bad value and the fix (see :mod:`whale.plan.plan`)."""

from __future__ import annotations

import dataclasses
import math
import numbers
import reprlib
from collections.abc import Callable
from typing import Any, NoReturn


class PlanError(ValueError):
    """A plan that cannot run: the message names the bad value, the limit and the fix."""


Check = Callable[[Any, str], Any]  # (value, field path) -> the value as stored, or raise PlanError


def _fail(where: str, value: Any, problem: str, fix: str) -> NoReturn:
    raise PlanError(f"{where} = {reprlib.repr(value)} {problem}; {fix}")


def _scalar(ok: Callable[[Any], bool], store: Callable, problem: str, fix: Callable[[Any], str]) -> Check:
    """Checker: ``store(v)`` when ``ok(v)``, else a PlanError naming the path, the value, the problem and the fix."""
    def check(v: Any, where: str) -> Any:
        """Check ``v`` at path ``where``; return it as stored."""
        if not ok(v):
            _fail(where, v, problem, fix(v))
        return store(v)
    return check


def _int(low: int, nullable: bool = False) -> Check:
    """Checker: an integer >= ``low`` (a bool or a float is not one), or None when ``nullable``."""
    def fix(v: Any) -> str:
        """The fix to suggest for a bad value."""
        near = isinstance(v, float) and v.is_integer() or isinstance(v, str) and v.isdecimal()
        return f"write {int(v)} (no quotes or point)" if near and int(v) >= low else f"use a whole number >= {low}"
    return _scalar(lambda v: (v is None and nullable) or (isinstance(v, numbers.Integral) and not isinstance(v, bool)
                                                          and v >= low),
                   lambda v: None if v is None else int(v), f"must be an integer >= {low}" + " or null" * nullable, fix)


def _real(positive: bool) -> Check:
    """Checker: a finite number, > 0 when ``positive`` else >= 0 (not a bool); stored as a float."""
    return _scalar(lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
                   and (v > 0 if positive else v >= 0), float, f"must be a finite number {'>' if positive else '>='} 0",
                   lambda v: "use a plain number such as 1.0 (not NaN, Infinity, a string or null)")


def _choice(options: tuple[str, ...]) -> Check:
    def check(v: Any, where: str) -> str:
        """Check ``v`` at path ``where``; return it as stored."""
        if v not in options:
            raise PlanError(f"{where} {v!r} is unknown; choose one of {options}")
        return v
    return check


_STR = _scalar(lambda v: isinstance(v, str), str, "must be a string", lambda v: "write the name in quotes")
_BOOL = _scalar(lambda v: isinstance(v, bool), bool, "must be true or false", lambda v: "write true or false")


def _seq(item: Check, what: str, least: int = 0) -> Check:
    """Checker: a list or tuple (never a string) of ``least`` or more different entries (any number, repeats
    allowed, when ``least`` is 0) that pass ``item``; stored as a tuple."""
    def check(v: Any, where: str) -> tuple:
        """Check ``v`` at path ``where``; return it as stored."""
        if not isinstance(v, (list, tuple)):
            _fail(where, v, f"must be a list of {what}, not {type(v).__name__}",
                  f"write [{v!r}] for a single entry" if isinstance(v, str) and item is _STR
                  else "write a list ([] for none)")
        out = tuple(item(x, f"{where}[{i}]") for i, x in enumerate(v))
        if least and (len(out) < least or len(set(out)) != len(out)):
            _fail(where, list(out), f"must list {least} or more different {what}",
                  "remove the repeats" if len(set(out)) != len(out) else f"add the missing {what}")
        return out
    return check


def _check_keys(cls: type, data: Any, where: str) -> None:
    """Refuse ``data`` unless it is a dict holding only fields of ``cls`` and all its required ones."""
    names = [f.name for f in dataclasses.fields(cls)]
    required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
    if not isinstance(data, dict):
        _fail(where, data, f"must be a {cls.__name__} object", f"write an object with fields {names}")
    if unknown := sorted(str(k) for k in data if k not in names):
        raise PlanError(f"{where} has unknown fields {unknown}; {cls.__name__} fields are {names}: remove or "
                        "rename them (was it written by another Whale version?)")
    if missing := [n for n in required if n not in data]:
        raise PlanError(f"{where} lacks required fields {missing}; add them ({cls.__name__} fields are {names})")


def _node(cls: type) -> Check:
    """Checker: a ``cls`` instance, or a dict made into one; its errors are renamed by their path."""
    def check(v: Any, where: str) -> Any:
        """Check ``v`` at path ``where``; return it as stored."""
        if isinstance(v, cls):
            return v
        _check_keys(cls, v, where)
        try:
            return cls(**v)
        except PlanError as exc:
            msg, head = str(exc), cls.__name__ + "."
            raise PlanError(f"{where}.{msg[len(head):]}" if msg.startswith(head) else f"{where}: {msg}") from None
    return check
