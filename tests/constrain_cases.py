"""Cases for the constrained-decoding tests: JSON schemas of different shapes whose valid values
are short (bounded strings, numbers and arrays), so a generation completes within a few dozen
tokens; checked by `jsonschema`, an implementation independent of llguidance."""

SCHEMAS = [
 {"type": "integer", "minimum": 0, "maximum": 50},
 {"type": "boolean"},
 {"enum": ["red", "green", "blue"]},
 {"type": "string", "maxLength": 6},
 {"type": "string", "pattern": "^[a-z]{2,4}-[0-9]{2}$"},
 {"type": "object", "properties": {"a": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["a"], "additionalProperties": False},
 {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False},
 {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
 {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 3},
 {"type": "object", "properties": {"p": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}, "y": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["x", "y"], "additionalProperties": False}}, "required": ["p"], "additionalProperties": False},
 {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 3}}, "required": ["ok"], "additionalProperties": False},
 {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}}, "required": ["tags"], "additionalProperties": False},
 {"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 1},
 {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]},
 {"type": "object", "properties": {"kind": {"const": "point"}, "v": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["kind", "v"], "additionalProperties": False},
 {"type": "null"},
 {"type": "array", "prefixItems": [{"type": "string", "maxLength": 3}, {"type": "integer", "minimum": 0, "maximum": 9}], "items": False, "minItems": 2} ,
 {"type": "object", "properties": {"m": {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2}, "minItems": 1, "maxItems": 2}}, "required": ["m"], "additionalProperties": False},
 {"type": "string", "enum": ["yes", "no"]},
 {"type": "object", "properties": {"id": {"type": "integer", "minimum": 100, "maximum": 999}, "color": {"enum": ["red", "blue"]}, "note": {"type": "string", "maxLength": 5}}, "required": ["id", "color"], "additionalProperties": False},
]
