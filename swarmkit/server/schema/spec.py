"""The declarative part of a request model: one :class:`Spec` per field, and what is derived from them.

A request model is a dataclass whose fields each carry a :class:`Spec` (``x: float = spec(Number(0, 2, 1.0))``).
From that one declaration come

- the validation: :meth:`RequestModel.parse` reads the body field by field, in declaration order
  (types, ranges, enums, required fields, refused values: a 400 naming the field), then runs the
  model's cross-field :meth:`RequestModel.check`;
- the field table (:meth:`RequestModel.table`): which fields the endpoint honours, refuses or ignores
  (:mod:`swarmkit.server.fields` reports the rest as unknown);
- the request body of the OpenAPI document (:meth:`RequestModel.openapi_body`).

The translation into the engine's :class:`~swarmkit.contract.SamplingParams` is the model's own
``to_sampling_params`` (written once per endpoint).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from swarmkit.errors import ApiError
from swarmkit.server.schema.jsonschema import BOOL, Schema, integer, nullable, number, obj, string

HONOURED, REFUSED, IGNORED = "honoured", "refused", "ignored"


@dataclass(frozen=True)
class FieldTable:
    """The fields one endpoint reads (``known``: honoured or refused) and those it ignores."""

    endpoint: str
    known: frozenset[str]
    ignored: frozenset[str]

    @classmethod
    def of(cls, endpoint: str, known: Iterable[str], ignored: Iterable[str]) -> FieldTable:
        return cls(endpoint, frozenset(known), frozenset(ignored))


class FieldError(ApiError):
    """A field that is missing or not what the endpoint allows: a 400 ``invalid_value`` (or the missing
    field's code), which a model of another API answers with its own status and code
    (:attr:`RequestModel.field_error`: the control API's 422 ``invalid_field``)."""


def invalid(message: str, param: str) -> FieldError:
    """The 400 of a field whose value is not what the protocol allows."""
    return FieldError(400, message, "invalid_value", param=param)


class Spec:
    """How one request field is read, what it means to the field table, and its JSON schema.

    :ivar role: ``honoured``, ``refused`` (a value other than its no-op is a 400) or ``ignored``.
    :ivar required: absent (or null) is a 400 ``missing_field`` with ``missing`` as the message.
    :ivar message: the message of a wrong value (instead of the spec's own).
    :ivar null_absent: null reads as absent (the default); false: null is a value, checked as any other.
    """

    role: str = HONOURED

    def __init__(self, doc: str | None = None, *, required: bool = False, missing: str | None = None,
                 missing_code: str = "missing_field", nullable: bool = False, role: str | None = None,
                 message: str | None = None, null_absent: bool = True) -> None:
        if role is not None:
            self.role = role
        self.doc = doc
        self.required = required
        self.missing, self.missing_code = missing, missing_code
        self.nullable = nullable
        self.message = message
        self.null_absent = null_absent

    def read(self, body: dict[str, Any], name: str, parsed: dict[str, Any]) -> Any:
        """The checked value of ``body[name]`` (``parsed``: the fields declared before it, already read)."""
        value = body.get(name)
        if self.is_absent(body, name):
            if self.required:
                raise FieldError(400, self.missing or f"missing required field '{name}'", self.missing_code,
                                 param=name)
            return self.absent()
        return self.convert(value, name, parsed)

    def is_absent(self, body: dict[str, Any], name: str) -> bool:
        return body.get(name) is None if self.null_absent else name not in body

    def wrong(self, message: str, name: str) -> FieldError:
        """The 400 of a wrong value of this field (``message`` unless the spec names its own)."""
        return invalid(self.message or message, name)

    def absent(self) -> Any:
        """The value of an absent (or null) field."""
        return None

    def convert(self, value: Any, name: str, parsed: dict[str, Any]) -> Any:
        """A present value, checked (400 naming ``name``)."""
        return value

    def base_schema(self) -> Schema:
        return {}

    def schema(self) -> Schema:
        out = self.base_schema()
        return nullable(out) if self.nullable else out


class Number(Spec):
    """A finite number in ``[lo, hi]`` (None: unbounded on that side; ``default`` when absent)."""

    def __init__(self, lo: float | None, hi: float | None, default: float | None, doc: str | None = None,
                 **kw: Any) -> None:
        super().__init__(doc, **kw)
        self.lo, self.hi, self.default = lo, hi, default

    def absent(self) -> float | None:
        return self.default

    def convert(self, value: Any, name: str, parsed: dict[str, Any]) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.wrong(f"'{name}' must be a number, got {value!r}", name)
        lo = -math.inf if self.lo is None else self.lo
        hi = math.inf if self.hi is None else self.hi
        if not lo <= value <= hi:
            raise self.wrong(f"'{name}' must be between {lo:g} and {hi:g}, got {value}", name)
        return float(value)

    def base_schema(self) -> Schema:
        return number(self.lo, self.hi, self.doc)


class Integer(Spec):
    """An integer in ``[lo, hi]`` (``default`` when absent)."""

    def __init__(self, lo: int, hi: int, default: int | None, doc: str | None = None, **kw: Any) -> None:
        super().__init__(doc, **kw)
        self.lo, self.hi, self.default = lo, hi, default

    def absent(self) -> int | None:
        return self.default

    def convert(self, value: Any, name: str, parsed: dict[str, Any]) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.wrong(f"'{name}' must be an integer, got {value!r}", name)
        if not self.lo <= value <= self.hi:
            raise self.wrong(f"'{name}' must be between {self.lo} and {self.hi}, got {value}", name)
        return value

    def base_schema(self) -> Schema:
        return integer(self.lo, self.hi, self.doc)


class Flag(Spec):
    """true or false (false when absent); anything else is a 400."""

    def absent(self) -> bool:
        return False

    def convert(self, value: Any, name: str, parsed: dict[str, Any]) -> bool:
        if not isinstance(value, bool):
            raise self.wrong(f"'{name}' must be true or false", name)
        return value

    def base_schema(self) -> Schema:
        return {**BOOL, "description": self.doc} if self.doc else dict(BOOL)


class Text(Spec):
    """A string of ``min_length`` to ``max_length`` characters (``default`` when absent)."""

    def __init__(self, default: str | None = None, doc: str | None = None, *, min_length: int = 0,
                 max_length: int | None = None, **kw: Any) -> None:
        super().__init__(doc, **kw)
        self.default, self.min_length, self.max_length = default, min_length, max_length

    def absent(self) -> str | None:
        return self.default

    def convert(self, value: Any, name: str, parsed: dict[str, Any]) -> str:
        if not isinstance(value, str) or len(value) < self.min_length or \
                (self.max_length is not None and len(value) > self.max_length):
            at_most = f" of at most {self.max_length} characters" if self.max_length is not None else ""
            raise self.wrong(f"'{name}' must be a {'non-empty ' if self.min_length else ''}string{at_most}", name)
        return value

    def base_schema(self) -> Schema:
        return string(self.doc, min_length=self.min_length or None, max_length=self.max_length)


class Object(Spec):
    """A JSON object (when absent: ``{}`` if ``empty``, else None)."""

    def __init__(self, doc: str | None = None, *, empty: bool = False, **kw: Any) -> None:
        super().__init__(doc, **kw)
        self.empty = empty

    def absent(self) -> dict[str, Any] | None:
        return {} if self.empty else None

    def convert(self, value: Any, name: str, parsed: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.wrong(f"'{name}' must be an object", name)
        return value

    def base_schema(self) -> Schema:
        return {"type": "object", "description": self.doc} if self.doc else {"type": "object"}


class Custom(Spec):
    """A field read by a function of the whole body (and the fields read before it), with its own schema."""

    def __init__(self, reader: Callable[[dict[str, Any], dict[str, Any]], Any], schema: Schema,
                 doc: str | None = None, **kw: Any) -> None:
        super().__init__(doc, **kw)
        self.reader, self._schema = reader, schema

    def read(self, body: dict[str, Any], name: str, parsed: dict[str, Any]) -> Any:
        if self.required and self.is_absent(body, name):
            return super().read(body, name, parsed)
        return self.reader(body, parsed)

    def base_schema(self) -> Schema:
        return self._schema


class Passed(Spec):
    """Honoured as sent (read by the route, e.g. ``model`` or ``stream``), with its schema."""

    def __init__(self, schema: Schema, doc: str | None = None, **kw: Any) -> None:
        super().__init__(doc, **kw)
        self._schema = schema

    def base_schema(self) -> Schema:
        return self._schema


class Ignored(Passed):
    """Harmless metadata: accepted, listed as ignored, never read."""

    role = IGNORED


class Refused(Spec):
    """A field that would change the generation in a way this server cannot honour: a value other than
    one of its no-ops (compared with their JSON type) is a 400 ``unsupported_field`` saying ``why``."""

    role = REFUSED

    def __init__(self, noop: tuple[Any, ...], why: str, schema: Schema | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.noop, self.why, self._schema = noop, why, schema

    def convert(self, value: Any, name: str, parsed: dict[str, Any]) -> None:
        if any(value == v and type(value) is type(v) for v in self.noop):
            return None
        raise ApiError(400, self.message or f"'{name}' = {json.dumps(value)[:80]}: {self.why}", "unsupported_field",
                       param=name)

    def base_schema(self) -> Schema:
        return self._schema if self._schema is not None else {"description": f"refused (400): {self.why}"}


def not_supported(name: str) -> Refused:
    """A field refused (400 ``'<name>' is not supported``) unless absent, empty or null."""
    return Refused(([], {}), "not supported", message=f"'{name}' is not supported")


def spec(s: Spec, *, listed: bool = True) -> Any:
    """The dataclass field of a request model that ``s`` describes (``listed=False``: checked, but neither
    in the field table nor in the document)."""
    return dataclasses.field(default=None, metadata={"spec": s, "listed": listed})


_M = TypeVar("_M", bound="RequestModel")


class RequestModel:
    """Base of the request models (each a dataclass of :func:`spec` fields, named as in the JSON body)."""

    endpoint: ClassVar[str]
    #: the status and code of a field's error (:class:`FieldError`); the control API's models answer 422
    #: ``invalid_field`` (a missing field keeps its own code)
    field_error: ClassVar[tuple[int, str]] = (400, "invalid_value")

    @classmethod
    def specs(cls) -> list[tuple[str, Spec, bool]]:
        """(name, spec, listed) of each field, in declaration order (the order :meth:`parse` checks them)."""
        return [(f.name, f.metadata["spec"], f.metadata["listed"]) for f in dataclasses.fields(cls)  # type: ignore[arg-type]
                if "spec" in f.metadata]

    @classmethod
    def parse(cls: type[_M], body: dict[str, Any]) -> _M:
        """The checked request (a 400 naming the first field that is wrong)."""
        parsed: dict[str, Any] = {}
        try:
            for name, s, _ in cls.specs():
                parsed[name] = s.read(body, name, parsed)
            model = cls(**parsed)
            model.check()
        except FieldError as exc:
            status, code = cls.field_error
            if status == exc.status:
                raise
            raise ApiError(status, exc.message, code if exc.code == "invalid_value" else exc.code,
                           param=exc.param) from None
        return model

    def check(self) -> None:
        """Rules across fields (a 400); none by default."""

    @classmethod
    def table(cls) -> FieldTable:
        """The endpoint's field table (:mod:`swarmkit.server.fields`)."""
        listed = [(name, s) for name, s, shown in cls.specs() if shown]
        return FieldTable.of(cls.endpoint, known=(n for n, s in listed if s.role != IGNORED),
                             ignored=(n for n, s in listed if s.role == IGNORED))

    @classmethod
    def openapi_body(cls) -> Schema:
        """The JSON schema of the request body (open: unknown fields are allowed, see ``fields``)."""
        listed = [(name, s) for name, s, shown in cls.specs() if shown]
        return obj({name: s.schema() for name, s in listed}, tuple(name for name, s in listed if s.required))
