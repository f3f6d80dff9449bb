"""A small JSON-schema validator for the structured-output tests (the keywords their schemas use; jsonschema is not
a test dependency), and the logit bias that keeps a tiny random model's JSON compact."""
from __future__ import annotations

import re

# a schema of a nested object, an enum, a bounded integer and array, a pattern and required keys, whose outputs end
# within a few tens of tokens of a tiny vocabulary
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", "fish"]},
                         "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
                         "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4}},
                                  "required": ["city"], "additionalProperties": False}},
          "required": ["name", "age", "pet", "tags", "home"], "additionalProperties": False}


def schema_errors(value, schema, root=None, where="$") -> list[str]:
    """Where ``value`` breaks ``schema``: type, enum, const, properties, required, additionalProperties, items,
    minItems, maxItems, minimum, maximum, minLength, maxLength, pattern, anyOf and local $ref."""
    root = schema if root is None else root
    if "$ref" in schema:
        target = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        return schema_errors(value, target, root, where)
    if "anyOf" in schema:
        if all(schema_errors(value, option, root, where) for option in schema["anyOf"]):
            return [f"{where}: matches no anyOf option"]
    errors = []
    kinds = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    kind = schema.get("type")
    if kind is not None:
        if kind == "integer":
            fits = isinstance(value, int) and not isinstance(value, bool)
        elif kind == "number":
            fits = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            fits = isinstance(value, kinds[kind])
        if not fits:
            return [f"{where}: {value!r} is not of type {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} not in {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        errors.append(f"{where}: {value!r} is not {schema['const']!r}")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        errors += [f"{where}: misses {key!r}" for key in schema.get("required", []) if key not in value]
        for key, item in value.items():
            if key in properties:
                errors += schema_errors(item, properties[key], root, f"{where}.{key}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{where}: unexpected {key!r}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            errors.append(f"{where}: {len(value)} items")
        for index, item in enumerate(value):
            errors += schema_errors(item, schema.get("items", {}), root, f"{where}[{index}]")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < schema.get("minimum", value) or value > schema.get("maximum", value):
            errors.append(f"{where}: {value} out of range")
    if isinstance(value, str):
        if not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
            errors.append(f"{where}: {len(value)} characters")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{where}: {value!r} does not match {schema['pattern']}")
    return errors


def blank_tokens(tokenizer) -> list[int]:
    """The tokens whose text is only whitespace: a tiny random model favours them, and a bias of -100 on them keeps
    its JSON within the few tokens a test gives it (the grammar allows whitespace, never requires it)."""
    return [t for t in range(len(tokenizer)) if (text := tokenizer.decode([t])) and not text.strip()]
