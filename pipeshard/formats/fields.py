"""Reading a JSON document into a record: every field checked for presence, type and range, unknown fields
refused, each problem one UserError naming the file and the field's path (`sub_layers[3].blob.bytes`)."""

from __future__ import annotations

import math
from typing import Any

from pipeshard.core.errors import UserError


class Fields:
    """One JSON object of a file, read field by field; `done()` refuses the fields nobody read."""

    def __init__(self, document: Any, where: str, path: str = "") -> None:
        self.where, self.path = where, path
        if not isinstance(document, dict):
            self.fail(f"is {_kind(document)}, not an object")
        self.document = document
        self.read: set[str] = set()

    def fail(self, problem: str, name: str | None = None) -> None:
        field = self._field(name) if name is not None else (self.path or "the document")
        raise UserError(f"{self.where}: {field} {problem}")

    def _field(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def schema(self, version: int, remedy: str) -> None:
        """Refuse a document of another `schema_version`, saying how to make one this pipeshard reads."""
        found = self.raw("schema_version", None)
        if found != version:
            self.fail(f"is {found!r}: this pipeshard reads {version} ({remedy})", "schema_version")

    def has(self, name: str) -> bool:
        return self.document.get(name) is not None

    def raw(self, name: str, default: Any = ...) -> Any:
        """The field as it is; missing is an error unless a default is given (None counts as missing)."""
        self.read.add(name)
        value = self.document.get(name)
        if value is None:
            if default is ...:
                self.fail("is missing", name)
            return default
        return value

    def int(self, name: str, default: Any = ..., minimum: int | None = 0, maximum: int | None = None) -> int:
        value = self.raw(name, default)
        if value is default and default is not ...:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                self.fail(f"must be an integer, not {value!r}"[:200], name)
        if minimum is not None and value < minimum:
            self.fail(f"must be at least {minimum}, not {value}", name)
        if maximum is not None and value > maximum:
            self.fail(f"must be at most {maximum}, not {value}", name)
        return value

    def float(self, name: str, default: Any = ..., minimum: float | None = 0.0) -> float:
        value = self.raw(name, default)
        if value is default and default is not ...:
            return value
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            self.fail(f"must be a finite number, not {value!r}"[:200], name)
        if minimum is not None and value < minimum:
            self.fail(f"must be at least {minimum}, not {value}", name)
        return float(value)

    def str(self, name: str, default: Any = ..., choices: tuple[str, ...] | None = None) -> str:
        value = self.raw(name, default)
        if value is default and default is not ...:
            return value
        if not isinstance(value, str):
            self.fail(f"must be a string, not {_kind(value)}", name)
        if choices is not None and value not in choices:
            self.fail(f"is {value!r}, not one of {', '.join(choices)}", name)
        return value

    def bool(self, name: str, default: Any = ...) -> bool:
        value = self.raw(name, default)
        if not isinstance(value, bool):
            self.fail(f"must be true or false, not {value!r}"[:200], name)
        return value

    def list(self, name: str, default: Any = ...) -> list:
        value = self.raw(name, default)
        if value is default and default is not ...:
            return value
        if not isinstance(value, list):
            self.fail(f"must be a list, not {_kind(value)}", name)
        return value

    def object(self, name: str, default: Any = ...) -> Fields | None:
        """A nested object as Fields of its own (None when missing and the default is None)."""
        value = self.raw(name, default)
        if value is None:
            return None
        return Fields(value, self.where, self._field(name))

    def objects(self, name: str, default: Any = ...) -> list[Fields]:
        """A list of objects, each as Fields of its own."""
        return [
            Fields(item, self.where, f"{self._field(name)}[{i}]")
            for i, item in enumerate(self.list(name, default))
        ]

    def str_list(self, name: str, default: Any = ...) -> list[str]:
        values = self.list(name, default)
        for index, value in enumerate(values):
            if not isinstance(value, str):
                self.fail(f"[{index}] must be a string, not {_kind(value)}", name)
        return list(values)

    def int_list(self, name: str, default: Any = ..., minimum: int | None = None) -> list[int]:
        values = self.list(name, default)
        for index, value in enumerate(values):
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or (minimum is not None and value < minimum)
            ):
                self.fail(
                    f"[{index}] must be an integer{'' if minimum is None else f' >= {minimum}'}, not {value!r}"[
                        :200
                    ],
                    name,
                )
        return list(values)

    def number_map(self, name: str, default: Any = ..., minimum: float | None = None) -> dict[str, float]:
        """An object of names to finite numbers (cost coefficients, predicted seconds)."""
        value = self.raw(name, default)
        if value is default and default is not ...:
            return value
        if not isinstance(value, dict):
            self.fail(f"must be an object, not {_kind(value)}", name)
        for key, number in value.items():
            if isinstance(number, bool) or not isinstance(number, int | float) or not math.isfinite(number):
                self.fail(f"[{key!r}] must be a finite number, not {number!r}"[:200], name)
            if minimum is not None and number < minimum:
                self.fail(f"[{key!r}] must be at least {minimum}, not {number}", name)
        return {str(key): float(number) for key, number in value.items()}

    def done(self, ignore: tuple[str, ...] = ()) -> None:
        """Refuse fields this reader does not know (a misspelt field is an error, not a silent default)."""
        unknown = sorted(set(self.document) - self.read - set(ignore))
        if unknown:
            self.fail("is not a known field", unknown[0])


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number" if isinstance(value, int | float) else type(value).__name__
    )
